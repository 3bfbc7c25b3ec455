"""`kvflow bench guided`: what guided decoding costs per step, offline.

The same prompts decode with and without a JSON schema, at each batch size, the two
runs interleaved (plain, guided, plain, guided, ...) so that drift of a shared machine
hits both alike; the best of the repeats counts. The schema (at least 200 small records)
lets the output run to `--output-len`, so both runs decode the same
number of steps and the ratio is the per-step overhead: bitmask filling, matcher
advances, the mask on the wire and its application before sampling. The first and a
cached compile of the schema are reported too.

Each rate is reported twice: per wall-clock second, and per second of this process's
CPU time (`time.process_time`). On a shared machine other jobs stretch the wall clock
by whatever share of the cores they take, differently from one run to the next; the
engine's own CPU time (one process, `--num-threads 1`) is what a quiet machine's wall
clock would show, so the CPU-time ratio is the one to trust under load.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.bench import guided_goals

# Records of a string and an integer; 200 of them are more than any run's max_tokens,
# so the output never completes early and every step is guided.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    },
    "minItems": 200,
}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--compile-corpus",
        default=None,
        help="a JSON list of {'name', 'schema'}: compile each once (cold) and report the "
        "first-compile time's p50/p99/max (e.g. tests/data/json_schema_corpus.json)",
    )
    guided_goals.add_args(parser)


def run(args: argparse.Namespace) -> int:
    from kvflow.bench.throughput import random_token_prompts
    from kvflow.cli.args import engine_options
    from kvflow.offline.llm import LLM

    llm = LLM(**engine_options(args))
    special = list(llm.tokenizer.all_special_ids)
    report: dict[str, Any] = {"compile": _compile_times(llm), "batches": []}
    if args.compile_corpus:
        report["corpus"] = _corpus_compile_times(llm, args.compile_corpus)
    for batch in args.batch_sizes:
        prompts = random_token_prompts(batch, args.input_len, llm.engine.vocab_size, special, 0)
        plain, guided = _best_of(llm, prompts, args.output_len, args.repeats)
        report["batches"].append(
            {
                "batch": batch,
                "plain_tok_s": round(plain.wall, 1),
                "guided_tok_s": round(guided.wall, 1),
                "guided_over_plain": round(guided.wall / plain.wall, 3),
                "plain_tok_cpu_s": round(plain.cpu, 1),
                "guided_tok_cpu_s": round(guided.cpu, 1),
                "guided_over_plain_cpu": round(guided.cpu / plain.cpu, 3),
            }
        )
    if args.goals:
        report["goals"] = guided_goals.measure(llm, args)
    _print(report, args.json)
    return 0


def _params(output_len: int, guided: bool) -> Any:
    from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=SCHEMA) if guided else None
    return SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True, structured_outputs=constraint
    )


@dataclass
class Rates:
    """Output tokens per second of wall clock and of this process's CPU time."""

    wall: float = 0.0
    cpu: float = 0.0

    def best(self, other: Rates) -> Rates:
        return Rates(max(self.wall, other.wall), max(self.cpu, other.cpu))


def _tok_s(llm: Any, prompts: list[list[int]], output_len: int, guided: bool) -> Rates:
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, _params(output_len, guided))
    elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    tokens = sum(len(o.token_ids) for o in outputs)
    if guided and tokens != output_len * len(prompts):
        raise RuntimeError(f"guided run stopped early ({tokens} tokens): not comparable")
    return Rates(tokens / elapsed, tokens / elapsed_cpu)


def _best_of(
    llm: Any, prompts: list[list[int]], output_len: int, repeats: int
) -> tuple[Rates, Rates]:
    _tok_s(llm, prompts[:1], 4, guided=True)  # warm-up, schema compiled
    plain, guided = Rates(), Rates()
    for _ in range(repeats):
        plain = plain.best(_tok_s(llm, prompts, output_len, guided=False))
        guided = guided.best(_tok_s(llm, prompts, output_len, guided=True))
    return plain, guided


def _compile_times(llm: Any) -> dict[str, float]:
    """Seconds from submit to compiled: first (cache miss, tokenizer table included on a
    fresh engine) and again (cache hit)."""
    from kvflow.sampling_params import StructuredOutputsParams

    compiler = llm.engine.core.grammars
    times = {}
    for name in ("first_s", "cached_s"):
        start = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=SCHEMA)).result()
        times[name] = round(time.perf_counter() - start, 4)
        compiler.collect()
    return times


def _corpus_compile_times(llm: Any, path: str) -> dict[str, Any]:
    """Each schema of the corpus compiled once, one after another, on the engine's
    compiler (its tokenizer table already built by `_compile_times`): the time to
    compile a schema the server has not seen. Schemas xgrammar refuses are counted."""
    import numpy as np

    from kvflow.sampling_params import StructuredOutputsParams

    compiler = llm.engine.core.grammars
    seconds, refused = [], 0
    for entry in json.loads(Path(path).read_text()):
        start = time.perf_counter()
        try:
            compiler.submit(StructuredOutputsParams(json=entry["schema"])).result()
        except Exception:
            refused += 1
            continue
        finally:
            compiler.collect()
        seconds.append(time.perf_counter() - start)
    ms = np.array(seconds) * 1000
    return {
        "schemas": len(seconds),
        "refused": refused,
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "max_ms": round(float(ms.max()), 2),
    }


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    compile_times = report["compile"]
    print(
        f"schema compile: first {compile_times['first_s'] * 1000:.1f} ms, "
        f"cached {compile_times['cached_s'] * 1000:.2f} ms"
    )
    if "corpus" in report:
        c = report["corpus"]
        print(
            f"corpus ({c['schemas']} schemas, {c['refused']} refused): first compile "
            f"p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms, max {c['max_ms']:.1f} ms"
        )
    print(f"{'':>5} {'per wall-clock second':^40} {'per CPU second (this process)':^40}")
    header = f"{'plain tok/s':>12} {'guided tok/s':>13} {'guided/plain':>13}"
    print(f"{'batch':>5} {header} {header}")
    for row in report["batches"]:
        print(
            f"{row['batch']:>5} {row['plain_tok_s']:>12.1f} {row['guided_tok_s']:>13.1f} "
            f"{row['guided_over_plain']:>13.3f} {row['plain_tok_cpu_s']:>12.1f} "
            f"{row['guided_tok_cpu_s']:>13.1f} {row['guided_over_plain_cpu']:>13.3f}"
        )
    if "goals" in report:
        guided_goals.print_goals(report["goals"])
