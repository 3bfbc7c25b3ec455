"""`kvflow run-batch` lines that name an adapter through `model` run under it: the batch
runner's engine client takes every argument the server's handlers pass (LoRA included)."""

from __future__ import annotations

import json
from pathlib import Path

from lora_adapters import MAX_TOKENS, PROMPTS

from kvflow import LLM
from kvflow.cli.run_batch import run_lines

Reference = dict[str | None, list[list[int]]]


def _line(custom_id: str, model: str, prompt: list[int]) -> bytes:
    body = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                ignore_eos=True, return_token_ids=True)  # fmt: skip
    line = dict(custom_id=custom_id, method="POST", url="/v1/completions", body=body)
    return json.dumps(line).encode()


def test_batch_lines_run_under_their_adapter(
    lora_base: Path, lora_adapters: dict[str, Path], peft_reference: Reference
) -> None:
    llm = LLM(
        str(lora_base), dtype="float32", device="cpu", num_threads=1, num_blocks=64,
        enable_lora=True, max_loras=2, max_lora_rank=8,
        lora_modules=[f"{name}={path}" for name, path in lora_adapters.items()],
    )  # fmt: skip
    base = llm.engine.config.model.served_model_name or str(lora_base)
    models = {None: base, "a1": "a1", "a2": "a2"}
    order = [None, "a1", "a2", "a1"]
    lines = [_line(f"r{i}", models[n], PROMPTS[i % 2]) for i, n in enumerate(order)]
    records = [json.loads(out) for out in run_lines(llm, lines)]
    for i, (name, record) in enumerate(zip(order, records, strict=True)):
        assert record["error"] is None, record
        choice = record["response"]["body"]["choices"][0]
        assert choice["token_ids"] == peft_reference[name][i % 2], (name, record)
