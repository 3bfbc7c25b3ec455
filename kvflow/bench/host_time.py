"""`kvflow bench host-time`: the worker's host time per decode step.

`ModelRunner.execute` of a decode step is the model's forward (with the LM head), the
sampler's kernels, and host work around them: applying the plan to the persistent batch,
building the input tensors and attention metadata, the sampling metadata, and turning
the sampled ids into a `StepResult`. This bench times `execute`, the forward and the
sampler with perf_counter (after a device sync on CUDA) and reports

    host = execute - forward - sampler

per decode step at each --batch-sizes, the median over --steps decode steps after
--warmup-steps. It drives the in-process engine step by step, so the scheduler's own
time is not counted. The probes wrap the runner's `model`, `sampler` and `execute`
attributes from outside, so the same bench measures any version of the runner.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


def add_args(parser: argparse.ArgumentParser) -> None:
    """Bench flags only; the caller adds the engine flags."""
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="decode steps measured")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument(
        "--penalties", action="store_true", help="every request uses repetition/frequency"
    )
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class HostTime:
    """Medians over the measured decode steps, in milliseconds."""

    batch_size: int
    steps: int
    execute_ms: float
    forward_ms: float
    sampler_ms: float
    host_ms: float

    @property
    def host_share(self) -> float:
        return self.host_ms / self.execute_ms

    def line(self) -> str:
        return (
            f"batch {self.batch_size:4d}: step {self.execute_ms:8.2f} ms = forward "
            f"{self.forward_ms:8.2f} + sampler {self.sampler_ms:6.2f} + host "
            f"{self.host_ms:6.2f} ms ({100 * self.host_share:4.1f}% of the step)"
        )


@dataclass
class _Clock:
    """Seconds of the current `execute` call spent in the forward and in the sampler."""

    sync: Callable[[], None]
    forward: float = 0.0
    sampler: float = 0.0
    # (execute, forward, sampler) seconds of each decode-only step
    steps: list[tuple[float, float, float]] = field(default_factory=list)

    def timed(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            setattr(self, part, getattr(self, part) + time.perf_counter() - start)
            return out

        return wrapper


class _Probe:
    """Stands in for the runner's model or sampler: times calls, forwards the rest."""

    def __init__(self, target: Any, clock: _Clock, part: str, methods: tuple[str, ...]) -> None:
        self._target = target
        self._call = clock.timed(target, part)
        self._methods = {name: clock.timed(getattr(target, name), part) for name in methods}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in self._methods:
            return self._methods[name]
        return getattr(self._target, name)


def install_probes(runner: Any) -> _Clock:
    """Wrap `runner.execute`, its model (forward + compute_logits) and its sampler."""
    import torch

    cuda = runner.device.type == "cuda"
    clock = _Clock(sync=torch.cuda.synchronize if cuda else lambda: None)
    runner.model = _Probe(runner.model, clock, "forward", ("compute_logits",))
    runner.sampler = _Probe(runner.sampler, clock, "sampler", ())
    if runner.decode_graphs is not None:
        runner.decode_graphs.run = clock.timed(runner.decode_graphs.run, "forward")
    execute = runner.execute

    def timed_execute(plan: Any) -> Any:
        clock.forward = clock.sampler = 0.0
        clock.sync()
        start = time.perf_counter()
        result = execute(plan)
        clock.sync()
        took = time.perf_counter() - start
        if plan.num_scheduled_tokens and max(plan.num_scheduled_tokens) == 1:
            clock.steps.append((took, clock.forward, clock.sampler))
        return result

    runner.execute = timed_execute
    return clock


def measure(llm: Any, clock: _Clock, batch_size: int, args: argparse.Namespace) -> HostTime:
    """Decode `batch_size` requests for warmup + steps steps; medians of the last `steps`."""
    from kvflow.bench.throughput import random_token_prompts
    from kvflow.sampling_params import SamplingParams

    engine = llm.engine
    special = list(llm.tokenizer.all_special_ids)
    prompts = random_token_prompts(
        batch_size, args.input_len, engine.vocab_size, special, args.bench_seed
    )
    params = SamplingParams(
        temperature=1.0,
        ignore_eos=True,
        max_tokens=args.warmup_steps + args.steps + 1,
        repetition_penalty=1.1 if args.penalties else 1.0,
        frequency_penalty=0.5 if args.penalties else 0.0,
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"host-time-{batch_size}-{i}", prompt, params)
    clock.steps.clear()
    while engine.has_unfinished_requests():
        engine.step()
    steps = [s for s in clock.steps[args.warmup_steps :]][: args.steps]
    execute, forward, sampler = (statistics.median(part) * 1e3 for part in zip(*steps))
    host = statistics.median((e - f - s) * 1e3 for e, f, s in steps)
    return HostTime(batch_size, len(steps), execute, forward, sampler, host)


def run(args: argparse.Namespace) -> int:
    from kvflow.cli.args import engine_options
    from kvflow.offline.llm import LLM

    options = engine_options(args)
    options.setdefault("max_num_seqs", max(args.batch_sizes))
    llm = LLM(**options)
    clock = install_probes(llm.engine.runner)
    results = [measure(llm, clock, size, args) for size in args.batch_sizes]
    if args.json:
        print(json.dumps([{**asdict(r), "host_share": r.host_share} for r in results]))
    else:
        print("\n".join(r.line() for r in results))
    return 0
