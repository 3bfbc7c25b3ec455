"""Scheduler -> worker: the KV connector's part of one step's plan.

The scheduler side of a KV connector decides which blocks move and under which keys;
the worker side only moves bytes. A key names one block's KV everywhere: the hex of
its block hash (the chained hash of the prefix cache, kvflow/block_hash.py), so the
same tokens under the same model always map to the same key.
"""

from __future__ import annotations

import msgspec


class KVBlockTransfer(msgspec.Struct, array_like=True, gc=False):
    """Blocks of one request to load into (or save from) the paged cache."""

    req_id: str
    block_ids: list[int]  # local block ids, position order
    keys: list[str]  # one per block id
    remote: str = ""  # zmq: the producer to pull from ("tcp://host:port")


class KVConnectorMeta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    # Loaded before the forward pass: the step computes on top of them.
    loads: list[KVBlockTransfer] = []
    # Saved after the forward pass: prompts that this step completed.
    saves: list[KVBlockTransfer] = []


class KVTransferStepStats(msgspec.Struct, array_like=True, gc=False):
    """Worker -> scheduler, in a StepResult: what this step's connector moved."""

    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_s: float = 0.0
    save_s: float = 0.0
    # Asynchronous loads (zmq) that ended since the last step: the request ids.
    finished_loading: list[str] = []
    failed_loading: list[str] = []


class KVTransferStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Scheduler -> frontends, in SchedulerStats: cumulative counts, plus the transfer
    times since the last stats message (the frontend's histogram observes those)."""

    num_loaded_requests: int = 0
    num_loaded_tokens: int = 0  # prompt tokens whose KV came from outside
    num_saved_blocks: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    num_load_failures: int = 0
    # Prompt tokens this engine computed itself: on a decode instance that loads every
    # prompt, one per request (the last prompt token, whose logits it samples from).
    num_computed_prompt_tokens: int = 0
    load_seconds: list[float] = []
    save_seconds: list[float] = []
    num_waiting_for_remote_kv: int = 0  # a gauge: requests parked for their KV now


class KVPull(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Consumer -> producer (zmq connector): send me these blocks of this request."""

    req_id: str
    keys: list[str]


class KVBlocksHeader(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Producer -> consumer, the first frame of the answer to a KVPull; one raw frame per
    found block follows, each `shape` of `dtype` in C order (every layer's K and V)."""

    req_id: str
    keys: list[str]  # the blocks that follow, in order (the ones the producer holds)
    dtype: str
    shape: list[int]  # [num_layers, 2, block_size, kv_heads, head_dim]
