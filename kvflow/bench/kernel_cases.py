"""The cases `kvflow bench kernels` times: each kernel at one shape, with the bytes it must
move and the flops it must do (each input read once, each output written once), and the
implementations to compare (the Triton kernel, torch references and baselines).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvflow.kernels import activation, grammar_bitmask, kv_codec, rms_norm, rotary, store_kv
from kvflow.kernels.cpu.paged_decode import load_paged_decode, load_portable_paged_decode
from kvflow.kernels.paged_attention import paged_attention, paged_attention_ref


@dataclass(frozen=True)
class Case:
    """One kernel at one shape: its minimal traffic and work, and the ways to run it."""

    name: str
    bytes: int
    flops: int
    impls: dict[str, Callable[[], object]]


def elementwise_cases(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> list[Case]:
    t, h, inter, elt = a.num_tokens, a.hidden_size, a.intermediate_size, _elt(dt)
    x, res = _randn(dev, dt, t, h), _randn(dev, dt, t, h)
    weight = _randn(dev, dt, h)
    q = _randn(dev, dt, t, a.num_heads, a.head_dim)
    k = _randn(dev, dt, t, a.num_kv_heads, a.head_dim)
    cos_sin = rotary.rope_cos_sin_cache(a.head_dim, t, 10000.0, dev)
    positions = torch.arange(t, device=dev)
    gate_up = _randn(dev, dt, t, 2 * inter)
    qk_elems = t * (a.num_heads + a.num_kv_heads) * a.head_dim
    return [
        Case("fused_add_rms_norm", 4 * t * h * elt + h * elt, 5 * t * h, {
            "triton": lambda: rms_norm.fused_add_rms_norm(x, res, weight, 1e-6),
            "torch": lambda: rms_norm.fused_add_rms_norm_ref(x, res, weight, 1e-6),
        }),
        Case("rotary_neox", 2 * qk_elems * elt + t * a.head_dim * 4 + 8 * t, 3 * qk_elems, {
            "triton": lambda: rotary.rotary_embedding(positions, q, k, cos_sin),
            "torch": lambda: rotary.rotary_embedding_ref(positions, q, k, cos_sin),
        }),
        Case("silu_and_mul", 3 * t * inter * elt, 5 * t * inter, {
            "triton": lambda: activation.silu_and_mul(gate_up),
            "torch": lambda: activation.silu_and_mul_ref(gate_up),
        }),
    ]  # fmt: skip


def store_and_mask_cases(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> list[Case]:
    t, kvh, d, bs = a.num_tokens, a.num_kv_heads, a.head_dim, a.block_size
    key, value = _randn(dev, dt, t, kvh, d), _randn(dev, dt, t, kvh, d)
    num_blocks = -(-t // bs)
    cache = torch.zeros(2, num_blocks, bs, kvh, d, dtype=dt, device=dev)
    slots = torch.randperm(num_blocks * bs, device=dev)[:t]
    flat = cache.view(2, num_blocks * bs, kvh, d)

    def index_copy() -> None:  # what the torch backend does
        flat[0].index_copy_(0, slots, key)
        flat[1].index_copy_(0, slots, value)

    rows, vocab = a.batch, a.vocab_size
    logits = torch.randn(rows, vocab, device=dev)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, -(-vocab // 32)), device=dev)
    bitmask = words.to(torch.int32)
    allowed_bits = sum(bin(w & 0xFFFFFFFF).count("1") for w in words.flatten().tolist())
    # The kernel writes only the masked logits (fp32) and never reads the others.
    masked_writes = (rows * -(-vocab // 32) * 32 - allowed_bits) * 4
    return [
        Case("store_kv", 4 * t * kvh * d * _elt(dt) + 8 * t, 0, {
            "triton": lambda: store_kv.store_kv(key, value, cache, slots),
            "torch": index_copy,
        }),
        Case("grammar_bitmask", bitmask.numel() * 4 + masked_writes, 0, {
            "triton": lambda: grammar_bitmask.apply_grammar_bitmask(logits, bitmask),
            "torch": lambda: grammar_bitmask.apply_grammar_bitmask_ref(logits, bitmask),
        }),
    ]  # fmt: skip


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _randn(device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


@dataclass
class _Paged:
    """A step over a paged cache whose blocks are handed out in random order."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    scale: float

    def inputs(self) -> tuple[Any, ...]:
        return (self.query, self.kv_cache, self.query_start_loc, self.seq_lens,
                self.block_tables, self.scale)  # fmt: skip

    def gather(self, r: int, plane: int) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
        """The request's context (dequantized to the query's dtype from a quantized cache)."""
        _, _, bs, kvh, row = self.kv_cache.shape
        seq_len = int(self.seq_lens[r])
        blocks = self.block_tables[r, : -(-seq_len // bs)].long()
        rows = self.kv_cache[plane].index_select(0, blocks).view(-1, kvh, row)[:seq_len]
        if kv_codec.is_quantized(rows.dtype):
            return kv_codec.dequantize_rows(rows, self.query.dtype)
        return rows


def _paged(a: argparse.Namespace, dev: torch.device, dt: torch.dtype, seq: int, q_len: int,
           num_reqs: int) -> _Paged:  # fmt: skip
    per_req = -(-seq // a.block_size)
    order = torch.randperm(num_reqs * per_req, device=dev).to(torch.int32)
    return _Paged(
        query=_randn(dev, dt, num_reqs * q_len, a.num_heads, a.head_dim),
        kv_cache=_randn(dev, dt, 2, num_reqs * per_req, a.block_size, a.num_kv_heads, a.head_dim),
        query_start_loc=torch.arange(0, num_reqs * q_len + 1, q_len, device=dev).to(torch.int32),
        seq_lens=torch.full((num_reqs,), seq, dtype=torch.int32, device=dev),
        block_tables=order.view(num_reqs, per_req),
        scale=a.head_dim**-0.5,
    )


def _kv_codec_dtype(a: argparse.Namespace) -> torch.dtype | None:
    """The storage dtype of `--kv-cache-dtype` (None: a float cache of --dtype)."""
    name = "fp8_e4m3" if a.kv_cache_dtype == "fp8" else a.kv_cache_dtype
    return None if name == "auto" else kv_codec.CODEC_DTYPES[name]


def _each_layer_in_turn(kernel: Any, p: _Paged, caches: list[torch.Tensor], rows: torch.Tensor,
                        out: torch.Tensor) -> Callable[[], object]:  # fmt: skip
    """A call of the native decode kernel on the next layer's cache of `caches`; returns
    the output tensor it wrote."""
    layers = itertools.cycle(caches)

    def call() -> torch.Tensor:
        kernel(p.query, next(layers), p.block_tables, p.seq_lens, rows, rows, out, p.scale)
        return out

    return call


def _decode_attention_case(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> Case:
    """With `--kv-cache-dtype` quantized, the native kernels read the quantized cache and
    the torch baselines its dequantization (what the torch backend does); Triton and the
    reference are timed on float caches only. `--kv-layers` caches are read in turn."""
    b, seq, h, kvh, d = a.batch, a.context, a.num_heads, a.num_kv_heads, a.head_dim
    p = _paged(a, dev, dt, seq, 1, b)
    codec = _kv_codec_dtype(a)
    caches = [p.kv_cache, *(torch.randn_like(p.kv_cache) for _ in range(a.kv_layers - 1))]
    if codec is not None:
        caches = [kv_codec.quantize_rows(c, codec) for c in caches]
        p.kv_cache = caches[0]
    q4 = p.query.view(b, h, 1, d)
    dense = [torch.stack([p.gather(r, i) for r in range(b)]).transpose(1, 2).contiguous()
             for i in (0, 1)]  # fmt: skip

    def gather_sdpa() -> torch.Tensor:
        k, v = (torch.stack([p.gather(r, i) for r in range(b)]).transpose(1, 2) for i in (0, 1))
        return F.scaled_dot_product_attention(q4, k, v, scale=p.scale, enable_gqa=h != kvh)

    rows = torch.arange(b, dtype=torch.int32)
    out = torch.empty_like(p.query)
    cpu_native: dict[str, Callable[[], object]] = {}
    # The native build, and (x86) its AVX2 build: the loops of CPUs without AVX-512.
    for name, load in (("cpu-native", load_paged_decode),
                       ("cpu-native(avx2 build)", load_portable_paged_decode)):  # fmt: skip
        kernel = load() if dev.type == "cpu" else None
        if kernel is not None and kernel.supports(p.query, p.kv_cache):
            cpu_native[name] = _each_layer_in_turn(kernel, p, caches, rows, out)
    row_bytes = kv_codec.row_width(d, p.kv_cache.dtype) * p.kv_cache.element_size()
    float_only: dict[str, Callable[[], object]] = {
        "triton": lambda: paged_attention(*p.inputs(), max_query_len=1, max_seq_len=seq),
        "torch-ref": lambda: paged_attention_ref(*p.inputs()),
    }
    kv_name = "" if codec is None else f" kv={a.kv_cache_dtype}"
    return Case(
        f"decode_attention b{b} ctx{seq}{kv_name}",
        2 * b * seq * kvh * row_bytes + 2 * b * h * d * _elt(dt),
        4 * b * h * seq * d,
        {
            **cpu_native,
            **(float_only if codec is None else {}),
            "torch-gather+sdpa": gather_sdpa,
            "torch-sdpa(contiguous kv)": lambda: F.scaled_dot_product_attention(
                q4, dense[0], dense[1], scale=p.scale, enable_gqa=h != kvh
            ),
        },
    )


def _prefill_attention_case(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> Case:
    r, c, prefix, h, kvh, d = (a.prefill_reqs, a.prefill_chunk, a.prefill_prefix,
                               a.num_heads, a.num_kv_heads, a.head_dim)  # fmt: skip
    p = _paged(a, dev, dt, prefix + c, c, r)
    key_pos = torch.arange(prefix + c, device=dev)
    mask = key_pos[None, :] <= prefix + torch.arange(c, device=dev)[:, None]  # [c, prefix + c]

    def gather_sdpa() -> None:
        for i in range(r):
            q = p.query[i * c : (i + 1) * c].transpose(0, 1)[None]
            k, v = (p.gather(i, plane).transpose(0, 1)[None] for plane in (0, 1))
            F.scaled_dot_product_attention(q, k, v, mask, scale=p.scale, enable_gqa=h != kvh)

    pairs = r * (c * prefix + c * (c + 1) // 2)  # (query, key) pairs that causality allows
    return Case(
        f"prefill_attention {r}x{c} over {prefix}",
        2 * r * (prefix + c) * kvh * d * _elt(dt) + 2 * r * c * h * d * _elt(dt),
        4 * h * d * pairs,
        {
            "triton": lambda: paged_attention(*p.inputs(), max_query_len=c, max_seq_len=prefix + c),
            "torch-ref": lambda: paged_attention_ref(*p.inputs()),
            "torch-gather+sdpa": gather_sdpa,
        },
    )


def attention_cases(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> list[Case]:
    return [_decode_attention_case(a, dev, dt), _prefill_attention_case(a, dev, dt)]


def cpu_linear_cases(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> list[Case]:
    """Small-batch linear layers on the CPU (hidden -> intermediate, `--linear-rows`):
    float32 weights (`torch`: F.linear; `cpu-native`: kvflow's route, kernels/cpu/linear.py)
    and each GGUF block format (`torch`: F.linear on the dequantized weights;
    `cpu-native`: the block kernel, at <= its MAX_ROWS; `cpu-int8`: the int8 kernel of
    `--quantization gguf`; `cpu-vnni`: its VNNI block kernel, at <= 8 rows, where the CPU
    has VNNI). Bytes: the weights in the form read, x and y."""
    import gguf

    from kvflow.kernels.cpu import block_linear, block_vnni, int8_linear
    from kvflow.kernels.cpu.linear import linear

    if dev.type != "cpu" or dt != torch.float32:
        return []
    k, n = a.hidden_size, a.intermediate_size
    weight = torch.randn(n, k)
    cases = []
    for rows in (int(r) for r in a.linear_rows.split(",")):
        x = torch.randn(rows, k)
        activations = 4 * rows * (k + n)
        flops = 2 * rows * k * n
        cases.append(Case(f"linear_f32 {rows}x{k}->{n}", 4 * k * n + activations, flops, {
            "torch": functools.partial(F.linear, x, weight),
            "cpu-native": functools.partial(linear, x, weight),
        }))  # fmt: skip
        if not block_linear.available():
            continue
        for fmt in block_linear.FORMATS:
            qtype = gguf.GGMLQuantizationType[fmt]
            raw = torch.from_numpy(gguf.quants.quantize(weight.numpy(), qtype))
            blocks = block_linear.BlockWeights.from_gguf(fmt, raw, k)
            dense = block_linear.dequantize(blocks)
            impls: dict[str, Callable[[], object]] = {
                "torch": functools.partial(F.linear, x, dense)
            }
            if rows <= block_linear.MAX_ROWS:
                impls["cpu-native"] = functools.partial(block_linear.block_linear, x, blocks)
            if int8_linear.library() is not None:  # `--quantization gguf`'s kernel
                quant = int8_linear.QuantWeights.from_blocks(blocks)
                impls["cpu-int8"] = functools.partial(int8_linear.int8_linear, x, quant)
            if rows <= block_vnni.MAX_ROWS and block_vnni.available():
                impls["cpu-vnni"] = functools.partial(block_vnni.block_vnni_linear, x, blocks)
            cases.append(Case(
                f"linear_{fmt.lower()} {rows}x{k}->{n}", blocks.nbytes + activations, flops, impls
            ))  # fmt: skip
    return cases


def cpu_bf16_linear_cases(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> list[Case]:
    """bfloat16 linear layers on the CPU (hidden -> intermediate, `--linear-rows`):
    `torch`: F.linear on the plain weight; `cpu-onednn`: oneDNN on the weight packed in
    its blocked layout (packed_linear.py); `cpu-native`: the native bf16 GEMM on its
    panels (bf16_gemm.py, CPUs with AVX512_BF16). Bytes: the weights, x and y."""
    from kvflow.kernels.cpu import bf16_gemm, packed_linear

    if dev.type != "cpu" or dt != torch.bfloat16:
        return []
    k, n = a.hidden_size, a.intermediate_size
    weight = torch.randn(n, k).bfloat16()
    onednn, panels = packed_linear.pack(weight), bf16_gemm.pack(weight)
    cases = []
    for rows in (int(r) for r in a.linear_rows.split(",")):
        x = torch.randn(rows, k).bfloat16()
        impls: dict[str, Callable[[], object]] = {"torch": functools.partial(F.linear, x, weight)}
        if onednn is not None:
            impls["cpu-onednn"] = functools.partial(packed_linear.packed_linear, x, onednn)
        if panels is not None:
            impls["cpu-native"] = functools.partial(bf16_gemm.bf16_gemm, x, panels)
        nbytes = 2 * (k * n + rows * (k + n))
        cases.append(Case(f"linear_bf16 {rows}x{k}->{n}", nbytes, 2 * rows * k * n, impls))
    return cases
