"""Scheduler -> frontend(s): periodic engine statistics for /metrics and /health."""

from __future__ import annotations

import msgspec

from kvflow.proto.kv_transfer import KVTransferStats


class PhaseTotals(msgspec.Struct, array_like=True, gc=False):
    """Cumulative work of one step phase ("prefill" or "decode", see kvflow.metrics.roofline)."""

    steps: int = 0
    seconds: float = 0.0  # plan sent -> result back
    flops: float = 0.0  # estimated (floats: an int64 of FLOPs overflows within hours)
    bytes: float = 0.0  # estimated bytes moved to and from device memory


class StepRecord(msgspec.Struct, array_like=True, gc=False):
    """One engine step, for the web UI's timeline."""

    prefill_tokens: int  # scheduled tokens at prompt positions
    decode_tokens: int
    seconds: float  # plan sent -> result back
    preemptions: int = 0  # requests preempted since the step before


class KVBlockMap(msgspec.Struct, array_like=True, gc=False):
    """KV blocks by bucket of consecutive block ids, each bucket's share in percent
    (free = 100 - used - cached). Large pools are sampled (services/scheduler/block_map.py)."""

    num_blocks: int
    used: list[int]  # referenced by a request
    cached: list[int]  # free, but holding a reusable prefix (a cache hit revives it)


class GrammarStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Guided decoding: cumulative counts, plus the compiles finished since the last
    stats message (seconds each)."""

    compile_seconds: list[float] = []
    cache_hits: int = 0
    cache_misses: int = 0
    compile_timeouts: int = 0
    requests_by_kind: dict[str, int] = {}  # json | regex | choice | grammar | json_object
    jump_forward_tokens: int = 0  # tokens appended without a model step (grammar-forced)


class LoRAStats(msgspec.Struct, array_like=True, gc=False):
    """The adapters of running and of waiting requests (kvflow:lora_requests_info)."""

    running: list[str]
    waiting: list[str]
    max_lora: int


class SchedulerStats(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    timestamp: float
    engine: str  # data-parallel rank / engine identity, the `engine` metric label
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    # Cumulative counters since start (the frontend exports deltas as counters).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    # Images looked up in the worker's encoder cache (once per image of a request, when
    # its placeholder run is first computed) and those found there.
    mm_encoder_cache_queries: int = 0
    mm_encoder_cache_hits: int = 0
    # Tokens of each step since the last stats message (kvflow:iteration_tokens_total).
    step_tokens: list[int] = []
    # Estimated work per step phase since start (kvflow:estimated_flops_total, ...).
    roofline: dict[str, PhaseTotals] = {}
    # The device's peaks as the worker resolved them (0 = unknown).
    peak_flops: float = 0.0  # FLOP/s
    peak_bandwidth: float = 0.0  # bytes/s
    # Seconds per start-up phase (model_load, kv_cache_allocate, ...; the same every time).
    startup_phases: dict[str, float] = {}
    # Random id of the scheduler process: a new value means the scheduler restarted and
    # requests in flight before it are lost (frontends fail them).
    incarnation: str = ""
    # Worker crash recovery (services/scheduler/recovery.py): why the worker is being
    # waited for ("" while it serves), and cumulative counts since start.
    recovering: str = ""
    num_worker_restarts: int = 0
    num_resumed_requests: int = 0
    # The steps since the last stats message (the newest ones, at most 64) and the
    # state of the KV blocks: the web UI's engine view.
    recent_steps: list[StepRecord] = []
    kv_block_map: KVBlockMap | None = None
    grammar: GrammarStats | None = None  # None until a guided request arrives
    kv_transfer: KVTransferStats | None = None  # None without a KV connector
    lora: LoRAStats | None = None  # None without --enable-lora
    # Speculative decoding, cumulative (vLLM's spec_decode_* metrics): verification steps
    # with drafts, draft tokens, accepted drafts, and accepted drafts per position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = []
    # Peers refused on this engine's tcp:// links, cumulative, by role (scheduler,
    # worker, detokenizer): kvflow:cluster_auth_failures_total.
    cluster_auth_failures: dict[str, int] = {}
