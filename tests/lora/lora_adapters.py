"""Tiny PEFT adapters for the LoRA tests (imported by name: pytest puts this folder on
sys.path), and PEFT's own greedy tokens as the reference."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

# Two prompts long enough to fill KV blocks of 16 (prefix-cache tests) and short ones.
PROMPTS = [
    [5, 17, 300, 42, 9, 11, 600, 7, 8, 90, 4000, 12, 13, 77, 1500, 3, 66, 5, 17, 300],
    [100, 200, 300, 400, 500, 600],
]
MAX_TOKENS = 6

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets: Sequence[str] = ALL_TARGETS,
    use_rslora: bool = False,
    scale: float = 0.2,
) -> Path:
    """A PEFT adapter of `base_dir` with random, non-zero A and B, saved to `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
        lora_dropout=0.0,
    )  # fmt: skip
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def peft_greedy(
    base_dir: Path, adapter_dir: Path | None, prompts: Sequence[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy tokens of PEFT's model (the base alone when `adapter_dir` is None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                pad_token_id=0,
            )  # fmt: skip
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
