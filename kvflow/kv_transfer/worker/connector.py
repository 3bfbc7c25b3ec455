"""The worker side of a KV connector: load before the forward pass, save during it.

    ModelRunner.execute(plan), through KVConnectorFeature (runner_feature.py):
        start_load_kv(plan.kv_connector)   blocks the step computes on top of
        hook = start_save_kv(plan.kv_connector)
        forward (each attention layer calls hook: its blocks are copied out meanwhile)
        sample
        wait_for_save(plan.kv_connector)   prompts this step completed: every layer copied,
                                           then sent to the buffer / written to storage

The scheduler side (services/kv_transfer) decided which blocks and keys; this side
moves bytes and counts them. A load that fails raises KVLoadError: the step cannot
run on KV that is not there. `save_s` counts what the step waits for in
wait_for_save, not the copies that overlapped the forward.
"""

from __future__ import annotations

import abc
import time

import torch

from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.kv_transfer.worker.layer_save import LayerCopier, LayerSave
from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.proto.kv_transfer import KVBlockTransfer, KVConnectorMeta, KVTransferStepStats


class KVLoadError(RuntimeError):
    pass


class KVConnectorWorker(abc.ABC):
    def __init__(self, caches: list[torch.Tensor]) -> None:
        # One view per layer: [planes, num_blocks, block_size, heads, dim]; planes is 2
        # (K, V), or 1 for an MLA latent cache (gpu_worker/kv_cache.py).
        self.caches = caches
        first = caches[0]
        self.block_shape = [len(caches), first.shape[0], *first.shape[2:]]
        self.dtype = first.dtype
        self.stats = KVTransferStepStats()
        # False: copy every layer after the forward (the benchmark's "before").
        self.layer_by_layer = True
        self._copier = LayerCopier(caches)
        self._pending: tuple[list[KVBlockTransfer], LayerSave] | None = None

    def start_load_kv(self, meta: KVConnectorMeta) -> None:
        if meta.loads:
            start = time.perf_counter()
            self.stats.bytes_loaded += self._load(meta)
            self.stats.load_s += time.perf_counter() - start

    def start_save_kv(self, meta: KVConnectorMeta) -> AfterLayer | None:
        """Before the forward: the `after_layer` hook that copies this step's saves
        layer by layer, or None when nothing is to be saved (or not layer by layer)."""
        transfers = self._to_save(meta.saves)
        if not transfers:
            self._pending = None
            return None
        save = self._copier.begin([b for t in transfers for b in t.block_ids])
        self._pending = (transfers, save)
        return save if self.layer_by_layer else None

    def wait_for_save(self, meta: KVConnectorMeta) -> None:
        if not meta.saves:
            return
        start = time.perf_counter()
        if self._pending is None:  # a caller that did not start it (the bench)
            self.start_save_kv(meta)
        if self._pending is not None:
            transfers, save = self._pending
            self._pending = None
            self.stats.bytes_saved += self._store(transfers, save.wait())
        self.stats.save_s += time.perf_counter() - start

    def close(self) -> None:
        self._copier.close()

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

    def _to_save(self, saves: list[KVBlockTransfer]) -> list[KVBlockTransfer]:
        """The transfers (and blocks) that still need saving; all of them by default."""
        return saves

    @abc.abstractmethod
    def _store(self, transfers: list[KVBlockTransfer], blocks: torch.Tensor) -> int:
        """Keep (or send) the blocks of `transfers`, whose KV `blocks` holds in the
        same order, `[n, num_layers, 2, block_size, kv_heads, head_dim]` on the host;
        returns the bytes written."""


def make_connector_worker(
    config: KVTransferConfig | None,
    namespace: str,
    caches: list[torch.Tensor],
    load_timeout_s: float = 30.0,
) -> KVConnectorWorker | None:
    if config is None:
        return None
    if config.kv_connector == "zmq":
        from kvflow.kv_transfer.worker.zmq_connector import ZmqWorker

        return ZmqWorker(config, caches, load_timeout_s)
    from kvflow.kv_transfer.worker.shared_storage import SharedStorageWorker

    return SharedStorageWorker(config.storage_path, namespace, caches)
