"""Time the paged decode-attention kernel's launch choices on this GPU (a GPU check).

Usage: python decode_attention_sweep.py [--smoke]

For each shape below (the `bench kernels` case, and SmolLM2's heads), stage 1 times every
(tile_n, num_splits) pair with Triton's default warps and stages; stage 2 times the
warps and stages of stage 1's best pair. Each configuration's output is checked against
SDPA on the gathered K/V before it is timed. Prints one JSON line per configuration, then
one summary line: per shape, the default choice (the chooser's splits, the decode tile)
and the best configuration, with GB/s
and the share of the device's peak (`bench kernels`' table). `--smoke` runs one tiny
shape and two configurations (on CPUs, under TRITON_INTERPRET=1, as a test does).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvflow.kernels.launch_utils import num_sms
from kvflow.kernels.paged_attention import (
    SplitKVScratch,
    choose_num_splits,
    choose_tile_n,
    split_kv_paged_attention,
    unified_paged_attention,
)
from kvflow.metrics.device_peaks import gpu_table_peaks


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16


SHAPES = [
    Shape("bench b64 ctx2048 h32/8 d128", 64, 2048, 32, 8, 128),
    Shape("smollm2 b64 ctx2048 h9/3 d64", 64, 2048, 9, 3, 64),
]
SMOKE = Shape("smoke b2 ctx40 h4/2 d16", 2, 40, 4, 2, 16)


class Case:
    """Random paged inputs of one shape (bf16 on CUDA, fp32 interpreted), and SDPA's answer."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.shape = s = shape
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        per_req = -(-s.context // s.block_size)
        blocks = torch.randperm(s.batch * per_req, generator=torch.Generator().manual_seed(0))
        self.block_tables = blocks.to(torch.int32).view(s.batch, per_req).to(device)
        gen = torch.Generator(device=device).manual_seed(0)
        kv_shape = (2, s.batch * per_req, s.block_size, s.num_kv_heads, s.head_dim)
        self.kv_cache = torch.randn(kv_shape, generator=gen, device=device).to(dtype)
        q_shape = (s.batch, s.num_heads, s.head_dim)
        self.query = torch.randn(q_shape, generator=gen, device=device).to(dtype)
        self.query_start_loc = torch.arange(s.batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((s.batch,), s.context, dtype=torch.int32, device=device)
        self.scale = s.head_dim**-0.5
        self.expected = self._sdpa()
        self.bytes = (
            2 * s.batch * s.context * s.num_kv_heads * s.head_dim * self.kv_cache.element_size()
        )

    def _sdpa(self) -> torch.Tensor:
        s = self.shape
        kv = self.kv_cache[:, self.block_tables.long()]  # [2, B, per_req, bs, kvh, d]
        kv = kv.flatten(2, 3)[:, :, : s.context].transpose(2, 3).float()  # [2, B, kvh, ctx, d]
        q = self.query.float().unsqueeze(2)  # [B, h, 1, d]
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], scale=self.scale, enable_gqa=True)
        return out.squeeze(2)

    def run(self, tile_n: int, splits: int, warps: int | None, stages: int | None) -> torch.Tensor:
        args = (self.query, self.kv_cache, self.query_start_loc, self.seq_lens, self.block_tables,
                self.scale)  # fmt: skip
        knobs: dict[str, Any] = {"max_query_len": 1, "tile_n": tile_n, "num_warps": warps,
                                 "num_stages": stages}  # fmt: skip
        if splits == 1:
            return unified_paged_attention(*args, **knobs)
        s = self.shape
        scratch = SplitKVScratch.allocate(
            s.batch, s.num_heads, s.head_dim, splits, self.query.device
        )
        return split_kv_paged_attention(*args, num_splits=splits, scratch=scratch, **knobs)


def time_ms(fn: Any, device: torch.device) -> float:
    if device.type != "cuda":
        fn()
        return float("nan")
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40))


def measure(case: Case, config: tuple[int, int, int | None, int | None], peak_gbs: float) -> dict:
    tile_n, splits, warps, stages = config
    device = case.query.device
    try:
        error = (case.run(*config).float() - case.expected).abs().max().item()
        ms = time_ms(lambda: case.run(*config), device)
    except Exception as exc:  # a configuration that does not compile or fit: reported
        return {"shape": case.shape.name, "config": config, "error": repr(exc)[:300]}
    gbs = case.bytes / ms / 1e6
    return {"shape": case.shape.name, "tile_n": tile_n, "splits": splits, "warps": warps,
            "stages": stages, "ms": round(ms, 4), "gb_per_s": round(gbs, 1),
            "pct_peak": round(100 * gbs / peak_gbs, 1), "max_abs_err": error}  # fmt: skip


def sweep(shape: Shape, device: torch.device, peak_gbs: float, smoke: bool) -> dict:
    case = Case(shape, device)
    chosen = choose_num_splits(shape.batch, shape.num_kv_heads, 1, shape.context, num_sms(device))
    tile = choose_tile_n(1)  # what a decode batch gets by default
    stage1 = [(tile, 1), (16, 2)] if smoke else list(itertools.product((32, 64, 128), (1, 2, 4, 8)))
    rows = []
    for tile_n, splits in stage1:
        rows.append(measure(case, (tile_n, splits, None, None), peak_gbs))
        print(json.dumps(rows[-1]), flush=True)
    timed = [r for r in rows if "ms" in r and r["max_abs_err"] < 3e-2]
    if timed:
        best = min(timed, key=lambda r: (r["ms"], r["tile_n"]))
        knobs = [(4, 2)] if smoke else itertools.product((4, 8), (2, 3, 4))
        for warps, stages in knobs:
            rows.append(measure(case, (best["tile_n"], best["splits"], warps, stages), peak_gbs))
            print(json.dumps(rows[-1]), flush=True)
    timed = [r for r in rows if "ms" in r and r["max_abs_err"] < 3e-2]
    default = next((r for r in rows if r.get("tile_n") == tile and r.get("splits") == chosen
                    and r.get("warps") is None), None)  # fmt: skip
    return {
        "chooser_splits": chosen,
        "default": default,
        "best": min(timed, key=lambda r: r["ms"]) if timed and not smoke else None,
        "configs": len(rows),
        "failed": [r for r in rows if "ms" not in r or r["max_abs_err"] >= 3e-2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak_gbs = 3350.0
    if device.type == "cuda":
        peaks = gpu_table_peaks(torch.cuda.get_device_name())
        peak_gbs = peaks.bandwidth / 1e9 if peaks is not None else float("nan")
    shapes = [SMOKE] if args.smoke else SHAPES
    summary = {s.name: sweep(s, device, peak_gbs, args.smoke) for s in shapes}
    print(json.dumps({"peak_gbs": peak_gbs, "shapes": summary}))


if __name__ == "__main__":
    main()
