"""`kvflow bench routing`: what data-parallel routing costs the frontend per request.

For each `--load-balance` policy, a shared-prefix stream of token-id prompts (like
`bench serve --dataset-name prefix_repetition`) goes through two levels, timed per
request with `perf_counter_ns`:

- `router`: the sans-IO policy core alone, `Router.route` (prefix-aware includes the
  block-hash chain of the whole prompt, the dominant cost for long prompts);
- `client`: `EngineClient`'s routing step as a served request runs it (per-engine
  health, availability, `Router.route`, the routing metrics listener), on a client
  whose engines are fed `SchedulerStats` in memory instead of over sockets.

Load stats arrive every `--stats-every` requests with pseudo-random waiting/running
counts, so least-load and the prefix-aware overload check see changing scores.
Requests are issued back to back; at R req/s the routing step takes `mean_us * R / 1e6`
of one core (`core_share_at_1k_rps` reports it for R = 1,000).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import cast, get_args

import numpy as np

from kvflow.config import LoadBalance
from kvflow.proto.stats import SchedulerStats
from kvflow.routing import Router, RoutingConfig

LEVELS = ("router", "client", "e2e")
HITS = "kvflow:router_prefix_hits_total"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=",".join(get_args(LoadBalance)))
    parser.add_argument("--levels", default=",".join(LEVELS), help="of router,client,e2e")
    parser.add_argument("--num-engines", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=5000)
    parser.add_argument("--prefix-len", type=int, default=512, help="shared tokens")
    parser.add_argument("--suffix-len", type=int, default=512, help="tokens of each request")
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--stats-every", type=int, default=20, help="requests between stats")
    parser.add_argument("--rate", type=float, default=1000.0, help="e2e: requests per second")
    parser.add_argument("--e2e-requests", type=int, default=3000, help="e2e: per policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class RoutingTiming:
    policy: str
    level: str
    num_engines: int
    requests: int
    mean_us: float
    p50_us: float
    p99_us: float
    prefix_hit_rate: float | None  # decisions a known prefix made (None: not counted)
    engine_share: list[float] | None  # fraction of requests per engine
    added_p50_us: float | None = None  # e2e: over the DP=1 baseline of the same run
    added_p99_us: float | None = None

    @property
    def core_share_at_1k_rps(self) -> float:
        return self.mean_us * 1000 / 1e6


def shared_prefix_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    vocab = 32000
    prefixes = rng.integers(0, vocab, (args.num_prefixes, args.prefix_len)).tolist()
    suffixes = rng.integers(0, vocab, (args.num_requests, args.suffix_len)).tolist()
    picks = rng.integers(0, args.num_prefixes, args.num_requests).tolist()
    return [prefixes[p] + s for p, s in zip(picks, suffixes, strict=True)]


def _stats_feed(args: argparse.Namespace) -> Callable[[int], list[tuple[int, int, int]]]:
    """(engine, waiting, running) updates due before request `i`."""
    rng = np.random.default_rng(args.seed + 1)

    def due(i: int) -> list[tuple[int, int, int]]:
        if i % args.stats_every:
            return []
        counts = rng.integers(0, 8, (args.num_engines, 2)).tolist()
        return [(e, int(w), int(r)) for e, (w, r) in enumerate(counts)]

    return due


def time_router(
    policy: LoadBalance, prompts: list[list[int]], args: argparse.Namespace
) -> RoutingTiming:
    router = Router(RoutingConfig(policy=policy, block_size=args.block_size), args.num_engines)
    due = _stats_feed(args)
    times: list[int] = []
    engines: list[int] = []
    hits = 0
    for i, prompt in enumerate(prompts):
        for engine, waiting, running in due(i):
            router.observe_load(engine, waiting, running)
        start = time.perf_counter_ns()
        decision = router.route(prompt)
        times.append(time.perf_counter_ns() - start)
        engines.append(decision.engine)
        hits += decision.prefix_hit
    return _timing(policy, "router", args.num_engines, times, engines, hits)


def time_client(
    policy: LoadBalance, prompts: list[list[int]], args: argparse.Namespace
) -> RoutingTiming:
    # Imported here: the frontend pulls in zmq and prometheus, `router` needs neither.
    from prometheus_client import CollectorRegistry

    from kvflow.proto.addresses import ServiceAddresses
    from kvflow.services.frontend.engine_client import EngineClient
    from kvflow.services.frontend.routing_metrics import RoutingMetrics

    with TemporaryDirectory() as tmp:
        addresses = [
            ServiceAddresses.ipc(str(Path(tmp) / f"e{i}")) for i in range(args.num_engines)
        ]
        routing = RoutingConfig(policy=policy, block_size=args.block_size)
        client = EngineClient(addresses, "bench-routing", routing=routing)
        registry = CollectorRegistry()
        metrics = RoutingMetrics(registry, "bench", args.num_engines)
        client.add_route_listener(metrics.observe)
        due = _stats_feed(args)
        times: list[int] = []
        engines: list[int] = []
        for i, prompt in enumerate(prompts):
            for engine, waiting, running in due(i):
                stats = SchedulerStats(time.time(), str(engine), running, waiting, 0.0)
                client._handle(stats, engine)  # what the read loop does with a stats message
            start = time.perf_counter_ns()
            engine = client._route(prompt, None, None)
            times.append(time.perf_counter_ns() - start)
            engines.append(engine)
        hits = sum(
            int(registry.get_sample_value(HITS, {"model_name": "bench", "engine": str(e)}) or 0)
            for e in range(args.num_engines)
        )
    return _timing(policy, "client", args.num_engines, times, engines, hits)


def _timing(
    policy: str, level: str, num_engines: int, times_ns: list[int], engines: list[int], hits: int
) -> RoutingTiming:
    us = np.asarray(times_ns, dtype=np.float64) / 1e3
    counts = np.bincount(np.asarray(engines), minlength=num_engines)
    return RoutingTiming(
        policy=policy,
        level=level,
        num_engines=num_engines,
        requests=len(times_ns),
        mean_us=round(float(us.mean()), 2),
        p50_us=round(float(np.percentile(us, 50)), 2),
        p99_us=round(float(np.percentile(us, 99)), 2),
        prefix_hit_rate=round(hits / len(times_ns), 3),
        engine_share=[round(float(c) / len(times_ns), 3) for c in counts],
    )


def time_e2e_levels(
    policies: list[LoadBalance], prompts: list[list[int]], args: argparse.Namespace
) -> list[RoutingTiming]:
    from kvflow.bench.routing_e2e import percentiles_us, time_e2e

    def timing(
        policy: LoadBalance, engines: int, base: tuple[float, float, float] | None
    ) -> RoutingTiming:
        times = time_e2e(policy, engines, prompts, args.rate, args.block_size)
        mean, p50, p99 = percentiles_us(times)
        added = (p50 - base[1], p99 - base[2]) if base else (None, None)
        return RoutingTiming(
            policy,
            "e2e",
            engines,
            len(times),
            round(mean, 2),
            round(p50, 2),
            round(p99, 2),
            None,
            None,
            *(None if a is None else round(a, 2) for a in added),
        )

    baseline = timing("round-robin", 1, None)  # one engine: no routing decision at all
    baseline.policy = "dp=1"
    base = (baseline.mean_us, baseline.p50_us, baseline.p99_us)
    return [baseline, *(timing(p, args.num_engines, base) for p in policies)]


def run(args: argparse.Namespace) -> int:
    policies = cast(list[LoadBalance], [p for p in args.policies.split(",") if p])
    levels = [level for level in args.levels.split(",") if level]
    unknown = set(policies) - set(get_args(LoadBalance)) | set(levels) - set(LEVELS)
    if unknown:
        raise SystemExit(f"kvflow bench routing: unknown {sorted(unknown)}")
    prompts = shared_prefix_prompts(args)
    timers = {"router": time_router, "client": time_client}
    results = [
        timers[level](policy, prompts, args)
        for level in levels
        if level != "e2e"
        for policy in policies
    ]
    if "e2e" in levels:
        results += time_e2e_levels(policies, prompts[: args.e2e_requests], args)
    if args.json:
        print(
            json.dumps(
                [asdict(r) | {"core_share_at_1k_rps": r.core_share_at_1k_rps} for r in results]
            )
        )
        return 0
    print(f"{'level':<7} {'policy':<13} {'mean us':>8} {'p50 us':>8} {'p99 us':>8}  extra")
    for r in results:
        if r.level == "e2e":
            extra = f"engines={r.num_engines} added p50/p99 us={r.added_p50_us}/{r.added_p99_us}"
        else:
            extra = f"hit={r.prefix_hit_rate} share={r.engine_share}"
        print(
            f"{r.level:<7} {r.policy:<13} {r.mean_us:>8.1f} {r.p50_us:>8.1f} {r.p99_us:>8.1f}"
            f"  {extra}"
        )
    return 0
