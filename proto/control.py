"""Start-up acks, heartbeats and failures (launcher and liveness channels)."""

from __future__ import annotations

import msgspec

from kvflow.proto.step import StepResult


class ProcessReady(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Sent once by each child when it can serve (the launcher waits for all)."""

    role: str  # scheduler | worker | detokenizer | frontend
    rank: int = 0
    pid: int = 0
    # Facts the launcher reports, e.g. {"num_blocks": 1234, "load_s": 1.2}.
    info: dict[str, float] = {}


class ProcessFailed(msgspec.Struct, tag=True, array_like=True):
    """A child could not start or hit a fatal error; `error` names what happened."""

    role: str
    rank: int
    error: str


class WorkerHeartbeat(msgspec.Struct, tag=True, array_like=True):
    """Workers send one every second from a side thread, so a dead worker is noticed."""

    rank: int
    timestamp: float
    incarnation: str = ""  # random id of the worker process (a new one after a restart)
    auth_failures: int = 0  # peers this process refused on its tcp links, cumulative


class PeerRefusals(msgspec.Struct, tag=True, array_like=True):
    """Detokenizer -> scheduler when its count changes: peers it refused on its tcp
    links, cumulative (the scheduler's stats carry every role's count to /metrics)."""

    role: str
    count: int


class WorkerInfo(msgspec.Struct, tag=True, array_like=True):
    """Worker rank 0's answer to a SchedulerHello: how many KV blocks fit (after
    profiling), the model's limits and the device's peaks."""

    rank: int
    num_blocks: int
    vocab_size: int
    max_model_len: int
    # Seconds per start-up phase of this worker (tokenizer_load, model_load, ...).
    startup_phases: dict[str, float] = {}
    peak_flops: float = 0.0  # FLOP/s of the device at the dtype in use; 0 = unknown
    peak_bandwidth: float = 0.0  # bytes/s of device memory; 0 = unknown
    incarnation: str = ""  # of the SchedulerHello this answers
    worker_incarnation: str = ""  # random id of the answering worker process
    # The KV cache groups' sliding windows (kvflow/kv_groups.py; 0 = full attention);
    # empty = one full-attention group.
    kv_group_windows: list[int] = []


LauncherInput = ProcessReady | ProcessFailed
WorkerOutput = StepResult | WorkerHeartbeat | WorkerInfo | ProcessFailed
