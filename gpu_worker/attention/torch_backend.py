"""Paged attention in plain torch ops: the CPU backend and the reference for the kernels.

One step mixes requests of two kinds, planned once per step from the host lists of the
metadata (no device syncs, torch_plan.py) and reused by every layer:

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

import torch

from kvflow.gpu_worker.attention.softcap import LogitOptions, attend
from kvflow.gpu_worker.attention.torch_plan import DecodeBatch, Prefill, StepPlan, plan_step
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.kernels import kv_codec
from kvflow.kernels.cpu import elementwise
from kvflow.kernels.cpu.paged_decode import PagedDecodeAttention, check_indices
from kvflow.kernels.cpu.prefill_attention import PrefillAttention


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
        self._plans: list[StepPlan] = []  # this step's, one per KV cache group
        self._decode_kernel = decode_kernel
        self._prefill_kernel = prefill_kernel

    @property
    def has_decode_kernel(self) -> bool:
        return self._decode_kernel is not None

    def plan_for(
        self, metadata: AttentionMetadata, kv_cache: torch.Tensor, num_rows: int
    ) -> StepPlan:
        """The step's plan, made once per metadata (one per KV cache group) and reused by
        every layer of the group (a CPU decode graph makes it before recording: planning
        reads tensor data)."""
        for plan in self._plans:
            if plan.metadata is metadata:
                return plan
        # Another group's metadata of the same step shares its query layout tensors.
        plans = self._plans
        if not plans or plans[0].metadata.query_start_loc is not metadata.query_start_loc:
            plans.clear()
        plan = plan_step(metadata, kv_cache)
        plans.append(plan)
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
    plan: StepPlan,
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
    batch: DecodeBatch,
    out: torch.Tensor,
    scale: float,
    options: LogitOptions,
    codec: torch.dtype | None = None,
) -> None:
    k, v = batch.gather(kv_cache, options.window)  # [B, KH, L, D] ([B, KH, L, D + 4] if quantized)
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
    prefill: Prefill,
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
        first = prefill.first_block(options.window)  # the window's first block: read from there
        block_ids = prefill.block_ids[first:]
        k = kv_cache[0].index_select(0, block_ids).view(-1, kv_heads, width)
        v = kv_cache[1].index_select(0, block_ids).view(-1, kv_heads, width)
        num_keys = prefill.seq_len - first * prefill.block_size
        k, v = k[:num_keys], v[:num_keys]
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
