"""`kvflow` command line: serve (and each process role), generate, chat, run-batch, bench."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from kvflow.cli.args import add_engine_args, engine_options
from kvflow.runtime.cluster_args import apply_cluster_args
from kvflow.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if hasattr(args, "cluster_secret_file"):
        apply_cluster_args(args)
    result = args.handler(args)
    return result if isinstance(result, int) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__)
    parser.add_argument("--log-level", default="warning", help="debug, info, warning, error")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="generate from one prompt, streaming to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--raw", action="store_true", help="no chat template")
    _add_sampling_args(generate)
    add_engine_args(generate)
    generate.set_defaults(handler=_run_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(handler=_run_chat)

    from kvflow.cli.run_batch import add_run_batch_parser

    add_run_batch_parser(sub)  # an OpenAI batch file, offline

    from kvflow.cli.serve import add_serve_parsers

    add_serve_parsers(sub)  # serve + each process role alone (scheduler, worker, ...)

    from kvflow.services.proxy.main import add_proxy_parser

    add_proxy_parser(sub)  # disaggregated prefill/decode front

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text, engine in _BENCHES:
        bench_module = importlib.import_module(f"kvflow.bench.{module}")
        command = bench_sub.add_parser(name, help=help_text)
        bench_module.add_args(command)
        if engine:  # it builds an engine itself: every engine option applies
            add_engine_args(command)
        command.set_defaults(handler=bench_module.run)
    _add_kernel_bench(bench_sub)
    return parser


# `kvflow bench NAME`: (name, module under services/bench, help, takes engine options)
_BENCHES = [
    ("throughput", "throughput", "offline throughput on random prompts", True),
    ("latency", "latency", "offline end-to-end latency of one batch", True),
    ("embed", "embed", "offline embeddings/s of the pooling runner", True),
    ("host-time", "host_time", "worker host time per decode step", True),
    ("guided", "guided", "per-step cost of guided decoding (JSON schema)", True),
    ("serve", "serve", "load-test any OpenAI-compatible server", False),
    ("vlm-config", "vlm_config", "write a ~1B LLaVA config dir (--load-format dummy)", False),
    ("vlm", "vlm", "image-request serving speed, kvflow vs (--compare) vLLM", False),
    ("startup", "startup", "time `kvflow serve` to ready and first token", True),
    ("spec-decode", "spec_decode", "single-stream tok/s with speculation", True),
    ("kv-transfer", "kv_transfer", "zmq KV connector GB/s vs a memcpy", False),
    ("kv-save", "kv_save", "producer step time: KV saved by layer vs after", True),
    ("disagg", "disagg", "decode ITL under long prompts: colocated vs 1P+1D", True),
    ("routing", "routing", "data-parallel routing cost per request", False),
    ("moe-kernel", "moe_kernel", "fused-expert kernel vs a dense GEMM of equal FLOPs", False),
    ("kv-capacity", "kv_capacity", "hybrid KV cache: bytes per request, requests that fit", False),
    ("shape", "shapes", "write a real-size --shape preset's directory, print its path", False),
]


def _add_kernel_bench(bench_sub: Any) -> None:
    from kvflow.bench.kernel_args import add_kernel_bench_args

    kb = bench_sub.add_parser("kernels", help="kernels: time, bandwidth, %% of roofline")
    add_kernel_bench_args(kb)
    kb.set_defaults(handler=_run_kernel_bench)


def _run_kernel_bench(args: argparse.Namespace) -> int:
    # Imported only when run: torch and Triton take seconds to import.
    from kvflow.bench.kernels import run_kernel_bench

    run_kernel_bench(args)  # prints its table (or JSON)
    return 0


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )


def _stream(llm: Any, prompt: str | list[int], params: SamplingParams) -> str:
    """Run one request, printing text as it is produced; returns the full text."""
    engine = llm.engine
    engine.add_request("cli", prompt, params)
    printed = 0
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return text


def _run_generate(args: argparse.Namespace) -> int:
    from kvflow.offline.llm import LLM
    from kvflow.tokenizer import apply_chat_template

    llm = LLM(**engine_options(args))
    prompt: str | list[int] = args.prompt
    if not args.raw and llm.tokenizer.chat_template:
        prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": args.prompt}])
    _stream(llm, prompt, _sampling_params(args))
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    from kvflow.offline.llm import LLM
    from kvflow.tokenizer import apply_chat_template

    llm = LLM(**engine_options(args))
    history: list[dict[str, str]] = []
    print("kvflow chat — empty line or Ctrl-D to quit")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        prompt = apply_chat_template(llm.tokenizer, history)
        reply = _stream(llm, prompt, _sampling_params(args))
        history.append({"role": "assistant", "content": reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
