"""vLLM's offline embeddings on inputs given as token ids: the peer run of
`kvflow bench embed --compare vllm`.

This file is run by the peer's own interpreter (a virtual environment with vLLM's CPU
or CUDA build), not imported by kvflow: it needs only the standard library and vllm.

    stdin:  {"model": dir, "dtype": "float32", "prompts": [[ids]], "max_num_seqs": n,
             "max_num_batched_tokens": n, "pooling_type": "LAST", "normalize": true,
             "seed": n}
    stdout: a line "kvflow-peer-result: " + {"elapsed_s", "load_s", "prompt_tokens",
             "num_embeddings", "hidden_size", "version"} (vLLM logs on stdout too)

vLLM's pooling runner with kvflow's pooler, prefix caching off (the warm-up shares the
inputs), one `LLM.embed` call over every input, timed as kvflow's run is timed.
"""

import json
import sys
import time
from typing import Any


def _pooler_config(config_type: Any, pooling_type: str, normalize: bool) -> Any:
    """vLLM's pooler options; releases from 0.32 call `normalize` `use_activation`."""
    try:
        return config_type(pooling_type=pooling_type, normalize=normalize)
    except (TypeError, ValueError):  # pydantic's ValidationError is a ValueError
        return config_type(pooling_type=pooling_type, use_activation=normalize)


def main() -> int:
    job = json.load(sys.stdin)
    import vllm
    from vllm import LLM
    from vllm.config import PoolerConfig

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        runner="pooling",
        dtype=job["dtype"],
        max_model_len=max(len(p) for p in job["prompts"]),
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        enable_prefix_caching=False,
        pooler_config=_pooler_config(PoolerConfig, job["pooling_type"], job["normalize"]),
        seed=job["seed"],
    )
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.embed(prompts[:2], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed(prompts, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = {
        "elapsed_s": elapsed,
        "load_s": load_s,
        "prompt_tokens": sum(len(ids) for ids in job["prompts"]),
        "num_embeddings": len(outputs),
        "hidden_size": len(outputs[0].outputs.embedding),
        "version": getattr(vllm, "__version__", "unknown"),
    }
    print("kvflow-peer-result: " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
