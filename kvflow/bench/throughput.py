"""`kvflow bench throughput`: offline throughput on deterministic random-token prompts.

With `--compare transformers`, HF transformers `generate` runs the same prompts in the
same process (one static batch, sdpa attention, same dtype) and the ratio is printed.
With `--compare vllm`, vLLM runs them in its own environment (kvflow/bench/
vllm_compare.py), same model directory, dtype and batch limits.
kvflow's run also reports its % of the compute and bandwidth rooflines, for prefill-heavy
and decode-heavy steps apart (kvflow/bench/roofline.py).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvflow.bench.shapes import add_shape_args, apply_shape_args
from kvflow.bench.vllm_compare import add_peer_python_arg


@dataclass
class ThroughputResult:
    name: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "requests_per_s": round(self.requests_per_s, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
            "total_tokens_per_s": round(self.total_tokens_per_s, 1),
        }


def add_args(parser: argparse.ArgumentParser) -> None:
    add_shape_args(parser)  # --shape NAME / --config DIR: real-size shapes, random weights
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--compare", choices=["transformers", "vllm", "llama.cpp"], action="append",
        help="also run the same workload on a peer (repeatable: --compare vllm --compare "
        "llama.cpp); llama.cpp runs BF16 and Q8_0 GGUFs of the same shapes "
        "(kvflow/bench/llama_cpp_peer.py)",
    )  # fmt: skip
    add_peer_python_arg(parser)
    parser.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        help="also run the prompts spread over this many synthetic LoRA adapters (all "
        "seven targets) and compare with the base alone (kvflow/bench/lora_bench.py)",
    )
    parser.add_argument("--lora-adapter-rank", type=int, default=16, help="their rank")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--trace-file",
        default=None,
        help="write the measured run's steps as a Chrome/Perfetto trace; with pipeline "
        "stages also report each stage's idle share (the bubble)",
    )


def random_token_prompts(
    num_prompts: int, input_len: int, vocab_size: int, special_ids: list[int], seed: int
) -> list[list[int]]:
    """Deterministic prompts of exactly `input_len` ordinary (non-special) token ids."""
    rng = np.random.default_rng(seed)
    low = max(special_ids, default=-1) + 1 if max(special_ids, default=0) < 1000 else 0
    ids = rng.integers(low, vocab_size, size=(num_prompts, input_len))
    return ids.tolist()


def run_kvflow(
    llm: Any, prompts: list[list[int]], output_len: int, trace_file: str | None = None,
    loras: list[Any] | None = None, name: str = "kvflow",
) -> ThroughputResult:  # fmt: skip
    from kvflow.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    llm.engine.roofline.reset()  # the measured run only
    if trace_file is not None:
        llm.engine.start_trace(trace_file)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    llm.engine.stop_trace()
    return ThroughputResult(
        name=name,
        num_requests=len(prompts),
        elapsed_s=elapsed,
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(o.token_ids) for o in outputs),
    )


def run_transformers(
    model_dir: str, dtype: str, prompts: list[list[int]], output_len: int
) -> ThroughputResult:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    input_ids = torch.tensor(prompts)  # equal lengths: one static batch, no padding
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len)
    with torch.inference_mode():
        warm = input_ids[:2, :8]
        model.generate(
            warm, attention_mask=torch.ones_like(warm), do_sample=False, max_new_tokens=2
        )
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        elapsed = time.perf_counter() - start
    return ThroughputResult(
        name="transformers",
        num_requests=len(prompts),
        elapsed_s=elapsed,
        prompt_tokens=input_ids.numel(),
        output_tokens=(out.shape[1] - input_ids.shape[1]) * input_ids.shape[0],
    )


# kvflow's quantized --kv-cache-dtype -> vLLM's; a float cache is vLLM's "auto"
VLLM_KV_CACHE_DTYPES = {"int8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def vllm_job(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """What vLLM's run needs of kvflow's: the same model, dtype, prompts and limits, and
    an 8-bit KV cache where kvflow's is one (vLLM has fp8 formats, no int8: fp8_e4m3
    stands in for int8, the same bytes per element), and `--load-format dummy` passed on."""
    config = llm.engine.config
    return {
        "model": str(llm.engine.model_dir),
        "dtype": config.model.dtype,
        "kv_cache_dtype": VLLM_KV_CACHE_DTYPES.get(config.cache.kv_cache_dtype, "auto"),
        "prompts": prompts,
        "output_len": output_len,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "seed": config.model.seed,
        # a --shape/--config run: random weights there too, and no tokenizer if none
        "load_format": config.model.load_format,
        "skip_tokenizer_init": config.model.skip_tokenizer_init,
    }


def run_vllm_peer(python: Any, job: dict[str, Any], env: dict[str, str]) -> list[ThroughputResult]:
    """vLLM's run; with a LoRA job, its adapted run and then its base alone."""
    from kvflow.bench.vllm_compare import run_vllm

    result = run_vllm(python, job, env)
    name, count, prompt_tokens = (
        f"vllm {result['version']}",
        len(job["prompts"]),
        result["prompt_tokens"],
    )
    runs = [(name, result["elapsed_s"], result["output_tokens"])]
    if "base_elapsed_s" in result:
        runs = [(f"{name} LoRA", *runs[0][1:]),
                (f"{name} base", result["base_elapsed_s"], result["base_output_tokens"])]  # fmt: skip
    return [ThroughputResult(n, count, s, prompt_tokens, tokens) for n, s, tokens in runs]


