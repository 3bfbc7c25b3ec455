"""`kvflow bench embed`: offline embeddings/s of the pooling runner on random-token inputs.

    kvflow bench embed [--num-prompts 64] [--input-len 256] [--compare vllm] [engine flags]

The engine is built with `--runner pooling` (its pooler from the model's files or
`--pooler-config`), warmed up on two inputs, then one timed `LLM.embed` call runs every
input. With `--compare vllm`, vLLM's pooling runner embeds the same token ids in its own
environment (kvflow/bench/vllm_embed_peer.py, through vllm_compare.py), with kvflow's
model directory, dtype, batch limits, pooling type and normalisation, prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvflow.bench.throughput import random_token_prompts
from kvflow.bench.vllm_compare import add_peer_python_arg


@dataclass
class EmbedResult:
    name: str
    num_embeddings: int
    elapsed_s: float
    prompt_tokens: int

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "embeddings_per_s": round(self.num_embeddings / self.elapsed_s, 2),
            "prompt_tokens_per_s": round(self.prompt_tokens / self.elapsed_s, 1),
        }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--compare", choices=["vllm"], default=None)
    add_peer_python_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_kvflow(llm: Any, prompts: list[list[int]]) -> EmbedResult:
    llm.embed(prompts[:2])  # warm-up
    start = time.perf_counter()
    outputs = llm.embed(prompts)
    elapsed = time.perf_counter() - start
    return EmbedResult("kvflow", len(outputs), elapsed, sum(len(p) for p in prompts))


def vllm_embed_job(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """What vLLM's run needs of kvflow's: the same model, dtype, limits, pooler, inputs."""
    config, pooling = llm.engine.config, llm.engine.pooling
    return {
        "model": str(llm.engine.model_dir),
        "dtype": config.model.dtype,
        "prompts": prompts,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "pooling_type": pooling.pooling_type,
        "normalize": pooling.normalize,
        "seed": config.model.seed,
    }


def run(args: argparse.Namespace) -> int:
    from kvflow.bench.vllm_compare import EMBED_PEER_SCRIPT, peer_env, peer_python, run_vllm
    from kvflow.cli.args import engine_options
    from kvflow.offline.llm import LLM

    python = peer_python(args.peer_python) if args.compare == "vllm" else None
    llm = LLM(**{**engine_options(args), "runner": "pooling"})
    prompts = random_token_prompts(
        args.num_prompts,
        args.input_len,
        llm.engine.vocab_size,
        list(llm.tokenizer.all_special_ids),
        args.bench_seed,
    )
    results = [run_kvflow(llm, prompts)]
    if python is not None:
        job = vllm_embed_job(llm, prompts)
        device = llm.engine.config.device
        env = peer_env(device.device, device.num_threads)
        llm.close()  # the peer gets the cores (and on CUDA the memory) to itself
        peer = run_vllm(python, job, env, EMBED_PEER_SCRIPT)
        name = f"vllm {peer['version']}"
        results.append(
            EmbedResult(name, peer["num_embeddings"], peer["elapsed_s"], peer["prompt_tokens"])
        )
    _report(results, args.json)
    return 0


def _report(results: list[EmbedResult], as_json: bool) -> None:
    report: dict[str, Any] = {r.name: r.summary() for r in results}
    if len(results) == 2:
        rates = [r.num_embeddings / r.elapsed_s for r in results]
        report["speedup_embeddings_per_s"] = round(rates[0] / rates[1], 2)
    if as_json:
        print(json.dumps(report))
        return
    for r in results:
        s = r.summary()
        print(
            f"{r.name:>13}: {s['embeddings_per_s']:.2f} embeddings/s, "
            f"{s['prompt_tokens_per_s']:.1f} input tok/s "
            f"({r.num_embeddings} inputs in {r.elapsed_s:.2f} s)"
        )
    if "speedup_embeddings_per_s" in report:
        print(f"kvflow / {results[1].name} embeddings/s: {report['speedup_embeddings_per_s']}x")
