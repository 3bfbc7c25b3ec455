"""`kvflow bench serve`: load-test any OpenAI-compatible server (`vllm bench serve` flags).

    /v1/models ─▶ model id, tokenizer (the model's `root` path unless --tokenizer)
    dataset    ─▶ requests (datasets.py: token-id prompts for random/prefix_repetition;
                  --random-image-size: chat messages with an image each, image_requests.py)
    one test request (fails fast on a misconfigured run), then --num-warmups requests
    for each --request-rate (a comma list sweeps):
        arrivals at Gamma(burstiness) gaps of mean 1/rate, at most --max-concurrency
        in flight ─▶ streamed completions ─▶ metrics ─▶ summary [, result JSON]
    --plot FILE.png: a rate sweep draws latency-throughput curves, one run a timeline

The tokenizer is local (HF, no download): `--tokenizer PATH`, else --model when it is a
path, else the `root` that /v1/models reports (kvflow and vLLM give the model's path).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from kvflow.bench import datasets, image_requests, request_client, serve_metrics
from kvflow.bench.datasets import SampleRequest
from kvflow.bench.request_client import RequestOutput
from kvflow.bench.serve_report import RunSetup, format_summary, result_json, result_path
from kvflow.bench.serve_roofline import format_timed_part, read_step_counters, timed_part_since
from kvflow.bench.shapes import add_shape_args, shape_model_dir

__all__ = ["BenchmarkRun", "add_args", "arrival_times", "run"]


@dataclass
class BenchmarkRun:
    rate: float
    outputs: list[RequestOutput]
    start_time: float  # perf_counter when the first arrival was due
    duration_s: float
    # A kvflow server's own step counters over this run (serve_roofline.py), else None.
    server_steps: dict[str, Any] | None = None


def arrival_times(
    num_requests: int, rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """Seconds after the start at which each request is due; the first at 0.

    Gaps are Gamma(shape=burstiness, scale=1/(rate·burstiness)): mean 1/rate, and
    burstiness 1 is a Poisson process (<1 burstier, >1 more regular). As vLLM does, the
    schedule is then scaled to span exactly its nominal (n-1)/rate, so that runs with
    different seeds offer the same load; rate inf sends everything at once."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(rate) or num_requests <= 1:
        return np.zeros(num_requests)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    return times * ((num_requests - 1) / rate / times[-1])


async def benchmark(
    client: httpx.AsyncClient,
    url: str,
    payloads: list[dict[str, Any]],
    requests: list[SampleRequest],
    rate: float,
    args: argparse.Namespace,
) -> BenchmarkRun:
    """Send every request at its arrival time; `--max-concurrency` caps those in flight
    (a due request waits for a slot: its queued_time is when it was due)."""
    due = arrival_times(len(requests), rate, args.burstiness, np.random.default_rng(args.seed))
    slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = tqdm(total=len(requests), disable=args.disable_tqdm)
    start = time.perf_counter()

    async def one(payload: dict[str, Any], request: SampleRequest, at: float) -> RequestOutput:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with slots or contextlib.nullcontext():
            output = await request_client.send_request(client, url, payload, request.prompt_len)
        output.queued_time = start + at
        progress.update(1)
        return output

    tasks = [one(p, r, float(t)) for p, r, t in zip(payloads, requests, due)]
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    progress.close()
    return BenchmarkRun(rate, outputs, start, duration)


def load_bench_tokenizer(name: str) -> Any:
    """An HF tokenizer from a directory, a GGUF file (via kvflow's conversion cache) or
    a locally cached hub name; never downloads. A directory with tokenizer.json loads
    the generic fast class (seconds faster than AutoTokenizer, same Rust tokenizer)."""
    from kvflow.tokenizer import has_tokenizer_files, load_decoding_tokenizer

    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from kvflow.gpu_worker.model_files import resolve_model_dir

        path = resolve_model_dir(str(path))
    # A bare config.json (a --skip-tokenizer-init server): token-id prompts only.
    return load_decoding_tokenizer(path, skip=path.is_dir() and not has_tokenizer_files(path))


def sample_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    space = datasets.TokenSpace(int(tokenizer.vocab_size), list(tokenizer.all_special_ids))
    if args.dataset_name == "random":
        return datasets.sample_random(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            space,
            args.seed,
        )
    if args.dataset_name == "prefix_repetition":
        return datasets.sample_prefix_repetition(
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            space,
            args.seed,
        )
    if args.dataset_path is None:
        raise SystemExit("kvflow bench serve: --dataset-name sharegpt needs --dataset-path")

    def count_tokens(text: str, special: bool) -> int:
        return len(tokenizer.encode(text, add_special_tokens=special))

    pairs = datasets.load_sharegpt(Path(args.dataset_path))
    return datasets.sample_sharegpt(
        pairs, args.num_prompts, count_tokens, args.seed, args.sharegpt_output_len
    )


