"""`kvflow bench disagg`: decode ITL under long prompts, colocated vs 1 prefill + 1 decode.

One command runs the same mixed load (mixed_load.py) against two set-ups of the same
model on this machine, one after the other, on 127.0.0.1 free ports:

    colocated      kvflow serve --num-threads N                  pinned to cores c[0:N]
    disaggregated  kvflow serve --num-threads N-N/2 (kv_producer) pinned to c[0:N-N/2]
                   kvflow serve --num-threads N/2   (kv_consumer) pinned to c[N-N/2:N]
                   kvflow proxy (zmq connector: the consumer pulls from the producer)

so both use N cores for their compute (c = the cores this process may run on; with
fewer than N of them, or --no-pin, nothing is pinned). The proxy and this client are
not pinned. Each set-up gets one short and one long warm-up request first. Reported
per set-up: the short requests' ITL p50/p99/max and TTFT p50/p99, the long prompts' TTFT
p50/max (ms), and the load average around the run (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvflow.bench import instances, mixed_load
from kvflow.bench.datasets import TokenSpace
from kvflow.bench.instances import Instance
from kvflow.bench.mixed_load import MixedLoad
from kvflow.errors import ConfigError
from kvflow.runtime.cluster_args import ensure_local_secret


def add_args(parser: argparse.ArgumentParser) -> None:
    """Load flags; the caller adds the engine flags (passed on to every `kvflow serve`)."""
    default = MixedLoad()
    parser.add_argument(
        "--duration", type=float, default=default.duration_s, help="seconds of arrivals"
    )
    parser.add_argument(
        "--short-rate", type=float, default=default.short_rate, help="short requests/s"
    )
    parser.add_argument("--short-prompt", type=int, default=default.short_prompt)
    parser.add_argument("--short-output", type=int, default=default.short_output)
    parser.add_argument("--long-every", type=float, default=default.long_every_s, help="seconds")
    parser.add_argument("--long-prompt", type=int, default=default.long_prompt)
    parser.add_argument("--long-output", type=int, default=default.long_output)
    parser.add_argument("--load-seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument(
        "--colocated-threads",
        type=int,
        default=None,
        help="threads of the colocated instance (default --num-threads): a control run",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin instances to cores")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds per instance")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvflow.bench.startup import serve_flags
    from kvflow.cli.args import engine_options

    ensure_local_secret()  # the instances and the proxy run on this host, over zmq
    options = engine_options(args)
    if "kv_transfer_config" in options:
        raise ConfigError("kvflow bench disagg sets --kv-transfer-config itself")
    num_threads = options.pop("num_threads", None) or len(os.sched_getaffinity(0))
    if num_threads < 2:
        raise ConfigError("kvflow bench disagg splits --num-threads between 2 instances: give >= 2")
    load = MixedLoad(
        args.duration, args.short_rate, args.short_prompt, args.short_output,
        args.long_every, args.long_prompt, args.long_output, args.load_seed,
    )  # fmt: skip
    split = core_split(num_threads, sorted(os.sched_getaffinity(0)), pin=not args.no_pin)
    if args.colocated_threads is not None:  # e.g. 1 on a loaded machine: see docs/benchmarks.md
        split["num_threads"]["colocated"] = args.colocated_threads
        if split["cpus"]["colocated"] is not None:
            split["cpus"]["colocated"] = split["cpus"]["colocated"][: args.colocated_threads]
    report = measure(serve_flags(options), load, split, args.start_timeout)
    print(json.dumps(report) if args.json else "\n".join(report_lines(report)))
    return 0


def core_split(num_threads: int, cpus: list[int], pin: bool) -> dict[str, Any]:
    """Threads and cores of each instance: the prefill side gets the odd one out."""
    prefill = num_threads - num_threads // 2
    pinned = pin and len(cpus) >= num_threads
    return {
        "num_threads": {"colocated": num_threads, "prefill": prefill, "decode": num_threads // 2},
        "cpus": {
            "colocated": cpus[:num_threads] if pinned else None,
            "prefill": cpus[:prefill] if pinned else None,
            "decode": cpus[prefill:num_threads] if pinned else None,
        },
    }


def measure(
    flags: list[str], load: MixedLoad, split: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    threads, cpus = split["num_threads"], split["cpus"]
    report: dict[str, Any] = {"load": dataclasses.asdict(load), "split": split}
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-disagg-") as tmp:
        logs = Path(tmp)

        def colocated() -> list[Instance]:
            serve = ["serve", *flags, "--num-threads", str(threads["colocated"])]
            return [
                _started(instances.launch("colocated", serve, logs, cpus["colocated"]), timeout_s)
            ]

        def disaggregated() -> list[Instance]:
            return _start_pd(flags, threads, cpus, logs, timeout_s)

        report["colocated"] = _phase(colocated, load)
        report["disaggregated"] = _phase(disaggregated, load)
    return report


def _start_pd(
    flags: list[str], threads: dict[str, int], cpus: dict[str, Any], logs: Path, timeout_s: float
) -> list[Instance]:
    kv_port = instances.free_port()
    started: list[Instance] = []
    try:
        for role, kv in (("prefill", {"kv_port": kv_port}), ("decode", {})):
            config = {
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_connector": "zmq",
                "kv_connector_extra_config": kv,
            }
            serve = ["serve", *flags, "--num-threads", str(threads[role])]
            serve += ["--kv-transfer-config", json.dumps(config)]
            started.append(instances.launch(role, serve, logs, cpus[role]))
        for instance in started:
            instances.wait_healthy(instance, timeout_s)
        proxy = ["proxy", "--prefill", started[0].base_url, "--decode", started[1].base_url]
        proxy += ["--prefill-kv-address", f"tcp://127.0.0.1:{kv_port}"]
        started.append(_started(instances.launch("proxy", proxy, logs, None), timeout_s))
    except BaseException:
        for instance in started:
            instances.stop(instance)
        raise
    return [started[2], *started[:2]]  # the front first


def _started(instance: Instance, timeout_s: float) -> Instance:
    try:
        instances.wait_healthy(instance, timeout_s)
    except BaseException:
        instances.stop(instance)
        raise
    return instance


def _phase(start: Callable[[], list[Instance]], load: MixedLoad) -> dict[str, Any]:
    """Start a set-up (its front first), warm it up, run the load, stop it."""
    started = start()
    try:
        base_url = started[0].base_url
        model, tokens = _model_and_tokens(started[-1].base_url)  # an engine: the proxy has no root
        warm = MixedLoad(
            1.0, 1.0, load.short_prompt, 2, 1.0, load.long_prompt, 1, seed=load.seed + 1
        )
        asyncio.run(mixed_load.run_load(base_url, model, warm, tokens))
        before = os.getloadavg()[0]
        outputs = asyncio.run(mixed_load.run_load(base_url, model, load, tokens))
        summary = mixed_load.summarize(outputs)
        summary["load_average"] = {
            "before": round(before, 2),
            "after": round(os.getloadavg()[0], 2),
        }
        return summary
    finally:
        for instance in started:
            instances.stop(instance)


def _model_and_tokens(engine_url: str) -> tuple[str, TokenSpace]:
    from kvflow.bench.serve import load_bench_tokenizer

    card = httpx.get(engine_url + "/v1/models", timeout=30.0).json()["data"][0]
    tokenizer = load_bench_tokenizer(str(card.get("root") or card["id"]))
    return str(card["id"]), TokenSpace(int(tokenizer.vocab_size), list(tokenizer.all_special_ids))


def report_lines(report: dict[str, Any]) -> list[str]:
    load, split = report["load"], report["split"]
    lines = [
        f"mixed load: {load['short_rate']} short req/s ({load['short_prompt']} in, "
        f"{load['short_output']} out) + a {load['long_prompt']}-token prompt every "
        f"{load['long_every_s']} s, {load['duration_s']} s; threads {split['num_threads']}, "
        f"cores {split['cpus']}",
        f"{'':>14} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'long TTFT p50':>14} {'max':>9}  load avg   failed",
    ]
    for name in ("colocated", "disaggregated"):
        r = report[name]
        itl, ttft, long = r["short_itl_ms"], r["short_ttft_ms"], r["long_ttft_ms"]
        cells = [itl["p50"], itl["p99"], itl["max"], ttft["p50"], ttft["p99"]]
        avg = r["load_average"]
        lines.append(
            f"{name:>14} " + " ".join(_ms(c, 9) for c in cells)
            + f" {_ms(long['p50'], 14)} {_ms(long['max'], 9)}  {avg['before']:.1f}->{avg['after']:.1f}"
            + f"   {r['failed_requests']}"
        )  # fmt: skip
    return lines


def _ms(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"
