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


@pytest.mark.slow
def test_latent_blocks_go_from_a_prefill_to_a_decode_instance(
    tiny_model_dir: Any, tmp_path: Path
) -> None:
    """P/D over shared storage: the consumer loads the producer's latent blocks (saved
    layer by layer) and decodes what a colocated engine decodes."""
    path = str(tiny_model_dir("deepseekv2"))
    prompts = [list(range(100, 119)), [7, 8, 9]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    options: dict[str, Any] = dict(dtype="float32", device="cpu", num_blocks=32, block_size=4)

    def kv(role: str) -> dict[str, Any]:
        return {
            "kv_role": role,
            "kv_connector": "shared-storage",
            "kv_connector_extra_config": {"storage_path": str(tmp_path)},
        }

    colocated_llm = LLM(path, **options)
    colocated_tokens = _count_computed(colocated_llm)
    colocated = [o.token_ids for o in colocated_llm.generate(prompts, greedy)]
    producer = LLM(path, kv_transfer_config=kv("kv_producer"), **options)
    producer.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    assert list(tmp_path.rglob("*.kv"))
    consumer = LLM(path, kv_transfer_config=kv("kv_consumer"), **options)
    consumer_tokens = _count_computed(consumer)
    assert [o.token_ids for o in consumer.generate(prompts, greedy)] == colocated
    assert sum(consumer_tokens) < sum(colocated_tokens)  # the loaded prompt blocks


def _count_computed(llm: LLM) -> list[int]:
    """Tokens each executed step computes (wraps the runner)."""
    runner, counts = llm.engine.runner, []
    execute = runner.execute

    def counting(plan: Any) -> Any:
        counts.append(plan.total_num_scheduled_tokens)
        return execute(plan)

    runner.execute = counting  # type: ignore[method-assign]
    return counts
