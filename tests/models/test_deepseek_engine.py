"""DeepSeek-V2/V3 through the real offline engine: greedy tokens must equal transformers'
generate at float32, in one run that mixes chunked prefill (a token budget of 8),
prefix-cache hits on a shared prompt prefix (the hit's latents decompressed from the
cache) and preemption by a latent cache too small for the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_deepseek_parity import MLA, YARN, sharpen
from test_dense_families_engine import MAX_TOKENS, hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config, DeepseekV3Config

from kvflow import LLM, SamplingParams
from kvflow.errors import ConfigError

ENGINE_MLA = {**MLA, "num_hidden_layers": 3}

CONFIGS = {
    "v2": lambda vocab: DeepseekV2Config(
        **{**ENGINE_MLA, "vocab_size": vocab},
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
    ),
    "v3": lambda vocab: DeepseekV3Config(
        **{**ENGINE_MLA, "vocab_size": vocab},
        q_lora_rank=24,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=YARN,
    ),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_chunked_prefill_prefix_hits_and_preemption_match_transformers(
    family: str, models_tmp: Path, embedded_model_dir: Path
) -> None:
    tokenizer: Any = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](len(tokenizer)))
    sharpen(model, seed=3)
    path = models_tmp / f"deepseek-{family}-engine"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(100, 4000, (13,), generator=generator).tolist()
    prompts = [
        prefix + torch.randint(100, 4000, (n,), generator=generator).tolist() for n in (3, 6, 2, 5)
    ]
    expected = hf_greedy(path, prompts)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # 12 blocks of 4 tokens: four requests of up to 29 tokens need up to 8 blocks each.
    llm = LLM(
        str(path), dtype="float32", device="cpu", max_num_batched_tokens=8, block_size=4,
        num_blocks=12,
    )  # fmt: skip
    first = llm.generate(prompts[:1], greedy)  # caches the shared prefix's blocks
    rest = llm.generate(prompts[1:], greedy)
    assert [o.token_ids for o in first + rest] == expected
    assert llm.engine.kv_cache.prefix_cache_hits > 0
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv_cache.check_integrity()
    runner = llm.engine.runner
    assert runner.kv_spec.planes == 1  # the latent layout
    assert runner.decode_graphs is None  # the torch MLA decode path plans on the host


def test_an_8bit_kv_cache_is_refused_at_start(tiny_model_dir: Any) -> None:
    with pytest.raises(ConfigError, match="latent attention"):
        LLM(str(tiny_model_dir("deepseekv3")), device="cpu", kv_cache_dtype="int8", num_blocks=8)
