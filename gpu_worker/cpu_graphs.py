"""CPU decode graphs: the forward of a decode-only step, recorded once per batch size
and replayed (gpu_worker/op_tape.py), the CPU's counterpart of cuda_graphs.py.

At one decode row a step of the embedded 30-layer model is ~300 native kernel calls
that take ~5 ms, and ~4 ms of Python around them (modules, launchers, route and shape
checks, attention planning). A replay keeps only the calls: the same kernels on the
same memory, in the same order.

How it differs from the CUDA graphs:
- Exact sizes, no padding: a padding row costs real compute on a CPU. A size is
  recorded the first time a decode-only step of that many requests runs (the recording
  is that step's own forward, so it costs no extra pass), and the graphs of the least
  recently used sizes are dropped beyond `memory_budget` bytes of their activations.
- The attention backend is the torch one with the native decode kernel: its plan for
  the static metadata is made before recording (planning reads tensor data), and the
  kernel reads every length and block table from the static buffers.
- Bounds: the native kernel follows block tables unchecked, so each replay checks the
  step's lengths against its block tables first, as an eager step's plan does.
- Verification steps of speculative decoding (queries of up to `max_query_len` tokens)
  run as one-token decodes, one per query row (token_decodes.py): a verification of
  k + 1 rows replays the graph of k + 1 decode rows.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch import nn

from kvflow.gpu_worker.attention.torch_backend import TorchAttentionBackend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata, replaced_metadata
from kvflow.gpu_worker.graph_inputs import StaticDecodeInputs
from kvflow.gpu_worker.op_tape import DataDependentOp, OpTape
from kvflow.gpu_worker.token_decodes import as_token_decodes
from kvflow.kernels.cpu.native_calls import NotReplayable
from kvflow.kernels.cpu.paged_decode import check_lengths

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_BUDGET = 512 << 20  # bytes of recorded activations over all sizes


def make_cpu_decode_graphs(
    model: nn.Module,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    num_groups: int = 1,
    max_query_len: int = 1,
) -> CpuDecodeGraphs | None:
    """Decode graphs for `model` (its KV cache bound), or None where a replay could not
    stand in for its forward: an attention backend without the native decode kernel, or
    layers it cannot take. `max_query_len`: 1 + the drafts of a verification step."""
    layers = model.attention_layers()  # type: ignore[operator]  # every decoder has it
    backend = layers[0].backend
    if not isinstance(backend, TorchAttentionBackend) or not backend.has_decode_kernel:
        return None
    if any(
        layer.softcap is not None or layer.sinks is not None or layer.kv_planes == 1
        for layer in layers
    ):
        # Soft-capped (Gemma 2), sink (gpt-oss) and latent-attention (DeepSeek) layers
        # take the torch decode path, which plans on the host.
        return None
    return CpuDecodeGraphs(
        model, backend, layers[0].kv_cache, max_num_seqs * max_query_len, max_model_len,
        block_size, num_groups, max_query_len=max_query_len,
    )  # fmt: skip


class CpuDecodeGraphs:
    """One recorded forward per decode batch size; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        backend: TorchAttentionBackend,
        kv_cache: torch.Tensor,  # the first layer's: the plans are made against it
        max_rows: int,  # query rows of the largest step replayed
        max_model_len: int,
        block_size: int,
        num_groups: int = 1,  # KV cache groups (kvflow/kv_groups.py): a table each
        memory_budget: int | None = None,  # bytes; None: DEFAULT_MEMORY_BUDGET
        max_query_len: int = 1,  # longer queries (verification steps) run eagerly
    ) -> None:
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.max_query_len = max_query_len
        self.max_model_len, self.block_size = max_model_len, block_size
        self.memory_budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
        self.static = StaticDecodeInputs.allocate(
            max_rows, math.ceil(max_model_len / block_size), kv_cache.device, num_groups
        )
        # (size, variant) -> tape, LRU first. The variant tells apart forwards of one
        # size that run different ops: with LoRA, whether the step has adapted rows
        # (the runner sets `variant` to the LoRA batch's; lora/batch.py).
        self.tapes: OrderedDict[tuple[int, Hashable], OpTape] = OrderedDict()
        self.refused: set[tuple[int, Hashable]] = set()  # keys that cannot be replayed
        self.variant: Callable[[], Hashable] = lambda: None
        self.num_replays = 0
        self.num_recordings = 0
        self.num_verify_replays = 0  # replays that ran a step of longer queries

    def can_run(self, md: AttentionMetadata) -> bool:
        rows = md.query_start_loc_cpu[-1]
        return (
            md.max_query_len <= self.max_query_len
            and (md.max_query_len == 1 or not _has_fresh_prompt(md))
            and 0 < rows <= self.static.input_ids.shape[0]
            and (rows, self.variant()) not in self.refused
            and all(
                group.block_tables.shape[1] <= self.static.block_tables.shape[1]
                for group in (md, *md.group_metadata)
            )
        )

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states [num_tokens, hidden] of a forward whose queries are at most
        `max_query_len` tokens long: a replay, or the step's own forward recorded when
        its size has no graph yet."""
        verify = not md.is_decode_only
        if verify:  # one decode row per query token
            md = as_token_decodes(md)
        n = md.num_reqs
        # What an eager step's plan checks before the kernel follows the tables (from
        # the host lists: no tensor read).
        lens = md.seq_lens_cpu
        for group in (md, *md.group_metadata):
            check_lengths(min(lens), max(lens), group.block_tables.shape[1], self.block_size)
        self.static.load(input_ids, positions, md, n)
        key = (n, self.variant())
        tape = self.tapes.get(key)
        if tape is None:
            return self._record(key)
        self.tapes.move_to_end(key)
        tape.replay()
        self.num_replays += 1
        self.num_verify_replays += verify
        return tape.output  # type: ignore[no-any-return]  # the recorded forward's hidden

    def _record(self, key: tuple[int, Hashable]) -> torch.Tensor:
        n = key[0]
        metadata = self.static.metadata(n, self.max_model_len)
        # Before recording: planning reads data. One plan per KV cache group.
        groups = (metadata, *metadata.group_metadata)
        plans = [self.backend.plan_for(group, self.kv_cache, n) for group in groups]
        ids, positions = self.static.input_ids[:n], self.static.positions[:n]
        tape = OpTape()
        try:
            with replaced_metadata(metadata):
                hidden = tape.record(lambda: self.model(ids, positions))
        except (DataDependentOp, NotReplayable) as error:
            self.refused.add(key)
            logger.warning("decode batches of %d run eagerly: %s", n, error)
            with replaced_metadata(metadata):
                return self.model(ids, positions)  # type: ignore[no-any-return]
        static = [self.static.slot_mapping, *self.static.group_slots]
        for plan, slots in zip(plans, static):
            if not (plan.kernel_takes_query and plan.all_slots.data_ptr() == slots.data_ptr()):
                # the torch decode path plans from host lists; a slot copy would be stale
                self.refused.add(key)
                return hidden  # type: ignore[no-any-return]  # computed eagerly all the same
        tape.keep.extend(plans)  # the kernels read their index tensors
        self.tapes[key] = tape
        self.num_recordings += 1
        self._evict()
        return hidden  # type: ignore[no-any-return]

    def _evict(self) -> None:
        """Drop the least recently replayed graphs beyond the memory budget."""
        while len(self.tapes) > 1 and self.nbytes > self.memory_budget:
            self.tapes.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(tape.nbytes for tape in self.tapes.values())


def _has_fresh_prompt(md: AttentionMetadata) -> bool:
    """A request whose whole context is this step's queries: a prompt, which attends its
    own unquantized K/V eagerly (a decode row would read it back from the cache)."""
    starts = md.query_start_loc_cpu
    return any(starts[i + 1] - starts[i] == n for i, n in enumerate(md.seq_lens_cpu))
