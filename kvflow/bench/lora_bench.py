"""`kvflow bench throughput --lora-adapters N`: the same prompts on the base alone and
spread over N adapters (round-robin), in one sitting, plus the load latency of one
adapter and the memory of one slot.

The adapters are synthetic PEFT directories (random A and B of `--lora-adapter-rank`
on all seven targets; the attention's four on a mixture-of-experts base), written to a
temporary directory, so the benchmark needs nothing but the base model.

With `--compare vllm` vLLM's peer (vllm_peer.py) runs the same prompts over the same
adapter directories, then on its base alone, in one engine: four results, and the
adapted / base ratio of each server.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvflow.lora_files import ATTENTION_TARGETS, MLP_TARGETS, BaseShapes
from kvflow.proto.lora import LoRARequest


def make_adapters(
    model_dir: Path, out_dir: Path, count: int, rank: int, seed: int = 0
) -> list[Path]:
    """`count` random PEFT adapters of the base in `model_dir`."""
    from safetensors.torch import save_file

    base = BaseShapes.from_model_dir(model_dir)
    targets = ATTENTION_TARGETS if base.is_moe else ATTENTION_TARGETS + MLP_TARGETS
    generator = torch.Generator().manual_seed(seed)
    paths = []
    for index in range(count):
        path = out_dir / f"adapter{index}"
        path.mkdir(parents=True)
        tensors = {}
        for layer in range(base.num_layers):
            for module in targets:
                fan_in, fan_out = base.dims(module)
                part = "self_attn" if module in ATTENTION_TARGETS else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, fan_in, generator=generator) * 0.01
                )
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(fan_out, rank, generator=generator) * 0.01
                )
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths


def lora_engine_options(options: dict[str, Any], count: int, rank: int) -> dict[str, Any]:
    """The engine options with LoRA on: every adapter fits one step unless set lower."""
    return {
        **options,
        "enable_lora": True,
        "max_lora_rank": rank,
        "max_loras": options.get("max_loras", count),
    }


def lora_requests(paths: list[Path], num_prompts: int) -> list[LoRARequest | None]:
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    return [adapters[i % len(adapters)] for i in range(num_prompts)]


def load_stats(llm: Any, path: Path) -> dict[str, float]:
    """Seconds to read one adapter and copy it into a slot (in this process's runner),
    and the bytes of one slot over every adapted projection."""
    manager = llm.engine.runner.lora.manager
    adapter = LoRARequest("load-probe", 10**6, str(path))
    start = time.perf_counter()
    manager.slots_for([adapter])
    elapsed = time.perf_counter() - start
    manager.forget(adapter.lora_int_id)
    return {"adapter_load_s": round(elapsed, 4), "slot_mib": round(manager.slot_bytes / 2**20, 2)}


def temporary_adapters(
    model_dir: Path, count: int, rank: int
) -> tuple[tempfile.TemporaryDirectory[str], list[Path]]:
    folder = tempfile.TemporaryDirectory(prefix="kvflow-lora-bench-")
    return folder, make_adapters(model_dir, Path(folder.name), count, rank)


def vllm_lora_job(
    job: dict[str, Any], paths: list[Path], rank: int, max_loras: int
) -> dict[str, Any]:
    """kvflow's vLLM job (throughput.vllm_job) with the same adapters and slots."""
    lora = {"paths": [str(p) for p in paths], "max_lora_rank": rank, "max_loras": max_loras}
    return {**job, "lora": lora}


def ratios(results: list[Any]) -> dict[str, float]:
    """Adapted / base output tok/s of each server, and kvflow / vLLM with adapters
    (results: kvflow adapted, kvflow base[, vLLM adapted, vLLM base])."""
    rate = [r.output_tokens_per_s for r in results]
    out = {"kvflow_lora_over_base": round(rate[0] / rate[1], 3)}
    if len(rate) == 4:
        out["vllm_lora_over_base"] = round(rate[2] / rate[3], 3)
        out["kvflow_over_vllm_lora"] = round(rate[0] / rate[2], 3)
        out["kvflow_over_vllm_base"] = round(rate[1] / rate[3], 3)
    return out
