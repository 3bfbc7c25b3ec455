"""Where a decode step's time goes on this GPU (a GPU check).

Usage: python decode_step_profile.py [--model PATH] [--batch-sizes 1 64] [--enforce-eager]

For each batch size, decodes that many random prompts with the in-process engine and,
after warm-up steps, profiles `--steps` decode steps twice:
  - torch.profiler: the device kernels by total device time (name, calls, us per step);
  - cProfile: the host functions of the same steps by own time (us per step).
Prints one JSON line: {batch_size: {"kernels": [...], "host": [...], "step_ms": ...}}.
On a CPU it profiles the CPU ops instead (a test runs it on a tiny model).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kvflow.bench.throughput import random_token_prompts
from kvflow.offline.llm import LLM
from kvflow.sampling_params import SamplingParams

TOP = 25


def _kernels(prof: Any, steps: int, cuda: bool) -> list[dict[str, Any]]:
    """The top device kernels (CPU ops without CUDA), in microseconds per step."""
    rows = []
    for event in prof.key_averages():
        total = event.device_time_total if cuda else event.self_cpu_time_total
        if total <= 0 or (cuda and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        rows.append({"name": event.key[:120], "calls_per_step": event.count / steps,
                     "us_per_step": round(total / steps, 1)})  # fmt: skip
    return sorted(rows, key=lambda r: -r["us_per_step"])[:TOP]


def _host(stats: pstats.Stats, steps: int) -> list[dict[str, Any]]:
    rows = []
    for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{path.rsplit('/', 2)[-2:]}:{line}:{func}" if "/" in path else f"{path}:{func}"
        rows.append({"function": where, "calls_per_step": calls / steps,
                     "own_us_per_step": round(1e6 * own / steps, 1),
                     "cum_us_per_step": round(1e6 * cumulative / steps, 1)})  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_us_per_step"])[:TOP]


def profile_batch(llm: LLM, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = llm.engine
    cuda = engine.runner.device.type == "cuda"
    special = list(llm.tokenizer.all_special_ids)
    prompts = random_token_prompts(batch, args.input_len, engine.vocab_size, special, 0)
    params = SamplingParams(temperature=1.0, ignore_eos=True,
                            max_tokens=args.warmup_steps + 3 * args.steps + 2)  # fmt: skip
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{batch}-{i}", prompt, params)
    for _ in range(args.warmup_steps + 1):  # the prefill, then warm-up decode steps
        engine.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    step_ms = 1e3 * (time.perf_counter() - start) / args.steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    host = cProfile.Profile()
    host.enable()
    for _ in range(args.steps):
        engine.step()
    sync()
    host.disable()
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_ms": round(step_ms, 3), "kernels": _kernels(prof, args.steps, cuda),
            "host": _host(pstats.Stats(host), args.steps)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    options: dict[str, Any] = {"max_num_seqs": max(args.batch_sizes)}
    if args.model:
        options["model"] = args.model
    if args.enforce_eager:
        options["enforce_eager"] = True
    llm = LLM(**options)
    print(json.dumps({str(b): profile_batch(llm, b, args) for b in args.batch_sizes}))


if __name__ == "__main__":
    main()
