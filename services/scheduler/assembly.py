"""One way to assemble an engine core: config + the runner's shape -> EngineCore.

    EngineShape (what the workers report: vocabulary, context, KV blocks, EOS ids)
      └─ build_engine_core ─ KVCacheManager, build_scheduler (its step features:
                             speculation, KV transfer, micro-batches, jump-forward,
                             prompt logprobs), grammar compiler ─▶ EngineCore

The scheduler process (services/scheduler/main.py) and the offline engine
(kvflow/offline/engine.py) both call `build_engine_core`, so served and offline
engines schedule by the same parts. The Scheduler itself is built in
`build_scheduler` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config import EngineConfig
from kvflow.kv_transfer.scheduler.connector import make_connector_scheduler
from kvflow.kv_transfer_config import engine_kv_namespace
from kvflow.pooling import PoolingSpec
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.grammar_compiler import TokenizerSource, grammar_compiler
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.services.scheduler.spec_decode.speculator import make_speculator


@dataclass(frozen=True)
class EngineShape:
    """What the model runner(s) determined at start-up."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    eos_token_ids: frozenset[int]
    pooling: PoolingSpec | None = None  # the pooling runner's pooler (None: generate)
    # The KV cache groups' windows (kvflow/kv_groups.py; None = full attention).
    kv_group_windows: tuple[int | None, ...] = (None,)


def build_engine_core(
    config: EngineConfig, shape: EngineShape, tokenizer_loader: TokenizerSource
) -> EngineCore:
    """The engine core over `shape.num_blocks` KV blocks; `tokenizer_loader` gives the
    tokenizer that guided requests' grammars compile against (called when first needed)."""
    block_size = config.cache.block_size
    limits = EngineLimits(
        vocab_size=shape.vocab_size,
        max_model_len=shape.max_model_len,
        block_size=block_size,
        num_blocks=shape.num_blocks,
        eos_token_ids=shape.eos_token_ids,
        pooling=shape.pooling is not None,
        kv_group_windows=shape.kv_group_windows,
        max_chunk_tokens=config.scheduler.max_num_batched_tokens,
        enable_lora=config.lora.enable_lora,
    )
    kv_cache = KVCacheManager(
        shape.num_blocks,
        block_size,
        config.cache.enable_prefix_caching,
        group_windows=shape.kv_group_windows,
    )
    return EngineCore(
        build_scheduler(config, kv_cache, shape),
        limits,
        config.max_steps_in_flight,
        grammar_compiler(limits, tokenizer_loader),
        config.scheduler.grammar_compile_timeout,
    )


def build_scheduler(
    config: EngineConfig, kv_cache: KVCacheManager, shape: EngineShape
) -> Scheduler:
    """The Scheduler with the parts the config asks for."""
    features = make_step_features(
        config.scheduler,
        kv_cache,
        shape.max_model_len,
        speculator=make_speculator(config.speculative.speculative_config),
        kv_connector=make_connector_scheduler(
            config.kv_transfer.kv_transfer_config,
            config.cache.block_size,
            engine_kv_namespace(config),
            config.kv_transfer.kv_load_failure_policy,
        ),
        pipeline_depth=config.parallel.pipeline_parallel_size,
        pooling=shape.pooling,
        max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
    )
    return Scheduler(config.scheduler, kv_cache, shape.max_model_len, shape.vocab_size, features)
