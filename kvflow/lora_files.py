"""PEFT LoRA adapters on disk: checked against the base model before anything loads.

An adapter is a directory with `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules) and `adapter_model.safetensors`, whose tensors are named like::

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out, r]

`read_adapter` reads the config and the safetensors *header* only (JSON; no tensor is
touched), so the frontend answers a bad adapter with a 4xx at once, and the worker
loads tensors it knows fit. A pickled `adapter_model.bin` is refused: kvflow never
unpickles. The targets are the dense projections q/k/v/o/gate/up/down (Phi-3's fused
`qkv_proj` and `gate_up_proj` too); a mixture-of-experts base takes LoRA on its
attention only. Scaling is lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.errors import LoRAAdapterError
from kvflow.lora_config import LoRAConfig
from kvflow.proto.lora import LoRARequest

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Checkpoints that store a fused projection (Phi-3) name it so; its B stacks the parts.
FUSED_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = (
    "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin",
)  # fmt: skip
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.([\w.]+)\.lora_([AB])(?:\.\w+)?\.weight$"
)
_SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}


@dataclass(frozen=True)
class BaseShapes:
    """The base model's projection sizes (from its config.json)."""

    num_layers: int
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    is_moe: bool

    @classmethod
    def from_config(cls, config: Any) -> BaseShapes:
        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

        heads = int(get("num_attention_heads"))
        head_dim = int(get("head_dim") or int(get("hidden_size")) // heads)
        experts = get("num_experts") or get("num_local_experts")
        return cls(
            num_layers=int(get("num_hidden_layers")),
            hidden=int(get("hidden_size")),
            q_size=heads * head_dim,
            kv_size=int(get("num_key_value_heads") or heads) * head_dim,
            intermediate=int(get("intermediate_size") or 0),
            is_moe=bool(experts),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> BaseShapes:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return cls.from_config(config.get("text_config", config))

    def dims(self, module: str) -> tuple[int, int]:
        """(in, out) of a target projection; LoRAAdapterError if the base lacks it."""
        if self.is_moe and module not in ATTENTION_TARGETS and module != "qkv_proj":
            raise LoRAAdapterError(
                f"LoRA target {module!r}: the experts of a mixture-of-experts model take no "
                "LoRA; target the attention projections (q/k/v/o_proj)"
            )
        h, q, kv, inter = self.hidden, self.q_size, self.kv_size, self.intermediate
        table = {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
            "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * inter),
        }  # fmt: skip
        if module not in table:
            raise LoRAAdapterError(
                f"LoRA target {module!r} is not a module kvflow's base model has; targets: "
                f"{', '.join(ATTENTION_TARGETS + MLP_TARGETS)}"
            )
        return table[module]


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: its rank, scaling and which (layer, module) it adapts."""

    path: Path
    rank: int
    scaling: float
    # (layer, module) -> (A's tensor name, B's tensor name)
    modules: dict[tuple[int, str], tuple[str, str]]

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE


def read_adapter(path: str | Path, base: BaseShapes, max_rank: int) -> AdapterInfo:
    """Check a PEFT adapter directory against the base; LoRAAdapterError says why not."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise LoRAAdapterError(f"no LoRA adapter at {str(path)!r}: {CONFIG_FILE} is missing")
    config = _read_config(path / CONFIG_FILE)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"{CONFIG_FILE}: r must be a positive int and lora_alpha a number")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA rank {rank} is above --max-lora-rank {max_rank}")
    _check_options(config)
    if not (path / WEIGHTS_FILE).is_file():
        if (path / PICKLE_FILE).is_file():
            raise LoRAAdapterError(
                f"{PICKLE_FILE} is a pickle, which kvflow never loads; save the adapter "
                "with safetensors (PEFT's save_pretrained(..., safe_serialization=True))"
            )
        raise LoRAAdapterError(f"no {WEIGHTS_FILE} in {str(path)!r}")
    header = read_safetensors_header(path / WEIGHTS_FILE)
    modules = _check_tensors(header, base, rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterInfo(path, rank, float(scaling), modules)


def _read_config(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"{CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_options(config: dict[str, Any]) -> None:
    """The PEFT options that change the math beyond B·A·scaling are refused."""
    if config.get("use_dora"):
        raise LoRAAdapterError("DoRA adapters (use_dora) are not LoRA; kvflow serves LoRA")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA bias={config['bias']!r}: only bias='none' adapters serve")
    if config.get("modules_to_save"):
        raise LoRAAdapterError("modules_to_save would replace base weights; not a LoRA delta")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAAdapterError("rank_pattern/alpha_pattern: one rank and alpha per adapter")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            name = str(target).rsplit(".", 1)[-1]
            if name not in (*ATTENTION_TARGETS, *MLP_TARGETS, *FUSED_TARGETS):
                raise LoRAAdapterError(
                    f"LoRA target {target!r} is not a module kvflow's base model has; "
                    f"targets: {', '.join(ATTENTION_TARGETS + MLP_TARGETS)}"
                )


def _check_tensors(
    header: dict[str, Any], base: BaseShapes, rank: int
) -> dict[tuple[int, str], tuple[str, str]]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"tensor {key!r} is not a LoRA A/B of a decoder projection")
        layer, path, ab = int(match[1]), match[2], match[3]
        module = path.rsplit(".", 1)[-1]
        if "expert" in path or "block_sparse_moe" in path:
            raise LoRAAdapterError(
                f"tensor {key!r}: the experts of a mixture-of-experts model take no LoRA; "
                "target the attention projections (q/k/v/o_proj)"
            )
        if path not in (f"self_attn.{module}", f"mlp.{module}") or layer >= base.num_layers:
            raise LoRAAdapterError(f"tensor {key!r}: the base model has no such module")
        fan_in, fan_out = base.dims(module)
        want = [rank, fan_in] if ab == "A" else [fan_out, rank]
        if list(meta.get("shape", [])) != want or meta.get("dtype") not in _SAFETENSORS_DTYPES:
            raise LoRAAdapterError(
                f"tensor {key!r} is {meta.get('dtype')} {meta.get('shape')}; the base "
                f"needs a float {want} (rank {rank})"
            )
        found.setdefault((layer, module), {})[ab] = key
    if not found:
        raise LoRAAdapterError("the adapter has no LoRA tensors")
    modules = {}
    for target, pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"layer {target[0]} {target[1]}: lora_A or lora_B is missing")
        modules[target] = (pair["A"], pair["B"])
    return modules


def read_safetensors_header(file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file's size."""
    try:
        with file.open("rb") as f:
            size = file.stat().st_size
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise LoRAAdapterError(f"{file.name} is not a valid safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{file.name} is not a valid safetensors file")
    try:
        ends = [int(m["data_offsets"][1]) for k, m in header.items() if k != "__metadata__"]
    except (KeyError, TypeError, IndexError, ValueError):
        raise LoRAAdapterError(f"{file.name} has a malformed header (corrupt)") from None
    if 8 + length + max(ends, default=0) > size:
        raise LoRAAdapterError(f"{file.name} is truncated (corrupt)")
    return header


class LoRAAdapterCheck:
    """Where requests enter (the offline engine, the frontend): is this adapter one the
    engine can serve? Each adapter (by id and path) is read once."""

    def __init__(self, config: LoRAConfig, model_dir: Path) -> None:
        self.config = config
        self.base = BaseShapes.from_model_dir(model_dir)
        self._checked: dict[tuple[int, str], AdapterInfo] = {}

    def check(self, lora: LoRARequest) -> AdapterInfo:
        if not self.config.enable_lora:
            raise LoRAAdapterError("LoRA adapters need an engine started with enable_lora")
        if lora.lora_int_id < 1:
            raise LoRAAdapterError(f"lora_int_id must be >= 1, got {lora.lora_int_id}")
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self._checked:
            path = self.config.check_path(lora.lora_path)
            self._checked[key] = read_adapter(path, self.base, self.config.max_lora_rank)
        return self._checked[key]
