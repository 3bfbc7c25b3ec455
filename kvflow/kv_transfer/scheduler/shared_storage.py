"""The shared-storage connector, scheduler side: block files in a directory.

A producer saves every prompt it completes, block by block, under the block's key
(block_keys.py); a consumer looks its prompt's keys up and loads the run of blocks
that follows its local prefix-cache hit. The files are the only state, so any number
of instances that mount the directory share it, and it outlives them: a prefix saved
once is a hit for every later request with that prefix (a disk prefix cache).

Existence is checked here and the bytes move in the worker. Files are written to a
temporary name and renamed, so a file that exists is whole; kvflow never deletes one,
so a file seen here is still there when the worker reads it in the same step.
"""

from __future__ import annotations

import os

from kvflow.kv_transfer.scheduler.connector import KVConnectorScheduler, PromptDone
from kvflow.kv_transfer_config import KVTransferConfig, block_file_path
from kvflow.proto.kv_transfer import KVBlockTransfer, KVConnectorMeta
from kvflow.services.scheduler.request import Request


class SharedStorageScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, namespace: str) -> None:
        super().__init__(config, block_size)
        self.namespace = namespace
        self._loads: list[KVBlockTransfer] = []  # for the step being planned

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> int:
        if not self.config.is_consumer or request.sampling_params.prompt_logprobs is not None:
            return 0  # prompt logprobs need the logits of every prompt position
        keys = self.prompt_keys(request)
        first = num_local_computed // self.block_size
        found = first
        while found < len(keys) and self._exists(keys[found]):
            found += 1
        matched = min(found * self.block_size, request.num_prompt_tokens)
        # The model must still run on the last known token to sample the next one.
        return max(0, min(matched, request.num_tokens - 1) - num_local_computed)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_local: int, num_external: int
    ) -> None:
        if num_external == 0:
            return
        first = num_local // self.block_size
        end = -(-(num_local + num_external) // self.block_size)
        keys = self.prompt_keys(request)
        self._loads.append(
            KVBlockTransfer(request.request_id, block_ids[first:end], keys[first:end])
        )
        self.counters.num_loaded_requests += 1
        self.counters.num_loaded_tokens += num_external

    def build_meta(self, prompts_done: list[PromptDone]) -> KVConnectorMeta | None:
        loads, self._loads = self._loads, []
        saves = self._saves(prompts_done) if self.config.is_producer else []
        if not loads and not saves:
            return None
        return KVConnectorMeta(loads=loads, saves=saves)

    def _saves(self, prompts_done: list[PromptDone]) -> list[KVBlockTransfer]:
        """The prompts this step completes: each block not yet on disk."""
        saves = []
        for done in prompts_done:
            request, block_ids = done.request, done.block_ids
            keys = self.prompt_keys(request)
            todo = [i for i, key in enumerate(keys) if not self._exists(key)]
            if todo:
                saves.append(
                    KVBlockTransfer(
                        request.request_id, [block_ids[i] for i in todo], [keys[i] for i in todo]
                    )
                )
                self.counters.num_saved_blocks += len(todo)
        return saves

    def _exists(self, key: str) -> bool:
        return os.path.exists(block_file_path(self.config.storage_path, self.namespace, key))
