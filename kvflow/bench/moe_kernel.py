"""`kvflow bench moe-kernel`: the native fused-expert kernel (kernels/cpu/fused_moe.cpp)
on one Qwen3-MoE-shaped layer, against a dense bf16 GEMM of the same FLOPs, interleaved
in one run (on a shared machine only such ratios mean anything).

`--layers` layers of distinct random experts are cycled, so a decode call reads its
experts from memory as a model's step does. Per token count the table gives, best of
`--repeats` rounds: the kernel's time (routing and grouping outside it), the routing +
grouping that surround it in the model (route, group_by_expert), the dense GEMM's time
([T * top_k, H] x [H, 3 I], oneDNN) and their ratio. `--baseline FILE` also builds
another fused_moe.cpp (e.g. main's, which read the weights in their natural [E, N, K]
layout) and times it in the same rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_TOKENS = (8, 64, 512)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=384, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="distinct layers cycled")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--baseline", type=Path, help="another fused_moe.cpp, natural layout")
    parser.add_argument("--json", action="store_true")


class _Layer:
    def __init__(self, args: argparse.Namespace, dtype: torch.dtype, seed: int) -> None:
        from kvflow.kernels.cpu import fused_moe

        gen = torch.Generator().manual_seed(seed)
        e, h, i = args.experts, args.hidden, args.inter
        self.w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
        self.w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
        self.router = torch.randn(e, h, generator=gen).to(dtype)
        self.packed = fused_moe.pack(self.w13, self.w2)
        if args.baseline is None:  # only the baseline reads the natural layout
            self.w13 = self.w2 = torch.empty(0)


def _load_baseline(source: Path) -> ctypes.CDLL:
    from kvflow.kernels.cpu import native_build

    compiler = native_build._compiler()
    if compiler is None:
        raise SystemExit("no C++ compiler for --baseline")
    target = Path(tempfile.mkdtemp(prefix="moe-baseline-")) / "fused_moe.so"
    headers = ["-I", str(native_build.SOURCE_DIR)]  # vec.h, if the file has none beside it
    native_build._build(
        source.resolve(), compiler, target, "native", ["-I", str(source.parent), *headers]
    )
    library = ctypes.CDLL(str(target))
    POINTER, INT64 = ctypes.c_void_p, ctypes.c_int64
    library.kvflow_fused_moe.argtypes = [
        *[POINTER] * 10, *[INT64] * 7, POINTER, POINTER, INT64, *[ctypes.c_float] * 2
    ]  # fmt: skip
    library.kvflow_fused_moe.restype = ctypes.c_int
    return library


def _baseline_call(library: ctypes.CDLL, x: torch.Tensor, layer: _Layer, grouping: Any,
                   routing: Any, top_k: int) -> None:  # fmt: skip
    """The same call as fused_moe.fused_moe, on the natural [E, N, K] weights."""
    tokens, hidden = x.shape
    experts, inter = layer.w2.shape[0], layer.w2.shape[2]
    y = torch.empty(grouping.rows.shape[0], hidden, dtype=x.dtype)
    act = torch.empty(grouping.rows.shape[0], inter, dtype=x.dtype)
    out = torch.empty(tokens, hidden, dtype=x.dtype)
    weights = routing.weights.to(torch.float32).contiguous()
    status = library.kvflow_fused_moe(
        x.data_ptr(), grouping.rows.data_ptr(), grouping.offsets.data_ptr(),
        layer.w13.data_ptr(), layer.w2.data_ptr(), act.data_ptr(), y.data_ptr(),
        grouping.inverse.data_ptr(), weights.data_ptr(), out.data_ptr(), experts, hidden,
        inter, x.stride(0), tokens, top_k, int(x.dtype == torch.bfloat16), None, None, 0,
        1.0, 0.0,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"baseline fused experts failed with status {status}")


def _time_tokens(args: argparse.Namespace, layers: list[_Layer], tokens: int,
                 baseline: ctypes.CDLL | None) -> dict[str, float]:  # fmt: skip
    """Best time of each call, its rounds interleaved: per round every call on every layer."""
    from kvflow.kernels.cpu import fused_moe
    from kvflow.kernels.fused_moe_reference import group_by_expert, route

    dtype = layers[0].packed.dtype
    x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    dense_w = torch.randn(3 * args.inter, args.hidden).to(dtype)
    dense_x = torch.randn(tokens * args.top_k, args.hidden).to(dtype)

    def routed(layer: _Layer) -> tuple[Any, Any]:
        routing = route(torch.nn.functional.linear(x, layer.router), args.top_k, True)
        return routing, group_by_expert(routing.ids, args.experts)

    def call(name: str, layer: _Layer, routing: Any, grouping: Any) -> None:
        if name == "new":
            fused_moe.fused_moe(x, grouping, routing, grouping.offsets, layer.packed)
        elif name == "baseline" and baseline is not None:
            _baseline_call(baseline, x, layer, grouping, routing, args.top_k)
        elif name == "dense":
            torch.nn.functional.linear(dense_x, dense_w)
        else:
            routed(layer)

    names = ["new", "dense", "routing"] + (["baseline"] if baseline is not None else [])
    plans = [(layer, *routed(layer)) for layer in layers]
    timings: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            for plan in plans:
                start = time.perf_counter()
                call(name, *plan)
                timings[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in timings.items()}


def _row(args: argparse.Namespace, tokens: int, best: dict[str, float]) -> dict[str, Any]:
    flops = 2 * tokens * args.top_k * args.hidden * 3 * args.inter
    row: dict[str, Any] = {"tokens": tokens, "gflop": flops / 1e9}
    for name, seconds in best.items():
        row[f"{name}_ms"] = seconds * 1e3
        row[f"{name}_gflops"] = flops / seconds / 1e9
    row["new_over_dense"] = best["new"] / best["dense"]
    if "baseline" in best:
        row["baseline_over_new"] = best["baseline"] / best["new"]
    return row


def run(args: argparse.Namespace) -> int:
    from kvflow.kernels.cpu import fused_moe

    if not fused_moe.available():
        raise SystemExit("the native fused-expert kernel is not available here")
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    layers = [_Layer(args, dtype, seed) for seed in range(args.layers)]
    baseline = _load_baseline(args.baseline) if args.baseline is not None else None
    rows = [_row(args, t, _time_tokens(args, layers, t, baseline)) for t in args.tokens]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"fused experts H={args.hidden} I={args.inter} E={args.experts} top-{args.top_k} "
          f"{args.dtype}, {args.num_threads} threads, best of {args.repeats} x {args.layers} layers")  # fmt: skip
    for row in rows:
        parts = [
            f"T={row['tokens']:4d}",
            f"new {row['new_ms']:7.2f} ms ({row['new_gflops']:5.1f} GFLOP/s)",
        ]
        if "baseline_ms" in row:
            parts.append(
                f"baseline {row['baseline_ms']:7.2f} ms ({row['baseline_over_new']:.2f}x new)"
            )
        parts.append(f"dense {row['dense_ms']:6.2f} ms (new/dense {row['new_over_dense']:.2f})")
        parts.append(f"routing+grouping {row['routing_ms']:5.2f} ms")
        print("  ".join(parts))
    return 0