async def check_and_warm_up(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int, warmups: int
) -> None:
    """One request that must succeed (a wrong model name or URL fails here, at once),
    then `warmups` concurrent ones whose results are discarded."""
    print("Starting initial single prompt test run...")
    test = await request_client.send_request(client, url, payload, prompt_len)
    if not test.success:
        raise SystemExit(f"kvflow bench serve: the initial test request failed: {test.error}")
    print("Initial test run completed. Starting main benchmark run...")
    if warmups > 0:
        print(f"Warming up with {warmups} requests...")
        send = request_client.send_request
        await asyncio.gather(*(send(client, url, payload, prompt_len) for _ in range(warmups)))


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise SystemExit("kvflow bench serve: --num-prompts must be at least 1")
    if args.plot:
        from kvflow.bench.plot import require_matplotlib

        require_matplotlib()
    shape_dir = shape_model_dir(args)  # --shape/--config: the served preset's tokenizer
    if shape_dir is not None and args.tokenizer is None:
        args.tokenizer = str(shape_dir)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model_id, tokenizer_id = resolve_model(args, base_url)
    tokenizer = load_bench_tokenizer(tokenizer_id)
    requests = sample_requests(args, tokenizer)
    served_name = args.served_model_name or model_id
    payloads = image_requests.make_payloads(args, served_name, requests, tokenizer)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    setup = RunSetup(
        model_id, tokenizer_id, len(requests), math.inf, args.burstiness, args.max_concurrency,
        date=time.strftime("%Y%m%d-%H%M%S"),
    )  # fmt: skip
    sweep = len(args.request_rate) > 1

    def report(bench_run: BenchmarkRun) -> None:
        run_setup = dataclasses.replace(setup, request_rate=bench_run.rate)
        _report(args, bench_run, run_setup, count_tokens, sweep)

    before = spec_decode_counts(base_url)
    runs = asyncio.run(_run_rates(base_url, payloads, requests, args, report))
    _report_acceptance(before, spec_decode_counts(base_url))
    if args.plot:
        _plot(runs, args.plot, count_tokens)
    return 0


def _report(
    args: argparse.Namespace,
    bench_run: BenchmarkRun,
    setup: RunSetup,
    count_tokens: Callable[[str], int],
    sweep: bool,
) -> None:
    """Print one run's summary; with --save-result also write its JSON."""
    goodput = dict(args.goodput or [])
    outputs, duration = bench_run.outputs, bench_run.duration_s
    metrics = serve_metrics.calculate_metrics(
        outputs, duration, args.metric_percentiles, goodput, count_tokens
    )
    names = args.percentile_metrics
    print(format_summary(metrics, setup, duration, names, bool(goodput)))
    steps = bench_run.server_steps
    if steps is not None:
        print(format_timed_part(steps))
    if args.save_result:
        path = result_path(setup, args.result_dir, args.result_filename, sweep)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = result_json(metrics, setup, outputs, duration, names, bool(goodput))
        if steps is not None:
            document["server_steps"] = steps
        path.write_text(json.dumps(document))
        print(f"Result saved to {path}")


def spec_decode_counts(base_url: str) -> tuple[float, float, float] | None:
    """(drafts, draft tokens, accepted tokens) from the server's /metrics (kvflow: or
    vllm: names); None when it exports none (no speculative decoding)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1]
            totals[name] = totals.get(name, 0.0) + sample.value
    names = [f"spec_decode_num_{n}_total" for n in ("drafts", "draft_tokens", "accepted_tokens")]
    if names[0] not in totals:
        return None
    return (totals[names[0]], totals.get(names[1], 0.0), totals.get(names[2], 0.0))


def _report_acceptance(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> None:
    """vLLM's mean acceptance length (1 + accepted / drafts) over the whole benchmark."""
    if before is None or after is None or after[0] <= before[0]:
        return
    drafts, drafted, accepted = (a - b for a, b in zip(after, before))
    print(f"Mean acceptance length: {1 + accepted / drafts:.2f}")
    print(f"Draft acceptance rate: {accepted / max(drafted, 1):.3f}")