def run_llama_cpp_peer(
    model_dir: Any, args: argparse.Namespace, num_threads: int | None
) -> list[ThroughputResult]:
    """llama.cpp's BF16 and Q8_0 runs of the same batch (kvflow/bench/llama_cpp_peer.py)."""
    import os

    from kvflow.bench.llama_cpp_peer import Workload, run_llama_cpp

    threads = num_threads or len(os.sched_getaffinity(0))
    work = Workload(args.num_prompts, args.input_len, args.output_len, threads)
    return [
        ThroughputResult(name, row["pl"], row["t"], row["pl"] * row["pp"], row["pl"] * row["tg"])
        for name, row in run_llama_cpp(model_dir, work).items()
    ]


def run(args: argparse.Namespace) -> int:
    import gc

    from kvflow.bench.roofline import roofline_section
    from kvflow.bench.vllm_compare import peer_env, peer_python
    from kvflow.cli.args import engine_options
    from kvflow.offline.llm import LLM

    compare = args.compare or []
    python = peer_python(args.peer_python) if "vllm" in compare else None
    if args.lora_adapters:
        return _run_lora(args, python)
    apply_shape_args(args)
    llm = LLM(**engine_options(args))
    tokenizer = llm.tokenizer
    prompts = random_token_prompts(
        args.num_prompts,
        args.input_len,
        llm.engine.vocab_size,
        list(tokenizer.all_special_ids),
        args.bench_seed,
    )
    results = [run_kvflow(llm, prompts, args.output_len, args.trace_file)]
    roofline = roofline_section(llm.engine)
    bubble: dict[int, float] = {}
    if args.trace_file is not None:
        from kvflow.bench.pipeline_bubble import idle_shares, read_stage_spans

        bubble = idle_shares(read_stage_spans(args.trace_file))
    model_dir, dtype = llm.engine.model_dir, llm.engine.config.model.dtype
    job = vllm_job(llm, prompts, args.output_len)
    device = llm.engine.config.device
    llm.close()  # the peers get the cores (and on CUDA the memory) to themselves
    del llm
    gc.collect()  # the engine's weights sit in reference cycles: free them before a peer loads
    if "transformers" in compare:
        results.append(run_transformers(str(model_dir), dtype, prompts, args.output_len))
    if python is not None:
        results.extend(run_vllm_peer(python, job, peer_env(device.device, device.num_threads)))
    if "llama.cpp" in compare:
        results += run_llama_cpp_peer(model_dir, args, device.num_threads)
    _report(results, roofline, args.json, bubble)
    return 0


