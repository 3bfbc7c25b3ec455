"""The mixed load of `kvflow bench disagg`: short decode-heavy streams plus long prompts.

    short:  a request every 1/short_rate s, `short_prompt` tokens in, `short_output`
            tokens out (ignore_eos: every one streams its full length)
    long:   a `long_prompt`-token request every `long_every` s (the first at half that),
            `long_output` tokens out

over `duration` seconds of arrivals (open loop: an arrival never waits for an answer),
then every request is awaited. Prompts are seeded random token ids, each request its
own, so that no prefix cache turns a long prefill into a hit. What the run measures:
the short requests' inter-token latencies (all gaps pooled) and TTFT, and the long
prompts' TTFT: a long prefill that shares steps with the decodes shows up in the
short requests' ITL tail.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.bench import request_client
from kvflow.bench.datasets import SampleRequest, TokenSpace
from kvflow.bench.request_client import RequestOutput
from kvflow.bench.throughput import random_token_prompts


@dataclass(frozen=True)
class MixedLoad:
    duration_s: float = 30.0
    short_rate: float = 2.0  # requests per second
    short_prompt: int = 32
    short_output: int = 64
    long_every_s: float = 5.0
    long_prompt: int = 2000
    long_output: int = 4
    seed: int = 0

    def schedule(self, tokens: TokenSpace) -> list[tuple[float, str, SampleRequest]]:
        """(seconds after the start, "short" | "long", request), in arrival order."""
        num_short = max(1, int(self.duration_s * self.short_rate))
        num_long = max(1, int(self.duration_s / self.long_every_s))
        shorts = self._requests(num_short, self.short_prompt, self.short_output, tokens, 0)
        longs = self._requests(num_long, self.long_prompt, self.long_output, tokens, 1)
        arrivals = [(i / self.short_rate, "short", r) for i, r in enumerate(shorts)]
        arrivals += [((i + 0.5) * self.long_every_s, "long", r) for i, r in enumerate(longs)]
        return sorted(arrivals, key=lambda a: a[0])

    def _requests(
        self, count: int, prompt_len: int, output_len: int, tokens: TokenSpace, stream: int
    ) -> list[SampleRequest]:
        seed = int(np.random.SeedSequence([self.seed, stream]).generate_state(1)[0])
        prompts = random_token_prompts(
            count, prompt_len, tokens.vocab_size, tokens.special_ids, seed
        )
        return [SampleRequest(p, len(p), output_len) for p in prompts]


async def run_load(
    base_url: str, model: str, load: MixedLoad, tokens: TokenSpace
) -> dict[str, list[RequestOutput]]:
    """Every request's outputs, by kind."""
    url = f"{base_url}/v1/completions"
    outputs: dict[str, list[RequestOutput]] = {"short": [], "long": []}
    async with request_client.make_client(None) as client:

        async def one(at: float, kind: str, request: SampleRequest) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            payload = request_client.completion_payload(model, request, ignore_eos=True)
            outputs[kind].append(
                await request_client.send_request(client, url, payload, request.prompt_len)
            )

        start = time.perf_counter()
        await asyncio.gather(*(one(*arrival) for arrival in load.schedule(tokens)))
    return outputs


def summarize(outputs: dict[str, list[RequestOutput]]) -> dict[str, Any]:
    """Milliseconds: ITL p50/p99/max and TTFT p50/p99 of the short requests, TTFT
    p50/max of the long ones; request counts, and the first error seen (if any). The
    ITL max matters: a few short requests are in flight while a long prefill runs, so
    its stall can be fewer than 1% of all gaps."""
    short = [o for o in outputs["short"] if o.success]
    long = [o for o in outputs["long"] if o.success]
    gaps = [gap for o in short for gap in o.itl]
    failed = [o for kind in outputs.values() for o in kind if not o.success]
    return {
        "short_requests": len(short),
        "long_requests": len(long),
        "failed_requests": len(failed),
        "first_error": failed[0].error if failed else "",
        "short_itl_ms": _percentiles(gaps, (50, 99, 100)),
        "short_ttft_ms": _percentiles([o.ttft for o in short], (50, 99)),
        "long_ttft_ms": _percentiles([o.ttft for o in long], (50, 100)),
        "short_itl_count": len(gaps),
    }


def _percentiles(seconds: list[float], points: tuple[int, ...]) -> dict[str, float | None]:
    if not seconds:
        return {f"p{p}" if p < 100 else "max": None for p in points}
    values = np.percentile(np.asarray(seconds) * 1e3, points)
    return {(f"p{p}" if p < 100 else "max"): round(float(v), 2) for p, v in zip(points, values)}
