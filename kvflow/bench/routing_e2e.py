"""`kvflow bench routing --levels e2e`: a request's round trip through the frontend's
`EngineClient` over real ZeroMQ sockets, against fake engines, at a paced request rate.

    EngineClient.generate ─▶ PUSH AddRequest ─▶ fake engine (own process) ─▶ ROUTER delta ─┐
          ▲ (route, send, await)                                                          │
          └───────────────────────────── finished delta ◀─────────────────────────────────┘

Each fake engine binds what a scheduler and its detokenizer bind (scheduler_input PULL,
stats PUB, frontend_output ROUTER) and answers every AddRequest at once with one
finished delta, and publishes stats every 50 ms, so the time measured is the frontend's
own path (routing, msgspec, zmq, asyncio) plus the fake's echo. DP=1 (no routing
decision: the router's single-engine shortcut) is the baseline the report subtracts:
what DP=N with a policy adds is its median/p99 minus the DP=1 one on the same run.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Sequence
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np

from kvflow.config import LoadBalance
from kvflow.proto.addresses import ServiceAddresses
from kvflow.sampling_params import SamplingParams

STATS_PERIOD_S = 0.05
READY_TIMEOUT_S = 30.0  # spawned fakes import kvflow on a loaded machine


def fake_engine(addresses: ServiceAddresses, index: int, stop: object) -> None:
    """Scheduler + detokenizer stand-in (a process): echo one finished delta per request."""
    import zmq

    from kvflow.proto.engine import AbortRequests, AddRequest
    from kvflow.proto.frontend import FrontendOutputs, RequestOutputDelta
    from kvflow.proto.stats import SchedulerStats
    from kvflow.runtime.sockets import TypedSocket

    assert hasattr(stop, "is_set")
    context = zmq.Context()
    kind = AddRequest | AbortRequests
    pull = TypedSocket.open(context, zmq.PULL, addresses.scheduler_input, bind=True, recv_type=kind)
    out = TypedSocket.open(context, zmq.ROUTER, addresses.frontend_output, bind=True)
    pub = TypedSocket.open(context, zmq.PUB, addresses.stats, bind=True)
    next_stats, incarnation = 0.0, f"fake-{index}"
    while not stop.is_set():
        message = pull.recv(timeout_ms=10)
        if isinstance(message, AddRequest):
            delta = RequestOutputDelta(message.req_id, "x", [1], finish_reason="length")
            out.send(FrontendOutputs([delta]), to=message.frontend_id.encode())
        if time.monotonic() >= next_stats:
            next_stats = time.monotonic() + STATS_PERIOD_S
            stats = SchedulerStats(time.time(), str(index), 0, 0, 0.0, incarnation=incarnation)
            pub.send(stats)
    for sock in (pull, out, pub):
        sock.close()
    context.term()


async def _round_trips(
    addresses: list[ServiceAddresses],
    policy: LoadBalance,
    prompts: Sequence[list[int]],
    rate: float,
    block_size: int,
) -> list[int]:
    from kvflow.routing import RoutingConfig
    from kvflow.services.frontend.engine_client import EngineClient

    routing = RoutingConfig(policy=policy, block_size=block_size)
    client = EngineClient(addresses, "bench-e2e", routing=routing)
    await client.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not client.is_healthy or client.is_degraded:  # every engine's first stats
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake engines not ready in {READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.01)
        params = SamplingParams(max_tokens=1)
        times: list[int] = []

        async def one(i: int, prompt: list[int]) -> None:
            start = time.perf_counter_ns()
            async for _ in client.generate(f"r{i}", prompt, params):
                pass
            times.append(time.perf_counter_ns() - start)

        tasks, t0 = [], time.monotonic()
        for i, prompt in enumerate(prompts):  # open loop: paced, not waiting for answers
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(i, prompt)))
        await asyncio.gather(*tasks)
        return times
    finally:
        await client.close()


def time_e2e(
    policy: LoadBalance,
    num_engines: int,
    prompts: Sequence[list[int]],
    rate: float,
    block_size: int,
) -> list[int]:
    """Round-trip nanoseconds of each request through a fresh client and fresh fakes."""
    ctx = multiprocessing.get_context("spawn")  # no forked zmq context in the children
    stop = ctx.Event()
    with TemporaryDirectory() as tmp:
        folders = [Path(tmp) / f"e{i}" for i in range(num_engines)]
        for folder in folders:
            folder.mkdir()
        addresses = [ServiceAddresses.ipc(str(folder)) for folder in folders]
        fakes = [
            ctx.Process(target=fake_engine, args=(a, i, stop), daemon=True)
            for i, a in enumerate(addresses)
        ]
        for fake in fakes:
            fake.start()
        try:
            return asyncio.run(_round_trips(addresses, policy, prompts, rate, block_size))
        finally:
            stop.set()
            for fake in fakes:
                fake.join(5)
                if fake.is_alive():
                    fake.kill()


def percentiles_us(times_ns: Sequence[int]) -> tuple[float, float, float]:
    us = np.asarray(times_ns, dtype=np.float64) / 1e3
    return float(us.mean()), float(np.percentile(us, 50)), float(np.percentile(us, 99))
