"""The worker's adapters: an LRU of loaded ones in host memory, and the step's slots.

    request's LoRARequest --(first use)--> read, check, shard, scale: LoadedAdapter
        host LRU: at most max_cpu_loras adapters (the least recently used is dropped)
    a step's distinct adapters (<= max_loras, the scheduler's rule)
        --> each in a slot: kept if already there, else copied over the slot least
            recently used by an earlier step (never one this step needs)

Slots are preallocated (slots.py): loading copies, nothing is reallocated.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from kvflow.gpu_worker.lora.adapter_weights import LoadedAdapter, load_adapter
from kvflow.gpu_worker.lora.batch import LoraBatch
from kvflow.gpu_worker.lora.targets import attach_slots
from kvflow.lora_config import LoRAConfig
from kvflow.lora_files import BaseShapes, read_adapter
from kvflow.proto.lora import LoRARequest

logger = logging.getLogger(__name__)


class LoraManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, model_dir: Path,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.config = config
        self.dtype = dtype
        self.base = BaseShapes.from_model_dir(model_dir)
        self.batch = LoraBatch(device)
        self.targets = attach_slots(
            model, self.batch, config.max_loras, config.max_lora_rank, dtype, device
        )
        self._host: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self._slot_ids: list[int | None] = [None] * config.max_loras  # adapter in each slot
        self._slot_use = [0] * config.max_loras  # the step that last used each slot
        self._step = 0
        slots = {id(t.layer.lora): t.layer.lora for t in self.targets.values()}
        self.slot_bytes = sum(s.nbytes for s in slots.values() if s) // config.max_loras

    def slots_for(self, adapters: list[LoRARequest]) -> dict[int, int]:
        """Each distinct adapter of a step -> its slot (loading where needed)."""
        self._step += 1
        wanted = list(dict.fromkeys(a.lora_int_id for a in adapters))
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters > max_loras")
        by_id = {a.lora_int_id: a for a in adapters}
        placed = {i: s for s, i in enumerate(self._slot_ids) if i is not None and i in wanted}
        for adapter_id in wanted:
            if adapter_id not in placed:
                slot = min(
                    (s for s in range(len(self._slot_ids)) if s not in placed.values()),
                    key=lambda s: self._slot_use[s],
                )
                self._copy_into(slot, self._loaded(by_id[adapter_id]))
                self._slot_ids[slot] = adapter_id
                placed[adapter_id] = slot
            self._slot_use[placed[adapter_id]] = self._step
        return placed

    def _loaded(self, adapter: LoRARequest) -> LoadedAdapter:
        loaded = self._host.get(adapter.lora_int_id)
        if loaded is not None:
            self._host.move_to_end(adapter.lora_int_id)
            return loaded
        info = read_adapter(adapter.lora_path, self.base, self.config.max_lora_rank)
        loaded = load_adapter(info, self.targets, self.base, self.dtype)
        self._host[adapter.lora_int_id] = loaded
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)
        logger.info("loaded LoRA adapter %s (rank %d)", adapter.lora_name, info.rank)
        return loaded

    def _copy_into(self, slot: int, loaded: LoadedAdapter) -> None:
        seen = set()
        for slots, pairs in loaded.values():
            slots.load(slot, pairs)
            seen.add(id(slots))
        for target in self.targets.values():  # projections this adapter leaves alone
            lora = target.layer.lora
            if lora is not None and id(lora) not in seen:
                lora.load(slot, [None] * len(lora.slices))
                seen.add(id(lora))

    def forget(self, adapter_id: int) -> None:
        """Drop an adapter from the host cache (its slot is reused when needed)."""
        self._host.pop(adapter_id, None)
