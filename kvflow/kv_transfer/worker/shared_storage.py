"""The shared-storage connector, worker side: one file per block (block_io.py format).

Writes go to a unique temporary name in the same directory, then `os.replace`: a
reader (another instance, another process) sees a whole file or none, and two
producers saving the same block both succeed with identical content.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import torch

from kvflow.kv_transfer.worker.block_io import decode_block, encode_block, scatter_block
from kvflow.kv_transfer.worker.connector import KVConnectorWorker, KVLoadError
from kvflow.kv_transfer_config import block_file_path
from kvflow.proto.kv_transfer import KVBlockTransfer, KVConnectorMeta


class SharedStorageWorker(KVConnectorWorker):
    def __init__(self, storage_path: str, namespace: str, caches: list[torch.Tensor]) -> None:
        super().__init__(caches)
        self.storage_path = storage_path
        self.namespace = namespace

    def _load(self, meta: KVConnectorMeta) -> int:
        num_bytes = 0
        for transfer in meta.loads:
            for block_id, key in zip(transfer.block_ids, transfer.keys):
                path = self._path(key)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                    block = decode_block(data, self.block_shape, self.dtype)
                except (OSError, ValueError) as exc:
                    _quarantine(path)
                    raise KVLoadError(f"request {transfer.req_id}: block {path}: {exc}") from exc
                scatter_block(self.caches, block_id, block)
                num_bytes += len(data)
        return num_bytes

    def _to_save(self, saves: list[KVBlockTransfer]) -> list[KVBlockTransfer]:
        """Only the blocks without a file: saved before by another request or instance."""
        missing = []
        for transfer in saves:
            pairs = [
                (block_id, key)
                for block_id, key in zip(transfer.block_ids, transfer.keys)
                if not os.path.exists(self._path(key))
            ]
            if pairs:
                block_ids, keys = zip(*pairs)
                missing.append(KVBlockTransfer(transfer.req_id, list(block_ids), list(keys)))
        return missing

    def _store(self, transfers: list[KVBlockTransfer], blocks: torch.Tensor) -> int:
        num_bytes = 0
        keys = [key for transfer in transfers for key in transfer.keys]
        for index, key in enumerate(keys):
            path = self._path(key)
            data = encode_block(blocks[index])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            num_bytes += len(data)
        return num_bytes

    def _path(self, key: str) -> str:
        return block_file_path(self.storage_path, self.namespace, key)


def _quarantine(path: str) -> None:
    """Move a block file that failed to load out of the lookup's way: the step fails
    (the worker restarts and its requests resume by recompute), and the retry then
    finds no file and computes the block instead of failing again on it."""
    with contextlib.suppress(OSError):  # already gone: the retry will not find it either
        os.replace(path, f"{path}.bad")
