"""The worker side of a KV connector: load before the forward pass, save after it.

    ModelRunner.execute(plan):
        start_load_kv(plan.kv_connector)   blocks the step computes on top of
        forward, sample
        wait_for_save(plan.kv_connector)   prompts this step completed

The scheduler side (services/kv_transfer) decided which blocks and keys; this side
moves bytes and counts them. A load that fails raises KVLoadError: the step cannot
run on KV that is not there.
"""

from __future__ import annotations

import abc
import time

import torch

from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.proto.kv_transfer import KVConnectorMeta, KVTransferStepStats


class KVLoadError(RuntimeError):
    pass


class KVConnectorWorker(abc.ABC):
    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches  # one view per layer: [2, num_blocks, block_size, heads, dim]
        first = caches[0]
        self.block_shape = [len(caches), 2, *first.shape[2:]]
        self.dtype = first.dtype
        self.stats = KVTransferStepStats()

    def start_load_kv(self, meta: KVConnectorMeta) -> None:
        if meta.loads:
            start = time.perf_counter()
            self.stats.bytes_loaded += self._load(meta)
            self.stats.load_s += time.perf_counter() - start

    def wait_for_save(self, meta: KVConnectorMeta) -> None:
        if meta.saves:
            start = time.perf_counter()
            self.stats.bytes_saved += self._save(meta)
            self.stats.save_s += time.perf_counter() - start

    def wait_for_loads(self, timeout_s: float) -> None:
        """An empty step: wait up to `timeout_s` for a background load to end (none by
        default: synchronous connectors finish theirs within the step)."""
        return None

    def take_stats(self) -> KVTransferStepStats:
        """What moved since the last call (the step's StepResult carries it)."""
        stats, self.stats = self.stats, KVTransferStepStats()
        return stats

    @abc.abstractmethod
    def _load(self, meta: KVConnectorMeta) -> int:
        """Write every block of `meta.loads` into the cache; returns the bytes read."""

    @abc.abstractmethod
    def _save(self, meta: KVConnectorMeta) -> int:
        """Persist (or send) every block of `meta.saves`; returns the bytes written."""


def make_connector_worker(
    config: KVTransferConfig | None,
    namespace: str,
    caches: list[torch.Tensor],
    load_timeout_s: float = 30.0,
) -> KVConnectorWorker | None:
    if config is None:
        return None
    if config.kv_connector == "zmq":
        from kvflow.gpu_worker.kv_connector.zmq_connector import ZmqWorker

        return ZmqWorker(config, caches, load_timeout_s)
    from kvflow.gpu_worker.kv_connector.shared_storage import SharedStorageWorker

    return SharedStorageWorker(config.storage_path, namespace, caches)
