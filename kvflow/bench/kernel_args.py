"""Flags of `kvflow bench kernels`, apart from the benchmark so that building the CLI
parser does not import torch and Triton (seconds on the start-up path of `kvflow serve`)."""

from __future__ import annotations

import argparse

__all__ = ["add_kernel_bench_args"]


def add_kernel_bench_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    add("--num-tokens", type=int, default=8192, help="tokens of the elementwise kernels")
    add("--hidden-size", type=int, default=4096)
    add("--intermediate-size", type=int, default=14336)
    add("--num-heads", type=int, default=32)
    add("--num-kv-heads", type=int, default=8)
    add("--head-dim", type=int, default=128)
    add("--block-size", type=int, default=16)
    add("--batch", type=int, default=64, help="decode attention: requests")
    add("--context", type=int, default=2048, help="decode attention: tokens per request")
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="decode attention: the cache's dtype (auto = --dtype; else kv_codec's 8-bit rows)",
    )
    add(
        "--kv-layers",
        type=int,
        default=1,
        help="decode attention: native kernels read the caches of this many layers in turn "
        "(more than the CPU's caches hold: each call starts cold, as in a model)",
    )
    add("--prefill-reqs", type=int, default=4, help="prefill attention: requests")
    add("--prefill-chunk", type=int, default=1024, help="prefill attention: new tokens each")
    add("--prefill-prefix", type=int, default=1024, help="prefill attention: cached tokens")
    add("--vocab-size", type=int, default=128256, help="grammar bitmask: vocabulary")
    add("--linear-rows", default="1,8,32", help="CPU linear layers: rows, comma-separated")
    add("--warmup", type=int, default=None, help="default 10 on CUDA, 1 on CPU")
    add("--iters", type=int, default=None, help="default 50 on CUDA, 3 on CPU")
    add("--peak-bandwidth-gbs", type=float, default=None, help="override the peak GB/s")
    add("--peak-tflops", type=float, default=None, help="override the peak TFLOP/s")
    add("--json", action="store_true", help="print one JSON object")
