"""A closed-loop serving run of the scheduler's policy on a virtual clock.

The real sans-IO `Scheduler` and `KVCacheManager` plan every step; a linear step-cost
model (seconds per step, per decode, per prefill token) stands in for the model, and
`concurrency` clients each send their next request `gap_s` after their previous one
finished (the shape of `kvflow bench serve --max-concurrency N` at rate inf). It
compares budgets and prefill policies without the noise of a shared CPU: the schedule
is exact, the time of each step is the model's. Calibrate the model from measured step
times (docs/benchmarks.md, "Scheduling for TTFT (CPU)"); validate the winner served.

    python -m kvflow.bench.serve_sim --budgets 512 1024 2048 --orders fcfs shortest
"""

from __future__ import annotations

import argparse
import itertools
import random
from dataclasses import dataclass, field

import numpy as np

from kvflow.config import SchedulerConfig
from kvflow.proto.step import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.scheduler import Scheduler

SAMPLED_TOKEN = 7  # any id: requests ignore EOS and stop at max_tokens


@dataclass(frozen=True)
class StepCostModel:
    """Seconds of one step: fixed + per decoding request + per prefill token."""

    fixed_s: float
    per_decode_s: float
    per_prefill_token_s: float

    def seconds(self, num_decodes: int, num_prefill_tokens: int) -> float:
        decode = self.per_decode_s * num_decodes
        return self.fixed_s + decode + self.per_prefill_token_s * num_prefill_tokens


# Embedded SmolLM2-135M, bfloat16, 2 threads, AMD EPYC Zen 4 (no AMX): the fastest of
# three repeats of each shape (docs/benchmarks.md, "Scheduling for TTFT (CPU)").
CPU_SMOLLM2 = StepCostModel(fixed_s=0.025, per_decode_s=0.002, per_prefill_token_s=0.00072)


@dataclass
class SimResult:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    first_token_order: list[str] = field(default_factory=list)
    num_output_tokens: int = 0
    duration_s: float = 0.0
    num_steps: int = 0

    def summary(self) -> dict[str, float]:
        ttft, itl = np.array(self.ttft_s), np.array(self.itl_s)
        return {
            "out_tok_s": self.num_output_tokens / self.duration_s,
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "itl_p50_s": float(np.percentile(itl, 50)) if itl.size else 0.0,
            "itl_p99_s": float(np.percentile(itl, 99)) if itl.size else 0.0,
        }


def simulate(
    config: SchedulerConfig,
    lengths: list[tuple[int, int]],  # (prompt tokens, output tokens), in sending order
    concurrency: int,
    cost: StepCostModel,
    gap_s: float = 0.005,
    jitter_s: float = 0.0,  # each turnaround gets uniform [0, jitter_s) more (seeded)
    block_size: int = 16,
) -> SimResult:
    num_blocks = sum(-(-(p + o) // block_size) for p, o in lengths) + 1  # never preempts
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, False), 1 << 20)
    rng = random.Random(0)
    specs = iter(enumerate(lengths))
    arrivals: list[tuple[float, int, int, int]] = []  # (time, index, prompt, output)
    for index, (prompt, output) in itertools.islice(specs, concurrency):
        arrivals.append((0.0, index, prompt, output))
    sent: dict[str, float] = {}
    last_token: dict[str, float] = {}
    result, now = SimResult(), 0.0
    while arrivals or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            now = max(now, min(a[0] for a in arrivals))
        for arrival in sorted(a for a in arrivals if a[0] <= now):
            arrivals.remove(arrival)
            _, index, prompt, output = arrival
            request = _request(f"r{index}", prompt, output, rng)
            scheduler.add_request(request)
            sent[request.request_id] = arrival[0]
        plan = scheduler.schedule(now)
        now += cost.seconds(*_composition(scheduler, plan))
        result.num_steps += 1
        for req_id, finished in _apply(scheduler, plan, now):
            if req_id not in last_token:
                result.ttft_s.append(now - sent[req_id])
                result.first_token_order.append(req_id)
            else:
                result.itl_s.append(now - last_token[req_id])
            last_token[req_id] = now
            result.num_output_tokens += 1
            if finished:
                for index, (prompt, output) in itertools.islice(specs, 1):
                    turnaround = gap_s + rng.uniform(0.0, jitter_s)
                    arrivals.append((now + turnaround, index, prompt, output))
    result.duration_s = now
    return result


def _request(req_id: str, prompt_len: int, output_len: int, rng: random.Random) -> Request:
    prompt = [rng.randrange(1, 30000) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    return Request(req_id, prompt, params, max_tokens=output_len)


def _composition(scheduler: Scheduler, plan: StepPlan) -> tuple[int, int]:
    """(decoding requests, prefill tokens) of a planned step."""
    num_decodes = num_prefill = 0
    for req_id, num_tokens in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
        request = scheduler.requests[req_id]
        if request.num_computed_tokens - num_tokens >= request.num_prompt_tokens:
            num_decodes += 1
        else:
            num_prefill += num_tokens
    return num_decodes, num_prefill


def _apply(scheduler: Scheduler, plan: StepPlan, now: float) -> list[tuple[str, bool]]:
    """The step's samples: one token for each request whose computed tokens reach its end."""
    sampled = [
        req_id
        for req_id in plan.scheduled_req_ids
        if scheduler.requests[req_id].num_computed_tokens == scheduler.requests[req_id].num_tokens
    ]
    result = StepResult(
        step_id=plan.step_id, req_ids=sampled, sampled_token_ids=[[SAMPLED_TOKEN]] * len(sampled)
    )
    deltas = scheduler.update_from_output(plan, result, now)
    return [(d.req_id, d.finish_reason is not None) for d in deltas]


def workload(name: str, num_prompts: int, seed: int = 0) -> list[tuple[int, int]]:
    """w3: 256 in x 128 out each; mixed: 32..480 in (uniform, seeded) x 128 out."""
    if name == "w3":
        return [(256, 128)] * num_prompts
    rng = random.Random(seed)
    return [(rng.randint(32, 480), 128) for _ in range(num_prompts)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["w3", "mixed"], default="w3")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--orders", nargs="+", default=["fcfs", "shortest"])
    default = CPU_SMOLLM2
    parser.add_argument("--fixed-ms", type=float, default=default.fixed_s * 1e3)
    parser.add_argument("--per-decode-ms", type=float, default=default.per_decode_s * 1e3)
    parser.add_argument(
        "--per-prefill-token-ms", type=float, default=default.per_prefill_token_s * 1e3
    )
    parser.add_argument("--gap-ms", type=float, default=5.0, help="client turnaround")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="turnaround spread")
    args = parser.parse_args(argv)
    cost = StepCostModel(
        args.fixed_ms / 1e3, args.per_decode_ms / 1e3, args.per_prefill_token_ms / 1e3
    )
    lengths = workload(args.workload, args.num_prompts)
    print("budget order | out tok/s | TTFT p50 / p99 s | ITL p50 / p99 ms")
    for budget, order in itertools.product(args.budgets, args.orders):
        config = SchedulerConfig(max_num_batched_tokens=budget, prefill_order=order)  # type: ignore[arg-type]
        s = simulate(
            config, lengths, args.concurrency, cost, args.gap_ms / 1e3, args.jitter_ms / 1e3
        ).summary()
        print(
            f"{budget} {order} | {s['out_tok_s']:.0f} | {s['ttft_p50_s']:.2f} / "
            f"{s['ttft_p99_s']:.2f} | {s['itl_p50_s'] * 1e3:.0f} / {s['itl_p99_s'] * 1e3:.0f}"
        )


if __name__ == "__main__":
    main()
