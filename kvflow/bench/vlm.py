"""`kvflow bench vlm`: serving speed on image requests, kvflow and (--compare vllm) vLLM
on the same vision-language directory with the same client, one after the other.

    model dir   --model DIR, else one `kvflow bench vlm-config` writes (about 1B
                parameters; the size flags shrink it) in the work folder
    per engine  start the server on 127.0.0.1 (`kvflow serve`; vLLM's OpenAI server from
                its own environment, kvflow/bench/vllm_server.py), wait for /health,
                run the workload, stop the server's process group
    workload    `kvflow bench serve --random-image-size 448x448`: --num-prompts chat
                requests of one random image + --input-len random text tokens ->
                --output-len tokens (ignore_eos), at --max-concurrency, after
                --num-warmups untimed requests
    report      output tok/s and TTFT p50/p99 of each, and kvflow / vLLM

Both run with random weights (--load-format dummy), the same dtype, maximum length,
KV space and seed, and prefix caching off. Server logs and result files stay in
--work-dir (default: a temporary folder, removed unless --keep).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvflow.bench import instances
from kvflow.bench.vllm_compare import add_peer_python_arg
from kvflow.bench.vlm_config import add_size_args, write_from_args

START_TIMEOUT_S = 1800.0  # vLLM compiles its graphs at start-up: minutes on 2 CPU cores


@dataclass(frozen=True)
class EngineResult:
    name: str
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    completed: int
    duration_s: float


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a LLaVA directory (else one is written)")
    add_size_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64, help="random text tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--request-image-size", default="448x448", help="WxH of each image")
    parser.add_argument("--num-warmups", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--kv-cache-gib", type=int, default=1, help="KV space, both engines (vLLM: whole GiB)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kvflow-args", default="", help="more `kvflow serve` flags (one string)")
    parser.add_argument("--compare", choices=["vllm"], default=None)
    add_peer_python_arg(parser)
    parser.add_argument("--vllm-args", default="", help="more vLLM server flags (one string)")
    parser.add_argument("--work-dir", default=None, help="logs, results (and the model dir)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def kvflow_serve_args(args: argparse.Namespace, model: Path) -> list[str]:
    """`kvflow serve` flags matching the vLLM server's (vllm_server.server_args)."""
    return [
        "serve", "--model", str(model), "--load-format", "dummy", "--dtype", args.dtype,
        "--host", "127.0.0.1", "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory", str(args.kv_cache_gib), "--no-enable-prefix-caching",
        "--seed", str(args.seed), *shlex.split(args.kvflow_args),
    ]  # fmt: skip


def workload_args(args: argparse.Namespace, base_url: str, model: Path, result: Path) -> list[str]:
    """`kvflow bench serve` flags of the issue's workload (the same for both engines)."""
    return [
        "--base-url", base_url, "--tokenizer", str(model),
        "--random-image-size", args.request_image_size,
        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos",
        "--num-warmups", str(args.num_warmups), "--seed", str(args.seed),
        "--metric-percentiles", "50,99", "--percentile-metrics", "ttft,tpot,itl",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip


def run_workload(name: str, argv: list[str], result: Path) -> EngineResult:
    """Run `kvflow bench serve` in this process (its summary to stderr); its figures."""
    from kvflow.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    with contextlib.redirect_stdout(sys.stderr):
        serve.run(parser.parse_args(argv))
    return engine_result(name, json.loads(result.read_text()))


def engine_result(name: str, document: dict[str, Any]) -> EngineResult:
    """The figures of a `--save-result` document; every request must have succeeded."""
    if document["failed"]:
        errors = [e for e in document["errors"] if e]
        raise RuntimeError(f"{name}: {document['failed']} requests failed, e.g. {errors[:1]}")
    return EngineResult(
        name,
        float(document["output_throughput"]),
        float(document["p50_ttft_ms"]),
        float(document["p99_ttft_ms"]),
        int(document["completed"]),
        float(document["duration"]),
    )


@contextlib.contextmanager
def serving(instance: instances.Instance) -> Iterator[instances.Instance]:
    """The instance once healthy; stopped (its whole process group) on the way out."""
    try:
        instances.wait_healthy(instance, START_TIMEOUT_S)
        yield instance
    finally:
        instances.stop(instance)


def server_version(base_url: str) -> str | None:
    import httpx

    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        response = httpx.get(base_url + "/version", timeout=5.0)
        if response.status_code == 200:
            return str(response.json()["version"])
    return None


def run(args: argparse.Namespace) -> int:
    python = None
    if args.compare == "vllm":
        from kvflow.bench.vllm_compare import peer_python

        python = peer_python(args.peer_python)  # fails before anything starts
    with _work_dir(args) as work:
        model = Path(args.model) if args.model else _write_model(args, work / "model")
        results = [_run_kvflow(args, model, work)]
        if python is not None:
            results.append(_run_vllm(args, python, model, work))
    print(json.dumps(report_json(results)) if args.json else format_table(results))
    return 0


@contextlib.contextmanager
def _work_dir(args: argparse.Namespace) -> Iterator[Path]:
    if args.work_dir is not None:
        path = Path(args.work_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="kvflow-vlm-"))
    try:
        yield path
    finally:
        if args.keep:
            print(f"work folder kept: {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _write_model(args: argparse.Namespace, path: Path) -> Path:
    count = write_from_args(path, args)
    print(f"model: {path}, LLaVA ({args.vision}), {count / 1e9:.2f}B parameters", file=sys.stderr)
    return path


def _run_kvflow(args: argparse.Namespace, model: Path, work: Path) -> EngineResult:
    instance = instances.launch("kvflow", kvflow_serve_args(args, model), work, None)
    with serving(instance):
        result = work / "kvflow.json"
        return run_workload("kvflow", workload_args(args, instance.base_url, model, result), result)


def _run_vllm(args: argparse.Namespace, python: Path, model: Path, work: Path) -> EngineResult:
    from kvflow.bench import vllm_server

    extra = tuple(shlex.split(args.vllm_args))
    spec = vllm_server.VllmServe(
        model, args.dtype, args.max_model_len, args.kv_cache_gib, args.seed, extra_args=extra
    )
    instance = vllm_server.launch(python, spec, work, None)
    with serving(instance):
        name = f"vllm {server_version(instance.base_url) or ''}".strip()
        result = work / "vllm.json"
        return run_workload(name, workload_args(args, instance.base_url, model, result), result)


def report_json(results: list[EngineResult]) -> dict[str, Any]:
    report: dict[str, Any] = {r.name: asdict(r) for r in results}
    if len(results) == 2:
        ours, peer = results
        report["output_tok_s_ratio"] = round(ours.output_tok_s / peer.output_tok_s, 3)
        report["ttft_p99_ratio"] = round(ours.ttft_p99_ms / peer.ttft_p99_ms, 3)
    return report


def format_table(results: list[EngineResult]) -> str:
    lines = [f"{'engine':<16} {'output tok/s':>12} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}"]
    for r in results:
        lines.append(
            f"{r.name:<16} {r.output_tok_s:>12.2f} {r.ttft_p50_ms:>12.1f} {r.ttft_p99_ms:>12.1f}"
        )
    if len(results) == 2:
        ours, peer = results
        ratios = [
            ours.output_tok_s / peer.output_tok_s,
            ours.ttft_p50_ms / peer.ttft_p50_ms,
            ours.ttft_p99_ms / peer.ttft_p99_ms,
        ]
        lines.append(f"{'kvflow / ' + peer.name.split()[0]:<16}" + "".join(
            f" {ratio:>11.2f}x" for ratio in ratios
        ))  # fmt: skip
    return "\n".join(lines)