def resolve_model(args: argparse.Namespace, base_url: str) -> tuple[str, str]:
    """(model id, tokenizer id): --model else the server's first model; --tokenizer,
    else --model when it is a local path, else the model's `root` from /v1/models."""
    if args.model is not None and (args.tokenizer or Path(args.model).exists()):
        return args.model, args.tokenizer or args.model
    response = httpx.get(f"{base_url}/v1/models", timeout=30.0)
    response.raise_for_status()
    cards = response.json()["data"]
    card = next((c for c in cards if c["id"] == args.model), cards[0])
    model_id = args.model or str(card["id"])
    return model_id, args.tokenizer or str(card.get("root") or card["id"])


async def _run_rates(
    base_url: str,
    payloads: list[dict[str, Any]],
    requests: list[SampleRequest],
    args: argparse.Namespace,
    report: Callable[[BenchmarkRun], None],
) -> list[BenchmarkRun]:
    """Check and warm up once, then one run per rate, each reported as it ends (with a
    kvflow server's step counters over that run alone)."""
    url = base_url + args.endpoint
    async with request_client.make_client(args.max_concurrency) as client:
        await check_and_warm_up(client, url, payloads[0], requests[0].prompt_len, args.num_warmups)
        counters = await asyncio.to_thread(read_step_counters, base_url)
        runs = []
        for rate in args.request_rate:
            print(f"Traffic request rate: {rate}")
            print(f"Burstiness factor: {args.burstiness}")
            print(f"Maximum request concurrency: {args.max_concurrency}")
            runs.append(await benchmark(client, url, payloads, requests, rate, args))
            if counters is not None:
                steps, counters = await asyncio.to_thread(timed_part_since, counters, base_url)
                runs[-1].server_steps = steps
            report(runs[-1])
        return runs


def _plot(runs: list[BenchmarkRun], path: str, count_tokens: Any) -> None:
    from kvflow.bench import plot

    if len(runs) > 1:
        points = [plot.curve_point(r.rate, r.outputs, r.duration_s, count_tokens) for r in runs]
        plot.draw_curves(points, Path(path))
    else:
        rows = plot.timeline_rows(runs[0].outputs, runs[0].start_time)
        plot.draw_timeline(rows, Path(path))
    print(f"Plot saved to {path}")


def parse_rates(text: str) -> list[float]:
    """`--request-rate`: one rate or a comma list to sweep; "inf" sends all at once."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or not all(rate > 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"bad rate list {text!r} (e.g. 4, inf, 1,2,inf)")
    return rates


def add_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `vllm bench serve` that kvflow implements, with vLLM's defaults."""
    _add_server_args(parser.add_argument_group("server"))
    add_shape_args(parser)
    _add_dataset_args(parser.add_argument_group("dataset"))
    _add_traffic_args(parser.add_argument_group("traffic"))
    _add_result_args(parser.add_argument_group("results"))


def _add_server_args(server: Any) -> None:
    server.add_argument("--base-url", default=None, help="e.g. http://host:8000 (else host+port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default="/v1/completions")
    server.add_argument("--model", default=None, help="default: the server's first model")
    server.add_argument("--served-model-name", default=None, help="name to send (else --model)")
    server.add_argument(
        "--tokenizer",
        default=None,
        help="local HF tokenizer (default: --model if a path, else the model root /v1/models reports)",
    )


def _add_dataset_args(data: Any) -> None:
    data.add_argument(
        "--dataset-name", choices=["random", "sharegpt", "prefix_repetition"], default="random"
    )
    data.add_argument("--dataset-path", default=None, help="sharegpt-format JSON file")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths in X·[1-r, 1+r]"
    )
    data.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by all")
    data.add_argument("--sharegpt-output-len", type=int, default=None, help="fix output length")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    image_requests.add_args(data)


def _add_traffic_args(traffic: Any) -> None:
    traffic.add_argument(
        "--request-rate", type=parse_rates, default="inf", help="req/s; inf; a comma list sweeps"
    )
    traffic.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1 = Poisson")
    traffic.add_argument("--max-concurrency", type=int, default=None)
    traffic.add_argument("--ignore-eos", action="store_true", help="always max_tokens tokens")
    traffic.add_argument("--num-warmups", type=int, default=0)
    traffic.add_argument("--seed", type=int, default=0)


def _add_result_args(out: Any) -> None:
    out.add_argument(
        "--goodput", nargs="+", type=serve_metrics.parse_slo, help="SLOs, e.g. ttft:500 tpot:50"
    )
    out.add_argument(
        "--percentile-metrics",
        type=serve_metrics.parse_metric_names,
        default="ttft,tpot,itl",
        help="of ttft,tpot,itl,e2el",
    )
    out.add_argument(
        "--metric-percentiles",
        type=serve_metrics.parse_percentiles,
        default="99",
        help="e.g. 25,50,99",
    )
    out.add_argument("--save-result", action="store_true", help="write vLLM's result JSON")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="needs matplotlib")
