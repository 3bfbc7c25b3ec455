"""The torch backend's plan of one step, made once per step and KV cache group from the
host lists of the metadata (no device syncs) and reused by every layer of the group:
which requests decode (and the cache slots their contexts are gathered from) and which
prefill (and the cached blocks they read). See torch_backend.py for the attention.

With a sliding window W the reads start at the window: a decode gathers only the last W
positions of its context, a prefill chunk only the blocks from the one holding its first
query's first key. Blocks before those may have been released by the scheduler (table
entry -1) and are never touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.kernels import kv_codec


@dataclass
class DecodeBatch:
    rows: slice | torch.Tensor  # token rows of the decode queries in the step
    req_indices: torch.Tensor  # [num_decodes] int32, request index of each decode
    token_rows: torch.Tensor  # [num_decodes] int32, the same rows as `rows`
    tables: torch.Tensor  # [num_decodes, max_blocks] int64, their block tables
    block_size: int
    seq_lens: torch.Tensor  # [num_decodes, 1] int64
    num_decodes: int
    context: int  # positions gathered per request: the longest seq_len of the batch
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    scratch: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _positions: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def span(self, window: int | None) -> int:
        """Positions gathered per request: its last `window` (a sliding window), or the
        longest context of the batch."""
        return self.context if window is None else min(window, self.context)

    def positions(self, window: int | None) -> torch.Tensor:
        """[B, span] the context positions gathered, unclamped: each request's from the
        first inside its window (a sliding window's released blocks are never read), or
        from 0. Built on first use (decodes the native kernel takes gather nothing)."""
        if window not in self._positions:
            span = torch.arange(self.span(window), device=self.seq_lens.device)[None, :]
            first = 0 if window is None else (self.seq_lens - window).clamp(min=0)
            self._positions[window] = first + span
        return self._positions[window]

    def slots(self, window: int | None) -> torch.Tensor:
        """[num_decodes * span] int64: the cache slot of each gathered position.

        Positions past a request's seq_len (padding up to the longest) read the slot of
        its last token instead: masked out anyway, but a finite value, whereas an
        unwritten slot may hold NaN and 0 * NaN would poison the softmax-weighted sum.
        """
        positions = torch.minimum(self.positions(window), self.seq_lens - 1)  # [B, span]
        blocks = self.tables.gather(1, positions // self.block_size)
        return (blocks * self.block_size + positions % self.block_size).reshape(-1)

    def gather(
        self, kv_cache: torch.Tensor, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' contexts as k, v [num_decodes, kv_heads, span, width] views of
        one scratch pair, allocated on the first layer and reused by the others (width =
        head_dim, or head_dim + 4 for the rows of a quantized cache)."""
        _, num_blocks, block_size, kv_heads, width = kv_cache.shape
        span = self.span(window)
        if window not in self.scratch:
            rows = (self.num_decodes * span, kv_heads, width)
            self.scratch[window] = (kv_cache.new_empty(rows), kv_cache.new_empty(rows))
        slots = self.slots(window)
        per_slot = (num_blocks * block_size, kv_heads, width)
        shape = (self.num_decodes, span, kv_heads, width)
        k, v = (
            torch.index_select(kv_cache[i].view(per_slot), 0, slots, out=out)
            .view(shape)
            .transpose(1, 2)
            for i, out in enumerate(self.scratch[window])
        )
        return k, v

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[num_decodes, 1, 1, span] additive mask: 0 = attended, -inf = not (padding past
        seq_len; the positions gathered are in the window already). Additive in the
        activation dtype because SDPA would convert a bool mask on every call."""
        if window not in self.masks:
            visible = self.positions(window) < self.seq_lens
            additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self.masks[window] = additive.masked_fill_(~visible, -math.inf)[:, None, None, :]
        return self.masks[window]


@dataclass
class Prefill:
    start: int  # first token row of the request in the step
    end: int
    seq_len: int  # context length including this step's tokens
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)] int64; None: no prefix
    block_size: int
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def first_block(self, window: int | None) -> int:
        """The first block of the cached context any query of the chunk reads: with a
        sliding window, the blocks before it may have been released (table entry -1)."""
        if window is None or self.block_ids is None:
            return 0
        first_query = self.seq_len - (self.end - self.start)
        return max(0, first_query - window + 1) // self.block_size

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[q_len, seq_len - first key read] bool, or None when plain top-left causal
        attention is exact."""
        q_len = self.end - self.start
        if window not in self.masks:
            if q_len == self.seq_len and (window is None or window >= self.seq_len):
                self.masks[window] = None
            else:
                q_pos = torch.arange(self.seq_len - q_len, self.seq_len, device=device)[:, None]
                first_key = self.first_block(window) * self.block_size
                k_pos = torch.arange(first_key, self.seq_len, device=device)[None, :]
                visible = k_pos <= q_pos
                if window is not None:
                    visible &= k_pos > q_pos - window
                self.masks[window] = visible
        return self.masks[window]


@dataclass
class StepPlan:
    metadata: AttentionMetadata
    has_cache: bool
    store_rows: torch.Tensor | None  # token rows whose slot >= 0; None = every token
    store_slots: torch.Tensor  # [num_stored] int64
    all_slots: torch.Tensor  # [num_tokens] int64, -1 = not stored (the native store's)
    # The storage dtype of a cache of kv_codec rows (dequantize what is read back), else
    # None. Such a cache moves as uint8 bytes: torch has no CPU index ops for fp8.
    codec: torch.dtype | None
    num_actual_tokens: int
    decode: DecodeBatch | None
    prefills: list[Prefill]
    # Set by the first layer, which every other layer's tensors resemble:
    kernel_takes_query: bool | None = None  # the native decode kernel takes the queries
    native_store: bool | None = None  # elementwise.store_kv takes the keys/values


def _as_rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice when `rows` is a contiguous run (cheap views), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _plan_decodes(
    md: AttentionMetadata, requests: list[int], block_size: int
) -> DecodeBatch | None:
    """The decode requests of the step: their rows, block tables and lengths."""
    if not requests:
        return None
    device = md.block_tables.device
    context = max(md.seq_lens_cpu[i] for i in requests)
    seq_lens = torch.tensor([md.seq_lens_cpu[i] for i in requests], device=device)[:, None]
    token_rows = [md.query_start_loc_cpu[i] for i in requests]
    return DecodeBatch(
        rows=_as_rows(token_rows, device),
        req_indices=torch.tensor(requests, dtype=torch.int32, device=device),
        token_rows=torch.tensor(token_rows, dtype=torch.int32, device=device),
        tables=md.block_tables[_as_rows(requests, device)].to(torch.int64),
        block_size=block_size,
        seq_lens=seq_lens,
        num_decodes=len(requests),
        context=context,
    )


def plan_step(md: AttentionMetadata, kv_cache: torch.Tensor) -> StepPlan:
    has_cache = kv_cache.numel() > 0
    block_size = kv_cache.shape[2] if has_cache else 0
    starts = md.query_start_loc_cpu
    decodes, prefills = [], []
    for i, seq_len in enumerate(md.seq_lens_cpu):
        start, end = starts[i], starts[i + 1]
        if has_cache and end - start == 1:
            decodes.append(i)
        elif end > start:
            if end - start == seq_len:
                block_ids = None
            else:
                assert has_cache, "a prefill on top of a cached prefix needs the KV cache"
                num_blocks = -(-seq_len // block_size)
                block_ids = md.block_tables[i, :num_blocks].to(torch.int64)
            prefills.append(Prefill(start, end, seq_len, block_ids, block_size))
    store_rows = (md.slot_mapping >= 0).nonzero().squeeze(1) if has_cache else None
    if store_rows is not None and store_rows.numel() == md.slot_mapping.numel():
        store_rows = None  # the common case: no padding, store every row without a gather
    slot_mapping = md.slot_mapping.to(torch.int64)
    store_slots = slot_mapping if store_rows is None else slot_mapping[store_rows]
    return StepPlan(
        metadata=md,
        has_cache=has_cache,
        store_rows=store_rows,
        store_slots=store_slots,
        all_slots=slot_mapping,
        codec=kv_cache.dtype if kv_codec.is_quantized(kv_cache.dtype) else None,
        num_actual_tokens=starts[-1],
        decode=_plan_decodes(md, decodes, block_size),
        prefills=prefills,
    )
