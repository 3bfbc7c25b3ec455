"""vLLM's offline throughput on prompts given as token ids: the peer run of
`kvflow bench throughput --compare vllm`.

This file is run by the peer's own interpreter (a virtual environment with vLLM's CPU
or CUDA build), not imported by kvflow: it needs only the standard library and vllm.

    stdin:  {"model": dir, "dtype": "float32", "kv_cache_dtype": "auto", "prompts": [[ids]],
             "output_len": n, "max_num_seqs": n, "max_num_batched_tokens": n, "seed": n,
             "load_format": "auto" or "dummy" (random weights, vLLM's own option),
             "skip_tokenizer_init": bool,
             optionally "lora": {"paths": [adapter dirs], "max_lora_rank": n, "max_loras": n}}
    stdout: a line "kvflow-peer-result: " + {"elapsed_s", "load_s", "prompt_tokens",
             "output_tokens", "version"} (vLLM logs on stdout too); with "lora", the run
             is the prompts spread round-robin over the adapters, and "base_elapsed_s",
             "base_output_tokens" are the same prompts on the base alone, same engine

Greedy, `ignore_eos`, prefix caching off (the warm-up shares the prompts), one
`LLM.generate` call over every prompt, timed as kvflow's run is timed.
"""

import json
import sys
import time


def main() -> int:
    job = json.load(sys.stdin)
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
        max_model_len=max(len(p) for p in job["prompts"]) + job["output_len"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        enable_prefix_caching=False,
        seed=job["seed"],
        load_format=job.get("load_format", "auto"),
        skip_tokenizer_init=job.get("skip_tokenizer_init", False),
        **_lora_options(job.get("lora")),
    )
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts[:2], warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    loras = _lora_requests(job.get("lora"), len(prompts))
    elapsed, output_tokens = _timed(llm, prompts, params, loras)
    result = {
        "elapsed_s": elapsed,
        "load_s": load_s,
        "prompt_tokens": sum(len(ids) for ids in job["prompts"]),
        "output_tokens": output_tokens,
        "version": getattr(vllm, "__version__", "unknown"),
    }
    if loras is not None:  # then the base alone, the same engine
        result["base_elapsed_s"], result["base_output_tokens"] = _timed(llm, prompts, params)
    print("kvflow-peer-result: " + json.dumps(result), flush=True)
    return 0


def _lora_options(lora):
    if lora is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": lora["max_lora_rank"],
            "max_loras": lora["max_loras"]}  # fmt: skip


def _lora_requests(lora, count):
    """The adapters round-robin over the prompts (as kvflow's lora_bench.py does)."""
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    adapters = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(lora["paths"])]
    return [adapters[i % len(adapters)] for i in range(count)]


def _timed(llm, prompts, params, loras=None):
    start = time.perf_counter()
    adapters = {} if loras is None else {"lora_request": loras}
    outputs = llm.generate(prompts, params, use_tqdm=False, **adapters)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


if __name__ == "__main__":
    sys.exit(main())
