"""Engine configuration: one frozen dataclass per concern.

Each component receives only its own sub-config. "auto" values (dtype, device,
attention backend) are resolved by `EngineConfig.create()` *before* the dataclasses
are frozen, so a config object never changes after construction. CLI flags are
generated from the fields and their `help` metadata (see `kvflow/cli/args.py`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from kvflow.device_resolution import (
    check_quantization,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from kvflow.errors import ConfigError
from kvflow.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config
from kvflow.lora_config import LoRAConfig, parse_lora_module
from kvflow.pooling import PoolerConfig, Runner, check_pooling_engine, parse_pooler_config
from kvflow.scheduler_config import SchedulerConfig
from kvflow.speculative_config import SpeculativeConfig, parse_speculative_config

DType = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDType = Literal[
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"
]
# The 8-bit formats of kernels/kv_codec.py (codes + a float32 scale per row); `fp8` is
# the name vLLM users type for fp8_e4m3.
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
_KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


LoadBalance = Literal["prefix-aware", "least-load", "round-robin"]


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _opt(
        None, "HF directory or .gguf file; empty = embedded SmolLM2-135M-Instruct"
    )
    dtype: DType = _opt(
        "auto", "weight/activation dtype; auto = bfloat16 on CUDA, on CPU the faster by measurement"
    )
    quantization: Literal["none", "q8_0", "gguf"] = _opt(
        "none",
        "CPU linear layers on int8 activations at every batch size: q8_0 = Q8_0 blocks made "
        "at load from the float weights; gguf = a GGUF checkpoint's own blocks "
        "(docs/quantization.md)",
    )
    load_format: Literal["auto", "dummy"] = _opt(
        "auto",
        "auto = the checkpoint's weights; dummy = random weights of the model's shapes "
        "(a directory with config.json and tokenizer files suffices: benchmarks)",
    )
    skip_tokenizer_init: bool = _opt(
        False, "no tokenizer: token-id prompts, outputs token ids with empty text"
    )
    max_model_len: int | None = _opt(None, "context length cap (default: model's own)")
    served_model_name: str | None = _opt(None, "name reported by /v1/models")
    seed: int = _opt(0, "seed of the global sampler generator")
    runner: Runner = _opt(
        "generate",
        "generate = text generation; pooling = an embedder: prompts are prefilled and "
        "pooled into one vector each (/v1/embeddings, /pooling, LLM.embed)",
    )
    pooler_config: PoolerConfig | None = field(
        default=None,
        metadata={
            "help": "the pooling runner's pooler as JSON, e.g. "
            '\'{"pooling_type": "MEAN", "normalize": false}\' (types LAST, MEAN, CLS; '
            "default: the model's sentence-transformers files, else LAST normalised)",
            "parse": parse_pooler_config,
        },
    )


_KV_CACHE_DTYPES: tuple[str, ...] = typing.get_args(KVCacheDType)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV block")
    kv_cache_memory: float = _opt(2.0, "GiB of KV cache on CPU")
    gpu_memory_utilization: float = _opt(
        0.9, "fraction of GPU memory this engine takes for weights + KV"
    )
    num_blocks: int | None = _opt(None, "override the number of KV blocks (tests)")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prompt prefixes")
    hybrid_kv_cache: bool = _opt(
        True,
        "one block table per layer kind (full / sliding window), sliding-window layers "
        "keeping only the blocks in their window; off: every layer keeps every block",
    )
    kv_cache_dtype: KVCacheDType = _opt(
        "auto",
        "KV cache storage: auto = the model dtype; int8, fp8 (= fp8_e4m3) or fp8_e5m2 = "
        "8-bit codes + a float32 scale per (token, head) row, ~half a bf16 cache",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(_KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be > 0")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _opt(1, "tensor-parallel ranks")
    pipeline_parallel_size: int = _opt(1, "pipeline-parallel stages")
    pp_layer_partition: str | None = _opt(
        None, "layers per pipeline stage, e.g. 10,14; unset: even, the first stages +1"
    )
    data_parallel_size: int = _opt(1, "engine cores (each with its own workers) behind the API")
    load_balance: LoadBalance = _opt(
        "prefix-aware", "how the frontend picks an engine when data_parallel_size > 1"
    )
    enable_expert_parallel: bool = _opt(
        False,
        "mixture-of-experts layers give each tensor-parallel rank whole experts "
        "(E/tp of them) instead of a slice of every expert",
    )

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
            )
        raw: Any = self.pp_layer_partition
        if raw is not None and not isinstance(raw, str):  # LLM(pp_layer_partition=[a, b])
            object.__setattr__(self, "pp_layer_partition", ",".join(map(str, raw)))
        partition = self.layer_partition  # parsed here, so a typo fails at once
        if partition is not None and len(partition) != self.pipeline_parallel_size:
            raise ConfigError(
                f"pp_layer_partition {self.pp_layer_partition!r} names {len(partition)} stages; "
                f"pipeline_parallel_size is {self.pipeline_parallel_size}"
            )

    @property
    def layer_partition(self) -> tuple[int, ...] | None:
        """`pp_layer_partition` as layers per stage (None: the even split)."""
        if self.pp_layer_partition is None:
            return None
        try:
            counts = tuple(int(part) for part in self.pp_layer_partition.split(","))
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            raise ConfigError(
                f"pp_layer_partition must be comma-separated layer counts >= 1, "
                f"got {self.pp_layer_partition!r}"
            )
        return counts

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class DeviceConfig:
    device: Literal["auto", "cpu", "cuda"] = _opt("auto", "cpu or cuda; auto picks cuda if present")
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = _opt(
        "auto", "cpu (CPU default: torch + native decode kernel), torch, or triton (CUDA default)"
    )
    enforce_eager: bool = _opt(False, "disable decode graphs (CUDA graphs, and their CPU replays)")
    num_threads: int | None = _opt(None, "torch CPU threads (default: all cores)")
    peak_flops: float | None = _opt(
        None, "the device's peak FLOP/s for roofline %% (default: GPU table or CPU calibration)"
    )
    peak_bandwidth: float | None = _opt(
        None, "the device's peak memory bytes/s for roofline %% (default: as --peak-flops)"
    )
    measure_weight_read: bool = _opt(
        False,
        "CPU: at start-up, time a read pass over the loaded weights in the worker and "
        "take it as the bandwidth roof (this process's own DRAM rate; replaces "
        "--peak-bandwidth)",
    )

    def __post_init__(self) -> None:
        if self.measure_weight_read and self.device == "cuda":
            raise ConfigError("measure_weight_read times a CPU read pass: not with device=cuda")


@dataclass(frozen=True)
class SpeculativeOptions:
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata={
            "help": "speculative decoding as JSON, e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\' (methods: ngram, suffix, '
            'and draft_model with "model": a smaller model\'s path)',
            "parse": parse_speculative_config,
        },
    )


@dataclass(frozen=True)
class KVTransferOptions:
    kv_transfer_config: KVTransferConfig | None = field(
        default=None,
        metadata={
            "help": "disaggregated prefill/decode as JSON, e.g. "
            '\'{"kv_role": "kv_producer", "kv_connector": "shared-storage", '
            '"kv_connector_extra_config": {"storage_path": "/tmp/kv"}}\'',
            "parse": parse_kv_transfer_config,
        },
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = _opt(
        "recompute",
        "a remote KV load that fails or times out: compute the prompt here, or fail the request",
    )
    kv_load_timeout: float = _opt(
        30.0, "seconds a decode instance waits for a prompt's KV from its producer"
    )

    def __post_init__(self) -> None:
        if not self.kv_load_timeout > 0:
            raise ConfigError(f"kv_load_timeout must be > 0, got {self.kv_load_timeout}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    kv_transfer: KVTransferOptions = field(default_factory=KVTransferOptions)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        kv = self.kv_transfer.kv_transfer_config
        parallel = self.parallel
        if self.lora.enable_lora and parallel.pipeline_parallel_size > 1:
            raise ConfigError("LoRA serving runs with tensor parallelism, not pipeline stages")
        if kv is not None and (parallel.world_size > 1 or parallel.data_parallel_size > 1):
            # Each rank holds a shard of every block, and each engine would bind the
            # same KV port: transfers per rank and per engine are not built yet.
            raise ConfigError(
                "kv_transfer_config works with one engine of one rank for now "
                "(tensor, pipeline and data parallel sizes 1); run one instance per engine"
            )
        if self.model.runner == "pooling":
            check_pooling_engine(self)

    @property
    def max_steps_in_flight(self) -> int:
        """Plans awaiting results at once: the pipeline's depth with P stages (a
        micro-batch per stage), else 2 with async scheduling, else 1."""
        stages = self.parallel.pipeline_parallel_size
        return stages if stages > 1 else self.scheduler.max_steps_in_flight

    @classmethod
    def create(cls, **options: Any) -> EngineConfig:
        """Build from flat options (`block_size=32`, ...); unknown keys are errors."""
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        by_section: dict[str, dict[str, Any]] = {name: {} for name in sections}
        owners = {
            f.name: section
            for section, sub in _SECTION_TYPES.items()
            for f in dataclasses.fields(sub)
        }
        for key, value in options.items():
            if key not in owners:
                raise ConfigError(f"unknown engine option {key!r}")
            by_section[owners[key]][key] = value
        device = resolve_device(by_section["device"].get("device", "auto"))
        by_section["device"]["device"] = device
        by_section["device"]["attention_backend"] = resolve_attention_backend(
            by_section["device"].get("attention_backend", "auto"), device
        )
        spec = by_section["speculative"].get("speculative_config")
        if spec is not None:  # JSON text or a dict (LLM(speculative_config={...}))
            by_section["speculative"]["speculative_config"] = SpeculativeConfig.parse(spec)
        kv_transfer = by_section["kv_transfer"].get("kv_transfer_config")
        if kv_transfer is not None:  # JSON text or a dict (LLM(kv_transfer_config={...}))
            by_section["kv_transfer"]["kv_transfer_config"] = KVTransferConfig.parse(kv_transfer)
        pooler = by_section["model"].get("pooler_config")
        if pooler is not None:  # JSON text or a dict (LLM(pooler_config={...}))
            by_section["model"]["pooler_config"] = PoolerConfig.parse(pooler)
        quantization = by_section["model"].get("quantization", "none")
        check_quantization(quantization, device, by_section["model"].get("dtype", "auto"))
        by_section["model"]["dtype"] = (
            "float32"  # the kernel computes in float32: no bf16 rounding between layers
            if quantization != "none" and by_section["model"].get("dtype", "auto") == "auto"
            else resolve_dtype(by_section["model"].get("dtype", "auto"), device)
        )
        kv_cache_dtype = resolve_kv_cache_dtype(
            by_section["cache"].get("kv_cache_dtype", "auto"), by_section["model"]["dtype"]
        )
        by_section["cache"]["kv_cache_dtype"] = kv_cache_dtype
        modules = by_section["lora"].get("lora_modules")
        if modules is not None:  # a list from the CLI (nargs) or from LLM(...)
            by_section["lora"]["lora_modules"] = tuple(parse_lora_module(m) for m in modules)
        return cls(**{name: _SECTION_TYPES[name](**kw) for name, kw in by_section.items()})


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
    "speculative": SpeculativeOptions,
    "kv_transfer": KVTransferOptions,
    "lora": LoRAConfig,
}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The cache's concrete name: the model dtype for auto, fp8_e4m3 for fp8, else as
    given. A float cache of another dtype than the model's would only round values the
    model computed at its own precision (or store more bytes for nothing): refused."""
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype must be one of {', '.join(_KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "auto":
        return model_dtype
    name = _KV_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in QUANTIZED_KV_DTYPES and name != model_dtype:
        raise ConfigError(
            f"kv_cache_dtype {name} differs from the model dtype {model_dtype}: a float KV "
            f"cache holds the model dtype (use auto), or pick int8, fp8_e4m3 or fp8_e5m2"
        )
    return name
