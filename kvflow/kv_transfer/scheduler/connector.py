"""The scheduler side of a KV connector: which prompt KV comes from outside, which goes out.

The scheduler's KV transfer step feature (step_feature.py) calls it at three points of
a step, and never sees a byte::

    admission:          local prefix hit ─▶ get_num_new_matched_tokens ─▶ allocate_slots
                                                                       └▶ update_state_after_alloc
    end of the plan:    build_meta ─▶ StepPlan.kv_connector ─▶ the worker side loads
                                                               before, saves during the forward
                                                               (layer by layer)
    a request leaves:   request_finished

Shared-storage loads are synchronous with the step that needs them: the worker loads
the blocks before that step's forward pass. zmq loads have real latency (instance to
instance): the request waits in a state of its own (remote_loads.py) until its pull
ends, and blocks nobody.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import msgspec

from kvflow.kv_transfer.scheduler.block_keys import prompt_block_keys
from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.proto.kv_transfer import KVConnectorMeta, KVTransferStats, KVTransferStepStats
from kvflow.runtime.cluster_auth import cluster_settings
from kvflow.services.scheduler.request import Request


@dataclass(frozen=True)
class PromptDone:
    """A request whose prompt this step completes, and its blocks (position order)."""

    request: Request
    block_ids: list[int]


class KVConnectorScheduler(abc.ABC):
    # True: the worker loads in the background and reports when done (remote_loads.py);
    # False: it loads before the forward of the step that first computes the request.
    load_is_async = False

    def __init__(
        self, config: KVTransferConfig, block_size: int, failure_policy: str = "recompute"
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.failure_policy = failure_policy
        self.secret = cluster_settings().secret  # salts the keys (block_keys.py)
        self.counters = KVTransferStats()  # cumulative, for the kvflow:kv_* metrics
        self._keys: dict[str, list[str]] = {}  # req_id -> its prompt's block keys

    def on_step_result(self, stats: KVTransferStepStats) -> None:
        """Count what the worker side moved in one step."""
        counters = self.counters
        counters.bytes_loaded += stats.bytes_loaded
        counters.bytes_saved += stats.bytes_saved
        if stats.bytes_loaded:
            counters.load_seconds.append(stats.load_s)
        if stats.bytes_saved:
            counters.save_seconds.append(stats.save_s)

    def take_stats(self) -> KVTransferStats:
        """The cumulative counts, with the transfer times since the last call."""
        counters = self.counters
        stats = msgspec.structs.replace(counters)
        counters.load_seconds, counters.save_seconds = [], []
        return stats

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> int:
        """Tokens past the local prefix-cache hit whose KV can be loaded from outside
        (0 if none); the request then allocates blocks for them too."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_local: int, num_external: int
    ) -> None:
        """The request got its blocks: remember which of them the load fills."""

    @abc.abstractmethod
    def build_meta(self, prompts_done: list[PromptDone]) -> KVConnectorMeta | None:
        """This step's loads and saves (None when there are none)."""

    def request_finished(self, request: Request) -> None:
        """The request left (finished or aborted): drop what is kept for it."""
        self._keys.pop(request.request_id, None)

    def prompt_keys(self, request: Request) -> list[str]:
        """The transfer keys of the request's prompt blocks (block_keys.py), cached."""
        keys = self._keys.get(request.request_id)
        if keys is None:
            prompt = request.all_token_ids[: request.num_prompt_tokens]
            keys = prompt_block_keys(
                prompt,
                self.block_size,
                request.cache_salt,
                self.secret,
                request.image_spans,
                request.lora_int_id,
            )
            self._keys[request.request_id] = keys
        return keys


def make_connector_scheduler(
    config: KVTransferConfig | None,
    block_size: int,
    namespace: str,
    failure_policy: str = "recompute",
) -> KVConnectorScheduler | None:
    if config is None:
        return None
    if config.kv_connector == "zmq":
        from kvflow.kv_transfer.scheduler.zmq_connector import ZmqScheduler

        return ZmqScheduler(config, block_size, failure_policy)
    from kvflow.kv_transfer.scheduler.shared_storage import SharedStorageScheduler

    return SharedStorageScheduler(config, block_size, namespace)
