"""`kvflow bench latency`: end-to-end latency of one offline batch (`vllm bench latency`).

Each iteration generates exactly --output-len tokens (ignore_eos) for --batch-size
prompts of --input-len random token ids with the in-process `LLM`, sampling at
temperature 1 as vLLM does; the latency is that call's wall time. --num-iters-warmup
iterations run first and are not counted (they pay for allocation and compilation).
The profiled iterations' % of the compute and bandwidth rooflines is printed for
prefill-heavy and decode-heavy steps apart, and written under "roofline" in --output-json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from kvflow.bench.shapes import add_shape_args, apply_shape_args
from kvflow.bench.throughput import random_token_prompts
from kvflow.services.scheduler.spec_decode.speculator import SpecDecodeCounters

PERCENTAGES = (10, 25, 50, 75, 90, 99)  # vLLM's


def add_args(parser: argparse.ArgumentParser) -> None:
    add_shape_args(parser)  # --shape NAME / --config DIR: real-size shapes, random weights
    """Bench flags only; the caller adds the engine flags (as for `bench throughput`)."""
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--output-json", default=None, help="write the latencies as JSON")
    parser.add_argument("--disable-tqdm", action="store_true")


def acceptance_summary(counters: SpecDecodeCounters) -> dict[str, float]:
    """vLLM's figures: mean acceptance length = 1 + accepted / drafts (tokens per
    verification step), and the acceptance rate of draft tokens."""
    drafts, drafted = max(counters.num_drafts, 1), max(counters.num_draft_tokens, 1)
    return {
        "mean_acceptance_length": round(1 + counters.num_accepted_tokens / drafts, 3),
        "acceptance_rate": round(counters.num_accepted_tokens / drafted, 3),
    }


def latency_stats(latencies: Sequence[float]) -> dict[str, Any]:
    """vLLM's --output-json document: mean, the raw list, and linear percentiles."""
    values = np.asarray(latencies, dtype=np.float64)
    points = np.percentile(values, PERCENTAGES)
    return {
        "avg_latency": float(values.mean()),
        "latencies": values.tolist(),
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTAGES, points)},
    }


def time_iterations(
    generate: Callable[[], object], num_iters: int, description: str, disable_tqdm: bool
) -> list[float]:
    """Wall time of `num_iters` calls of `generate()`, in seconds."""
    latencies = []
    for _ in tqdm(range(num_iters), desc=description, disable=disable_tqdm):
        start = time.perf_counter()
        generate()
        latencies.append(time.perf_counter() - start)
    return latencies


def run(args: argparse.Namespace) -> int:
    from kvflow.bench.roofline import roofline_lines, roofline_section
    from kvflow.cli.args import engine_options
    from kvflow.offline.llm import LLM
    from kvflow.sampling_params import SamplingParams

    apply_shape_args(args)
    llm = LLM(**engine_options(args))
    max_model_len = llm.engine.max_model_len
    if max_model_len < args.input_len + args.output_len:
        raise SystemExit(
            f"kvflow bench latency: --input-len + --output-len exceeds max_model_len "
            f"{max_model_len}"
        )
    special = list(llm.tokenizer.all_special_ids)
    prompts = random_token_prompts(
        args.batch_size, args.input_len, llm.engine.vocab_size, special, args.bench_seed
    )
    params = SamplingParams(
        n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len
    )

    def generate() -> None:
        llm.generate(prompts, params)

    print("Warming up...")
    time_iterations(generate, args.num_iters_warmup, "Warmup iterations", args.disable_tqdm)
    llm.engine.roofline.reset()  # the profiled iterations only
    latencies = time_iterations(generate, args.num_iters, "Profiling iterations", args.disable_tqdm)
    stats = latency_stats(latencies)
    stats["roofline"] = roofline_section(llm.engine)
    print(f"Avg latency: {stats['avg_latency']} seconds")
    for percentage, value in stats["percentiles"].items():
        print(f"{percentage}% percentile latency: {value} seconds")
    print("\n".join(roofline_lines(stats["roofline"])))
    speculator = llm.engine.scheduler.speculator
    if speculator is not None:
        stats["spec_decode"] = acceptance_summary(speculator.counters)
        print(f"Mean acceptance length: {stats['spec_decode']['mean_acceptance_length']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(stats, f, indent=4)
    return 0
