"""Paged attention in plain torch ops: the CPU backend and the reference for the kernels.

One step mixes requests of two kinds, planned once per step from the host lists of the
metadata (no device syncs) and reused by every layer:

* decodes (1 query token): handled together. Their contexts are gathered slot by slot
  into a padded [num_decodes, longest seq_len, kv_heads, head_dim] tensor and one masked
  SDPA call attends all of them. GQA without copying K/V: the G query heads that share
  a KV head are laid out as G "query positions" of that head,
      q [B, num_heads, D] -> [B, kv_heads, G, D]  vs  k [B, kv_heads, L, D].
* prefills (more than 1 query token, possibly a chunk on top of a cached prefix): one
  SDPA call each; the causal mask is offset by the cached prefix (query i sits at
  position seq_len - q_len + i). A prefill with no cached prefix attends its own fresh
  K/V and never reads the cache.

With a native decode kernel (the `cpu` backend: kernels/cpu/paged_decode_attention.cpp)
the decodes skip the gather and read their contexts in place from the paged cache; the
torch decode path above stays the reference it is tested against. Likewise, with a native
prefill kernel (kernels/cpu/prefill_attention.cpp) a prefill with no cached prefix and no
sliding window runs natively where the kernel supports the shape; every other prefill
(cached prefix, window, other head_dim or CPU) keeps SDPA. A layer with logit
soft-capping (Gemma 2) or attention sinks (gpt-oss) never takes the native kernels, which
have neither option: its decodes and prefills take the torch path, in softcap.py's ops.

A quantized cache (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`, kernels/kv_codec.py) holds
rows of head_dim 8-bit codes and a float32 scale. Where no native kernel takes them, the
store quantizes the step's K/V rows and index-copies them like float rows, and whatever
is read back from the cache (decode contexts, a cached prefix) is dequantized to the
query dtype right after the gather, so SDPA sees plain values. A fresh prefill attends
its own unquantized K/V, as with a float cache.

The cache may be an empty tensor (not bound yet, e.g. a profiling pass): then nothing is
stored and every request must be a whole prefill.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from kvflow.gpu_worker.attention.softcap import LogitOptions, attend
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.kernels import kv_codec
from kvflow.kernels.cpu import elementwise
from kvflow.kernels.cpu.paged_decode import PagedDecodeAttention, check_indices
from kvflow.kernels.cpu.prefill_attention import PrefillAttention


@dataclass
class _DecodeBatch:
    rows: slice | torch.Tensor  # token rows of the decode queries in the step
    req_indices: torch.Tensor  # [num_decodes] int32, request index of each decode
    token_rows: torch.Tensor  # [num_decodes] int32, the same rows as `rows`
    tables: torch.Tensor  # [num_decodes, max_blocks] int64, their block tables
    block_size: int
    seq_lens: torch.Tensor  # [num_decodes, 1] int64
    num_decodes: int
    context: int  # positions gathered per request: the longest seq_len of the batch
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        """[num_decodes * context] int64: the cache slot of each gathered position, built
        on first use (a step whose decodes go to the native kernel gathers nothing).

        Positions past a request's seq_len (padding up to the longest) read the slot of
        its last token instead: masked out anyway, but a finite value, whereas an
        unwritten slot may hold NaN and 0 * NaN would poison the softmax-weighted sum.
        """
        positions = torch.arange(self.context, device=self.seq_lens.device)[None, :]
        positions = torch.minimum(positions, self.seq_lens - 1)  # [B, context]
        blocks = self.tables.gather(1, positions // self.block_size)
        return (blocks * self.block_size + positions % self.block_size).reshape(-1)

    def gather(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' contexts as k, v [num_decodes, kv_heads, context, width] views
        of one scratch pair, allocated on the first layer and reused by the others
        (width = head_dim, or head_dim + 4 for the rows of a quantized cache)."""
        _, num_blocks, block_size, kv_heads, width = kv_cache.shape
        if not self.scratch:
            rows = (self.num_decodes * self.context, kv_heads, width)
            self.scratch["k"], self.scratch["v"] = (
                kv_cache.new_empty(rows),
                kv_cache.new_empty(rows),
            )
        per_slot = (num_blocks * block_size, kv_heads, width)
        shape = (self.num_decodes, self.context, kv_heads, width)
        k, v = (
            torch.index_select(kv_cache[i].view(per_slot), 0, self.slots, out=self.scratch[name])
            .view(shape)
            .transpose(1, 2)
            for i, name in enumerate("kv")
        )
        return k, v

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[num_decodes, 1, 1, context] additive mask: 0 = attended, -inf = not. Additive
        in the activation dtype because SDPA would convert a bool mask on every call."""
        if window not in self.masks:
            positions = torch.arange(self.context, device=self.seq_lens.device)
            visible = positions[None, :] < self.seq_lens
            if window is not None:  # the query sits at seq_len - 1
                visible &= positions[None, :] > self.seq_lens - 1 - window
            additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self.masks[window] = additive.masked_fill_(~visible, -math.inf)[:, None, None, :]
        return self.masks[window]


@dataclass
class _Prefill:
    start: int  # first token row of the request in the step
    end: int
    seq_len: int  # context length including this step's tokens
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)] int64; None: no prefix
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[q_len, seq_len] bool, or None when plain top-left causal attention is exact."""
        q_len = self.end - self.start
        if window not in self.masks:
            if q_len == self.seq_len and (window is None or window >= self.seq_len):
                self.masks[window] = None
            else:
                q_pos = torch.arange(self.seq_len - q_len, self.seq_len, device=device)[:, None]
                k_pos = torch.arange(self.seq_len, device=device)[None, :]
                visible = k_pos <= q_pos
                if window is not None:
                    visible &= k_pos > q_pos - window
                self.masks[window] = visible
        return self.masks[window]