def _report(
    results: list[ThroughputResult],
    roofline: dict[str, Any],
    as_json: bool,
    bubble: dict[int, float] | None = None,
    extra: dict[str, dict[str, float]] | None = None,
) -> None:
    from kvflow.bench.roofline import roofline_lines

    report: dict[str, Any] = {r.name: r.summary() for r in results}
    report.update(extra or {})
    report["roofline"] = roofline
    if bubble:  # pipeline stages: each one's idle share over the measured run
        report["pipeline_idle_share"] = {str(s): round(v, 4) for s, v in sorted(bubble.items())}
    if len(results) == 2:
        report["speedup_output_tokens_per_s"] = round(
            results[0].output_tokens_per_s / results[1].output_tokens_per_s, 2
        )
    if as_json:
        print(json.dumps(report))
        return
    for r in results:
        print(
            f"{r.name:>13}: {r.requests_per_s:.2f} requests/s, "
            f"{r.output_tokens_per_s:.1f} output tok/s, {r.total_tokens_per_s:.1f} total tok/s "
            f"({r.num_requests} requests in {r.elapsed_s:.2f} s)"
        )
    if "speedup_output_tokens_per_s" in report:
        ratio = report["speedup_output_tokens_per_s"]
        print(f"kvflow / {results[1].name} output tok/s: {ratio}x")
    if len(results) > 2:
        print("\n".join(comparison_table(results)))
    print("\n".join(roofline_lines(roofline)))
    for key, values in (extra or {}).items():
        print(f"{key}: " + ", ".join(f"{name} {value}" for name, value in values.items()))
    for stage, share in report.get("pipeline_idle_share", {}).items():
        print(f"pipeline stage {stage}: {100 * share:.1f}% idle")


def comparison_table(results: list[ThroughputResult]) -> list[str]:
    """One markdown table, an engine per column: kvflow | vLLM | llama.cpp BF16 | ..."""
    rows = [
        ("output tok/s", [f"{r.output_tokens_per_s:.1f}" for r in results]),
        ("total tok/s", [f"{r.total_tokens_per_s:.1f}" for r in results]),
        ("requests/s", [f"{r.requests_per_s:.2f}" for r in results]),
        ("wall s", [f"{r.elapsed_s:.2f}" for r in results]),
    ]
    lines = ["| | " + " | ".join(r.name for r in results) + " |"]
    lines.append("|---|" + "---:|" * len(results))
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return lines


def _run_lora(args: argparse.Namespace, python: Any) -> int:
    """The prompts over `--lora-adapters` adapters, then on the base alone (one engine);
    with `--compare vllm` (`python`: its interpreter) vLLM does the same after."""
    from kvflow.bench import lora_bench
    from kvflow.bench.roofline import roofline_section
    from kvflow.bench.vllm_compare import peer_env
    from kvflow.cli.args import engine_options
    from kvflow.gpu_worker.model_files import resolve_model_dir
    from kvflow.offline.llm import LLM

    apply_shape_args(args)
    options = engine_options(args)
    model_dir = resolve_model_dir(options.get("model"))
    folder, paths = lora_bench.temporary_adapters(
        model_dir, args.lora_adapters, args.lora_adapter_rank
    )
    with folder:
        llm = LLM(
            **lora_bench.lora_engine_options(options, args.lora_adapters, args.lora_adapter_rank)
        )
        vocab, special = llm.engine.vocab_size, list(llm.tokenizer.all_special_ids)
        prompts = random_token_prompts(
            args.num_prompts, args.input_len, vocab, special, args.bench_seed
        )
        loras = lora_bench.lora_requests(paths, len(prompts))
        name = f"kvflow {args.lora_adapters} LoRA"
        adapted = run_kvflow(llm, prompts, args.output_len, None, loras, name)
        base = run_kvflow(llm, prompts, args.output_len, None, None, "kvflow base")
        roofline = roofline_section(llm.engine)
        lora: dict[str, float] = lora_bench.load_stats(llm, paths[0])
        results = [adapted, base]
        if python is not None:
            rank, max_loras = args.lora_adapter_rank, llm.engine.config.lora.max_loras
            job = lora_bench.vllm_lora_job(
                vllm_job(llm, prompts, args.output_len), paths, rank, max_loras
            )
            device = llm.engine.config.device
            llm.close()  # the peer gets the cores to itself
            results.extend(run_vllm_peer(python, job, peer_env(device.device, device.num_threads)))
        lora.update(lora_bench.ratios(results))
    _report(results, roofline, args.json, extra={"lora": lora})
    return 0
