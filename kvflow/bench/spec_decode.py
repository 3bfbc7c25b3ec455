"""`kvflow bench spec-decode`: single-stream output tok/s with and without speculative
decoding, in one run, on a committed copy-heavy dataset (data/spec_decode_copy.json:
code edits and quote-then-extend prompts) or on random prompts (nothing to copy).

Each configuration has its own engine, warmed up with one request and with one
verification of every size (2 .. k + 1 rows), so that no decode graph is recorded
while timing; every prompt runs alone (batch 1, greedy) through each configuration in
turn, the order rotating, so a shared machine's load changes hit every configuration
alike (ratios in one run). Reported per configuration: output tok/s end to end and in
the decode phase (the tokens after each request's first, over the time after it:
speculation speeds up decoding, not the prefill), each as a ratio to no speculation,
the acceptance rate (accepted / drafted tokens) and the mean acceptance length (1 +
accepted / drafts: tokens per verification step).

`--measure-cost` times the other side of the trade: every step drafts k tokens that are
(almost surely) rejected, so tok/s against no speculation gives c(k), the cost of a
verification step relative to a plain decode step (in the decode phases). Speculation
pays when the expected tokens per step beat it: 1 + a * k > c(k) for acceptance rate a,
i.e. a > (c(k) - 1) / k, the break-even rate the `min_acceptance_rate` off-switch is set
from (docs/benchmarks.md).

A draft model's cost includes its k forwards per step, and its drafts cannot be forced
to fail, so `--measure-cost --methods draft_model` keeps its own drafts (on the random
prompts, off-switch disabled) and uses that every step verifies: single stream,
speed-up = tokens per step / c(k), so c(k) = mean acceptance length / speed-up, whatever
the acceptance. `step_cost` (c(k)) and `break_even` ((c(k) - 1) / k) are reported for
every `--measure-cost` run.

`--methods draft_model --draft-layers N` drafts with the target's first N layers (a
self-speculative draft, truncated_draft.py, written once into the cache directory);
`--speculative-config` names any other draft model. With `--shape`/`--config` (random
weights), `--draft-shape NAME` drafts with a preset's shape given the target's
vocabulary, random weights too.

`--forced-acceptance` measures what a draft that is always right buys: random weights
agree on nothing, so both models' final norm is set to zero after loading. Every logit
is then 0, greedy decoding picks token 0 in the target and in the draft alike, and
every draft is accepted, while each step does exactly the work it would do with real
weights (a multiply-add costs the same whatever the values). The mean acceptance length
is k + 1, and `step_cost` is a whole speculative step (k draft forwards and the k + 1-row
verification) relative to a plain decode step; `--measure-cost` gives the verification
alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvflow.bench.shapes import SHAPES, add_shape_args, apply_shape_args

DATASET = "spec_decode_copy.json"
_REQUEST_IDS = itertools.count()


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=["copy", "random"], default="copy")
    parser.add_argument("--methods", default="ngram,suffix", help="comma-separated methods")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-random-prompts", type=int, default=4)
    parser.add_argument("--measure-cost", action="store_true", help="time rejected drafts")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    parser.add_argument(
        "--draft-layers", type=int, default=4, help="draft_model: the target's first N layers"
    )
    parser.add_argument(
        "--draft-shape", choices=sorted(SHAPES), default=None,
        help="draft_model: a preset shape with the target's vocabulary, random weights "
        "(needs --shape/--config)",
    )  # fmt: skip
    parser.add_argument(
        "--forced-acceptance", action="store_true",
        help="zero both models' final norm: every draft is accepted (see the module docstring)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_shape_args(parser)  # --shape NAME / --config DIR: real-size shapes, random weights


@dataclass
class SpecResult:
    name: str
    k: int
    every_step_drafts: bool  # then tokens per step / speed-up is the step's cost
    output_tokens: int
    elapsed_s: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    requests: int = 0
    first_token_s: float = 0.0  # summed over the requests: their prefill

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def decode_tokens_per_s(self) -> float:
        """The tokens after each request's first over the time after it: the decode
        phase, which speculation speeds up, without the prefill, which it does not."""
        return (self.output_tokens - self.requests) / (self.elapsed_s - self.first_token_s)

    def summary(self, baseline: SpecResult) -> dict[str, Any]:
        drafted = max(self.draft_tokens, 1)
        speedup = self.tokens_per_s / baseline.tokens_per_s
        decode_speedup = self.decode_tokens_per_s / baseline.decode_tokens_per_s
        mean_length = 1 + self.accepted_tokens / max(self.drafts, 1)
        summary = {
            **asdict(self),
            "output_tokens_per_s": round(self.tokens_per_s, 2),
            "speedup": round(speedup, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "decode_speedup": round(decode_speedup, 3),
            "acceptance_rate": round(self.accepted_tokens / drafted, 3),
            "mean_acceptance_length": round(mean_length, 3),
        }
        if self.every_step_drafts and self.drafts:
            # A verification step's time / a plain step's, from the decode phases alone
            # (the prefill costs both the same).
            cost = mean_length / decode_speedup
            summary["step_cost"] = round(cost, 3)
            summary["break_even"] = round((cost - 1) / self.k, 3)
        return summary


class _AlwaysPropose:
    """Drafts k copies of a token that is never the model's choice in practice; with
    `cycle`, 1, 2, ..., k of them in turn (every verification size once per k steps)."""

    def __init__(self, cycle: bool = False) -> None:
        self.cycle = cycle
        self.calls = 0

    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt: int, k: int) -> list[int]:
        self.calls += 1
        count = 1 + (self.calls - 1) % k if self.cycle else k
        return [(token_ids[-1] + 7919) % 49152] * count

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt: int) -> None:
        pass


def _prompts(llm: Any, args: argparse.Namespace) -> list[Any]:
    if args.dataset == "copy" and not args.measure_cost:
        from kvflow.tokenizer import apply_chat_template

        text = resources.files("kvflow.bench").joinpath("data", DATASET).read_text()
        entries = json.loads(text)["prompts"]
        return [apply_chat_template(llm.tokenizer, e["messages"], True) for e in entries]
    return _random_prompts(llm, args.num_random_prompts)


def _random_prompts(llm: Any, count: int) -> list[Any]:
    from kvflow.bench.throughput import random_token_prompts

    special = list(llm.tokenizer.all_special_ids)
    return random_token_prompts(count, 64, llm.engine.vocab_size, special, 0)


@dataclass
class _Config:
    name: str
    spec: dict[str, Any] | None
    llm: Any
    result: SpecResult


def _load(name: str, spec: dict[str, Any] | None, args: argparse.Namespace) -> _Config:
    from kvflow.cli.args import engine_options
    from kvflow.offline.llm import LLM
    from kvflow.sampling_params import SamplingParams

    options = engine_options(args)
    options["speculative_config"] = spec
    llm = LLM(**options)
    speculator = llm.engine.scheduler.speculator
    worker_drafts = spec is not None and spec["method"] == "draft_model"
    if args.measure_cost and speculator is not None and not worker_drafts:
        speculator.proposer = _AlwaysPropose()
    if args.forced_acceptance and spec is not None:
        _zero_final_norms(llm)
    k = 0 if spec is None else int(spec["num_speculative_tokens"])
    warm_up = _prompts(llm, args)[:1]
    llm.generate(warm_up, SamplingParams(max_tokens=8, temperature=0.0))
    if speculator is not None and not worker_drafts and not args.measure_cost:
        _warm_up_verification_sizes(llm, speculator, k)
    every_step = bool(args.measure_cost or args.forced_acceptance)
    return _Config(name, spec, llm, SpecResult(name, k, every_step, 0, 0.0))


def _warm_up_verification_sizes(llm: Any, speculator: Any, k: int) -> None:
    """Run one verification of every size (2 .. k + 1 rows) before the timed prompts:
    a decode graph is recorded the first time its size runs (cpu_graphs.py), and the
    real proposer's drafts would reach the sizes at random points of the timed run.
    The proposer is swapped out meanwhile, so its caches see none of it."""
    from kvflow.sampling_params import SamplingParams

    proposer, speculator.proposer = speculator.proposer, _AlwaysPropose(cycle=True)
    try:
        prompt = _random_prompts(llm, 1)[0]
        params = SamplingParams(max_tokens=2 * k + 2, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], params)
    finally:
        speculator.proposer = proposer


def _zero_final_norms(llm: Any) -> None:
    """The target's and the draft's final norm weights set to 0: all logits 0, so greedy
    picks token 0 in both (the engine must run the model in this process)."""
    runner = getattr(llm.engine.executor, "runner", None)
    if runner is None:
        raise SystemExit("--forced-acceptance needs the model in this process (no TP/PP)")
    models = [runner.model] + ([runner.drafter.model] if runner.drafter is not None else [])
    for model in models:
        model.model.norm.weight.data.zero_()


def _run_all(configs: list[_Config], args: argparse.Namespace) -> list[SpecResult]:
    """Every prompt alone, `--rounds` times, through every configuration in turn (the
    order rotating), so that a load change on a shared machine hits them all alike."""
    from kvflow.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = _prompts(configs[0].llm, args) * args.rounds
    before = [_counters(c.llm) for c in configs]
    for index, prompt in enumerate(prompts):
        for turn in range(len(configs)):
            config = configs[(index + turn) % len(configs)]
            tokens, first_token_s, elapsed_s = _timed_request(config.llm, prompt, params)
            config.result.elapsed_s += elapsed_s
            config.result.output_tokens += tokens
            config.result.first_token_s += first_token_s
            config.result.requests += 1
    for config, counts in zip(configs, before):
        after = _counters(config.llm)
        drafts, drafted, accepted = (a - b for a, b in zip(after, counts))
        config.result.drafts, config.result.draft_tokens = drafts, drafted
        config.result.accepted_tokens = accepted
    return [c.result for c in configs]


def _timed_request(llm: Any, prompt: Any, params: Any) -> tuple[int, float, float]:
    """One request alone: (output tokens, seconds to its first token, seconds in all).
    Drives the engine as LLM.generate does, watching for the first token."""
    request_id = f"spec-bench-{next(_REQUEST_IDS)}"
    start = time.perf_counter()
    first_token_s = 0.0
    llm.engine.add_request(request_id, prompt, params)
    output = None
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if not first_token_s and output.token_ids:
                first_token_s = time.perf_counter() - start
    assert output is not None and output.finished
    return len(output.token_ids), first_token_s, time.perf_counter() - start


def _counters(llm: Any) -> tuple[int, int, int]:
    speculator = llm.engine.scheduler.speculator
    if speculator is None:
        return (0, 0, 0)
    c = speculator.counters
    return (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)


def _configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any] | None]]:
    user = getattr(args, "speculative_config", None)
    if user is not None:
        return [("none", None), (user.method, json.loads(user.to_json()))]
    k = args.num_speculative_tokens
    configs: list[tuple[str, dict[str, Any] | None]] = [("none", None)]
    for method in args.methods.split(","):
        spec: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
        if method == "draft_model":
            spec["model"] = str(_draft_dir(args))
        if args.measure_cost:
            spec["min_acceptance_rate"] = 0.0  # keep drafting: the cost is what is measured
        configs.append((method, spec))
    return configs


def _draft_dir(args: argparse.Namespace) -> Path:
    """--draft-shape's directory (the target's vocabulary), else the truncated target."""
    if args.draft_shape is None:
        return _truncated_draft(args)
    from kvflow.bench.shapes import write_shape_dir
    from kvflow.gpu_worker.model_loader import load_hf_config

    if getattr(args, "load_format", "auto") != "dummy":
        raise SystemExit("--draft-shape drafts with random weights: give --shape or --config")
    vocab = int(load_hf_config(Path(args.model)).vocab_size)
    return write_shape_dir(args.draft_shape, vocab_size=vocab)


def _truncated_draft(args: argparse.Namespace) -> Path:
    from kvflow.bench.truncated_draft import truncated_copy
    from kvflow.cache_dir import default_cache_dir
    from kvflow.gpu_worker.model_files import resolve_model_dir

    target = resolve_model_dir(getattr(args, "model", None))
    dst = default_cache_dir() / "models" / f"{target.name}-first{args.draft_layers}"
    return truncated_copy(target, dst, args.draft_layers)


def run(args: argparse.Namespace) -> int:
    apply_shape_args(args)
    drafts_by_model = args.methods == "draft_model" and not args.measure_cost
    if (args.forced_acceptance or args.draft_shape) and not drafts_by_model:
        raise SystemExit(
            "--forced-acceptance and --draft-shape need --methods draft_model alone (a draft "
            "model's drafts; not with --measure-cost)"
        )
    if args.measure_cost:
        args.methods = args.methods.split(",")[0]
    results = _run_all([_load(name, spec, args) for name, spec in _configs(args)], args)
    summaries = [r.summary(results[0]) for r in results]
    if args.json:
        print(json.dumps({"dataset": args.dataset, "results": summaries}))
        return 0
    print(f"dataset: {args.dataset}" + (" (every draft rejected)" if args.measure_cost else ""))
    header = f"{'config':<12} {'tok/s':>8} {'x none':>7} {'decode tok/s':>13} {'x none':>7}"
    print(header + f" {'accept':>7} {'mean len':>9} {'step cost':>10} {'break-even':>11}")
    for s in summaries:
        cost = f"{s['step_cost']:>10.3f} {s['break_even']:>11.3f}" if "step_cost" in s else ""
        print(
            f"{s['name']:<12} {s['output_tokens_per_s']:>8.2f} {s['speedup']:>7.3f} "
            f"{s['decode_tokens_per_s']:>13.2f} {s['decode_speedup']:>7.3f} "
            f"{s['acceptance_rate']:>7.3f} {s['mean_acceptance_length']:>9.3f} {cost}"
        )
    return 0