@dataclass
class _StepPlan:
    metadata: AttentionMetadata
    has_cache: bool
    store_rows: torch.Tensor | None  # token rows whose slot >= 0; None = every token
    store_slots: torch.Tensor  # [num_stored] int64
    all_slots: torch.Tensor  # [num_tokens] int64, -1 = not stored (the native store's)
    # The storage dtype of a cache of kv_codec rows (dequantize what is read back), else
    # None. Such a cache moves as uint8 bytes: torch has no CPU index ops for fp8.
    codec: torch.dtype | None
    num_actual_tokens: int
    decode: _DecodeBatch | None
    prefills: list[_Prefill]
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
) -> _DecodeBatch | None:
    """The decode requests of the step: their rows, block tables and lengths."""
    if not requests:
        return None
    device = md.block_tables.device
    context = max(md.seq_lens_cpu[i] for i in requests)
    seq_lens = torch.tensor([md.seq_lens_cpu[i] for i in requests], device=device)[:, None]
    token_rows = [md.query_start_loc_cpu[i] for i in requests]
    return _DecodeBatch(
        rows=_as_rows(token_rows, device),
        req_indices=torch.tensor(requests, dtype=torch.int32, device=device),
        token_rows=torch.tensor(token_rows, dtype=torch.int32, device=device),
        tables=md.block_tables[_as_rows(requests, device)].to(torch.int64),
        block_size=block_size,
        seq_lens=seq_lens,
        num_decodes=len(requests),
        context=context,
    )


