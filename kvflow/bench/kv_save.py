"""`kvflow bench kv-save`: a producer's step time for one long prompt, by how it saves.

A prefill instance (zmq connector, kv_producer) runs the step that completes a prompt
of --prompt-tokens in one forward (the token budget is raised to fit it). Three ways,
interleaved round by round on one engine so that they share the machine's state:

    none           the connector is detached: the step as a colocated engine runs it
    after_forward  every layer's blocks copied out after the forward (the old way)
    by_layer       each layer's blocks copied by the copier thread during the forward

Reported per way, median over --rounds: the step's time (StepResult.execute_time_s),
the time it waited in wait_for_save (and its share of the step), and the ratio of each
step to `none`; the save's share of the step is also given as (after_forward - none) /
after_forward, which a shared machine's noise can swamp: the wait is the precise one.
Prefix caching is off so that every round computes the whole prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
from typing import Any

MODES = ("none", "after_forward", "by_layer")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvflow import LLM
    from kvflow.cli.args import engine_options

    options = engine_options(args)
    options["kv_transfer_config"] = {
        "kv_role": "kv_producer",
        "kv_connector": "zmq",
        "kv_connector_extra_config": {"kv_port": _free_port()},
    }
    options["enable_prefix_caching"] = False
    options["max_num_batched_tokens"] = max(
        args.prompt_tokens, options.get("max_num_batched_tokens", 0)
    )
    llm = LLM(**options)
    steps = _StepTimes(llm.engine.runner)
    vocab = llm.tokenizer.vocab_size
    report_rounds: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds + 1):  # the first round warms up
        for mode in MODES:
            prompt = [
                (round_index * 7919 + i * 31) % (vocab - 1) + 1 for i in range(args.prompt_tokens)
            ]
            steps.set_mode(mode)
            llm.generate([prompt], _params())
            if round_index > 0:
                report_rounds[mode].append(steps.take_longest())
            steps.take_longest()
    llm.close()
    report = _report(args, report_rounds)
    print(json.dumps(report) if args.json else "\n".join(_lines(report)))
    return 0


def _params() -> Any:
    from kvflow import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class _StepTimes:
    """Wraps the runner's execute: records (step time, save wait) of each step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.connector = runner.kv_connector
        self.seen: list[tuple[float, float]] = []
        execute = runner.execute

        def timed(plan: Any) -> Any:
            result = execute(plan)
            save_s = result.kv_transfer.save_s if result.kv_transfer is not None else 0.0
            self.seen.append((result.execute_time_s, save_s))
            return result

        runner.execute = timed

    def set_mode(self, mode: str) -> None:
        self.runner.kv_connector = None if mode == "none" else self.connector
        self.connector.layer_by_layer = mode == "by_layer"

    def take_longest(self) -> tuple[float, float]:
        """The prompt's step: the longest of those seen since the last call."""
        longest = max(self.seen, default=(0.0, 0.0))
        self.seen = []
        return longest


def _report(
    args: argparse.Namespace, rounds: dict[str, list[tuple[float, float]]]
) -> dict[str, Any]:
    step = {mode: statistics.median(s for s, _ in rounds[mode]) for mode in MODES}
    wait = {mode: statistics.median(w for _, w in rounds[mode]) for mode in MODES}
    return {
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "num_threads": getattr(args, "num_threads", None),
        "load_average": os.getloadavg()[0],
        "step_s": step,
        "save_wait_s": wait,
        "step_vs_none": {mode: step[mode] / step["none"] for mode in MODES},
        "save_wait_share": {mode: wait[mode] / step[mode] for mode in MODES},
        "by_layer_vs_after_forward": step["by_layer"] / step["after_forward"],
        "save_share_after_forward": (step["after_forward"] - step["none"]) / step["after_forward"],
    }


def _lines(report: dict[str, Any]) -> list[str]:
    lines = [
        f"producer step, {report['prompt_tokens']}-token prompt, median of {report['rounds']} "
        f"rounds (load average {report['load_average']:.2f}):"
    ]
    for mode in MODES:
        lines.append(
            f"  {mode:>13}: step {report['step_s'][mode] * 1e3:8.1f} ms "
            f"(x{report['step_vs_none'][mode]:.3f} of none), "
            f"waiting for the save {report['save_wait_s'][mode] * 1e3:6.1f} ms "
            f"({report['save_wait_share'][mode]:.2%} of the step)"
        )
    lines.append(f"  by_layer / after_forward: {report['by_layer_vs_after_forward']:.3f}")
    lines.append(
        f"  the save's share of the step (after_forward): {report['save_share_after_forward']:.1%}"
    )
    return lines


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
