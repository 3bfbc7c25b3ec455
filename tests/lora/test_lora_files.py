"""Adapter checks before anything loads: each bad adapter gets its own clear error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvflow.errors import ConfigError, LoRAAdapterError
from kvflow.lora_config import LoRAConfig, parse_lora_module
from kvflow.lora_files import BaseShapes, read_adapter

BASE = BaseShapes(num_layers=2, hidden=64, q_size=64, kv_size=32, intermediate=128, is_moe=False)
PREFIX = "base_model.model.model.layers"


def _write(
    path: Path, rank: int = 4, tensors: dict[str, torch.Tensor] | None = None, **config: object
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    options = {"r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], **config}
    (path / "adapter_config.json").write_text(json.dumps(options))
    if tensors is None:
        tensors = {
            f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(rank, 64),
            f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.ones(64, rank),
            f"{PREFIX}.1.mlp.down_proj.lora_A.weight": torch.ones(rank, 128),
            f"{PREFIX}.1.mlp.down_proj.lora_B.weight": torch.ones(64, rank),
        }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_a_good_adapter_with_its_scaling(tmp_path: Path) -> None:
    info = read_adapter(_write(tmp_path / "a"), BASE, max_rank=8)
    assert info.rank == 4 and info.scaling == 8 / 4
    assert set(info.modules) == {(0, "q_proj"), (1, "down_proj")}
    rs = read_adapter(_write(tmp_path / "rs", use_rslora=True), BASE, max_rank=8)
    assert rs.scaling == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "adapter_config.json is missing"),
        (lambda p: _write(p / "big", rank=16), "rank 16 is above --max-lora-rank 8"),
        (lambda p: _write(p / "t", target_modules=["lm_head"]), "'lm_head' is not a module"),
        (lambda p: _write(p / "dora", use_dora=True), "DoRA"),
        (
            lambda p: _write(
                p / "shape",
                tensors={
                    f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32),
                    f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4),
                },
            ),
            r"needs a float \[4, 64\]",
        ),
        (
            lambda p: _write(
                p / "layer",
                tensors={
                    f"{PREFIX}.7.self_attn.q_proj.lora_A.weight": torch.ones(4, 64),
                    f"{PREFIX}.7.self_attn.q_proj.lora_B.weight": torch.ones(64, 4),
                },
            ),
            "no such module",
        ),
        (
            lambda p: _write(
                p / "half",
                tensors={
                    f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64),
                },
            ),
            "lora_B is missing",
        ),
    ],
)
def test_bad_adapters_are_refused(tmp_path: Path, make: object, message: str) -> None:
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(make(tmp_path), BASE, max_rank=8)  # type: ignore[operator]


def test_pickle_and_corrupt_files_are_refused(tmp_path: Path) -> None:
    pickled = _write(tmp_path / "bin")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match="pickle, which kvflow never loads"):
        read_adapter(pickled, BASE, max_rank=8)
    corrupt = _write(tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(LoRAAdapterError, match="truncated"):
        read_adapter(corrupt, BASE, max_rank=8)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(LoRAAdapterError, match="not a valid safetensors"):
        read_adapter(corrupt, BASE, max_rank=8)
    (corrupt / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="cannot be read"):
        read_adapter(corrupt, BASE, max_rank=8)


def test_moe_base_refuses_mlp_targets(tmp_path: Path) -> None:
    moe = BaseShapes(num_layers=2, hidden=64, q_size=64, kv_size=32, intermediate=128, is_moe=True)
    with pytest.raises(LoRAAdapterError, match="experts of a mixture-of-experts"):
        read_adapter(_write(tmp_path / "a"), moe, max_rank=8)


def test_lora_root_and_module_flags(tmp_path: Path) -> None:
    config = LoRAConfig(enable_lora=True, lora_root=str(tmp_path / "root"))
    assert config.check_path(str(tmp_path / "root" / "a")) == (tmp_path / "root" / "a").resolve()
    with pytest.raises(LoRAAdapterError, match="outside --lora-root"):
        config.check_path(str(tmp_path / "root" / ".." / "elsewhere"))
    assert parse_lora_module("sql=/a/b").path == "/a/b"
    module = parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "base"}')
    assert module.base_model_name == "base"
    with pytest.raises(ConfigError, match="name=path or JSON"):
        parse_lora_module("just-a-name")
    with pytest.raises(ConfigError, match="needs --enable-lora"):
        LoRAConfig(lora_modules=(module,))
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_bench_adapters_pass_the_checks(tmp_path: Path) -> None:
    """`kvflow bench throughput --lora-adapters`'s synthetic adapters: PEFT layout, all
    seven targets, accepted as they are."""
    from kvflow.bench.lora_bench import make_adapters

    base_dir = tmp_path / "base"
    base_dir.mkdir()
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128}  # fmt: skip
    (base_dir / "config.json").write_text(json.dumps(config))
    paths = make_adapters(base_dir, tmp_path / "adapters", count=2, rank=4)
    for path in paths:
        info = read_adapter(path, BASE, max_rank=4)
        assert len(info.modules) == 2 * 7 and info.scaling == 2.0