def _plan_step(md: AttentionMetadata, kv_cache: torch.Tensor) -> _StepPlan:
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
            prefills.append(_Prefill(start, end, seq_len, block_ids))
    store_rows = (md.slot_mapping >= 0).nonzero().squeeze(1) if has_cache else None
    if store_rows is not None and store_rows.numel() == md.slot_mapping.numel():
        store_rows = None  # the common case: no padding, store every row without a gather
    slot_mapping = md.slot_mapping.to(torch.int64)
    store_slots = slot_mapping if store_rows is None else slot_mapping[store_rows]
    return _StepPlan(
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


class TorchAttentionBackend:
    """See the module docstring. Keeps the plan of the current step (one per metadata).

    `decode_kernel`: the native paged decode attention, used for the decodes whenever
    it supports the dtype and the cache is on the CPU; None = torch ops only.
    `prefill_kernel`: the native causal prefill attention, for the prefills it supports
    (see `_prefill_attention`); None = SDPA for every prefill.
    """

    def __init__(
        self,
        decode_kernel: PagedDecodeAttention | None = None,
        prefill_kernel: PrefillAttention | None = None,
    ) -> None:
        self._plan: _StepPlan | None = None
        self._decode_kernel = decode_kernel
        self._prefill_kernel = prefill_kernel

    @property
    def has_decode_kernel(self) -> bool:
        return self._decode_kernel is not None

    def plan_for(
        self, metadata: AttentionMetadata, kv_cache: torch.Tensor, num_rows: int
    ) -> _StepPlan:
        """The step's plan, made once per metadata and reused by every layer (a CPU
        decode graph makes it before recording: planning reads tensor data)."""
        plan = self._plan
        if plan is None or plan.metadata is not metadata:
            plan = self._plan = _plan_step(metadata, kv_cache)
            if plan.decode is not None and self._decode_kernel is not None:
                # Once per step: the native kernel follows these indices unchecked.
                check_indices(
                    num_rows, metadata.block_tables, metadata.seq_lens,
                    plan.decode.req_indices, plan.decode.token_rows, kv_cache.shape[2],
                )  # fmt: skip
        return plan

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = self.plan_for(metadata, kv_cache, query.shape[0])
        cache = kv_cache if plan.codec is None else kv_cache.view(torch.uint8)
        if plan.has_cache:
            _store_kv(key, value, kv_cache, cache, plan)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        if plan.num_actual_tokens < query.shape[0]:  # padding rows (CUDA graph batches)
            out[plan.num_actual_tokens :].zero_()
        decode, kernel = plan.decode, self._decode_kernel
        if plan.kernel_takes_query is None:  # once per step, not per layer
            plan.kernel_takes_query = kernel is not None and kernel.supports(query, kv_cache)
        options = LogitOptions(sliding_window, softcap, sinks)
        plain = softcap is None and sinks is None  # what the native kernels compute
        native = kernel is not None and plan.kernel_takes_query and plain
        if decode is not None and kernel is not None and native:
            md = plan.metadata
            kernel(
                query, kv_cache, md.block_tables, md.seq_lens, decode.req_indices,
                decode.token_rows, out, scale, sliding_window, indices_checked=True,
            )  # fmt: skip
        elif decode is not None:
            _decode_attention(query, cache, decode, out, scale, options, plan.codec)
        prefill_kernel = self._prefill_kernel if plain else None
        for prefill in plan.prefills:
            _prefill_attention(
                query, key, value, cache, prefill, out, scale, options, prefill_kernel,
                plan.codec,
            )  # fmt: skip
        return out


def _store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    cache: torch.Tensor,  # kv_cache, or its uint8 view if quantized
    plan: _StepPlan,
) -> None:
    """key/value rows to their slots: natively on CPUs (one call, padding rows skipped in
    it), else index_copy_ of the rows whose slot is set (the reference), quantized to
    kv_codec rows first for a quantized cache (after dropping the padding rows)."""
    if plan.native_store is None:  # the layout is the same in every layer: check once
        plan.native_store = elementwise.store_applies(key, value, kv_cache, plan.all_slots)
    if plan.native_store:
        elementwise.store_kv(key, value, kv_cache, plan.all_slots)
        return
    _, num_blocks, block_size, kv_heads, width = cache.shape
    if plan.store_rows is not None:
        key, value = key[plan.store_rows], value[plan.store_rows]
    if plan.codec is not None:
        key = kv_codec.quantize_rows(key, plan.codec).view(torch.uint8)
        value = kv_codec.quantize_rows(value, plan.codec).view(torch.uint8)
    slots = num_blocks * block_size
    cache[0].view(slots, kv_heads, width).index_copy_(0, plan.store_slots, key)
    cache[1].view(slots, kv_heads, width).index_copy_(0, plan.store_slots, value)


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: _DecodeBatch,
    out: torch.Tensor,
    scale: float,
    options: LogitOptions,
    codec: torch.dtype | None = None,
) -> None:
    k, v = batch.gather(kv_cache)  # [B, KH, L, D] each ([B, KH, L, D + 4] rows if quantized)
    if codec is not None:
        k, v = (_dequantize(rows, codec, query.dtype) for rows in (k, v))
    num_heads, kv_heads, head_dim = query.shape[1], k.shape[1], k.shape[3]
    # GQA: the G = H / KH query heads of a KV head become G query rows of that head.
    q = query[batch.rows].view(batch.num_decodes, kv_heads, num_heads // kv_heads, head_dim)
    sinks = None if options.sinks is None else options.sinks.view(kv_heads, -1, 1)
    mask = batch.mask(options.window, query.dtype)
    attended = attend(
        q, k, v, mask, is_causal=False, scale=scale, softcap=options.softcap, sinks=sinks
    )  # [B, KH, G, D]
    out[batch.rows] = attended.reshape(batch.num_decodes, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    prefill: _Prefill,
    out: torch.Tensor,
    scale: float,
    options: LogitOptions,
    kernel: PrefillAttention | None = None,
    codec: torch.dtype | None = None,
) -> None:
    rows = slice(prefill.start, prefill.end)
    mask = prefill.mask(options.window, query.device)
    if mask is None and kernel is not None:
        # No cached prefix and no window cutting in: plain causal attention over the
        # step's own rows, which the native kernel computes (SDPA stays the reference).
        q, k, v, o = query[rows], key[rows], value[rows], out[rows]
        if kernel.supports(q, k, v, o):
            kernel(q, k, v, o, scale)
            return
    if prefill.block_ids is None:  # no cached prefix: the context is this step's K/V
        k, v = key[rows], value[rows]  # [seq_len, KH, D]
    else:
        kv_heads, width = kv_cache.shape[3], kv_cache.shape[4]
        k = kv_cache[0].index_select(0, prefill.block_ids).view(-1, kv_heads, width)
        v = kv_cache[1].index_select(0, prefill.block_ids).view(-1, kv_heads, width)
        k, v = k[: prefill.seq_len], v[: prefill.seq_len]
        if codec is not None:  # only the context's rows: the block's tail may be unwritten
            k, v = (_dequantize(rows, codec, query.dtype) for rows in (k, v))
    attended = attend(
        query[rows].transpose(0, 1).unsqueeze(0),  # [1, H, q_len, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, KH, seq_len, D]
        v.transpose(0, 1).unsqueeze(0),
        mask,
        is_causal=mask is None,
        scale=scale,
        softcap=options.softcap,
        enable_gqa=query.shape[1] != k.shape[1],
        sinks=None if options.sinks is None else options.sinks.view(-1, 1, 1),
    )  # [1, H, q_len, D]
    out[rows] = attended[0].transpose(0, 1)


def _dequantize(rows: torch.Tensor, codec: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., D + 4] gathered from a quantized cache as values [..., D]."""
    return kv_codec.dequantize_rows(rows.view(codec), dtype)
