"""gpt-oss against transformers on a tiny random-weight checkpoint in the HF layout:
attention sinks, a sliding layer (window 4, shorter than the prompts) beside a full one,
YaRN with `truncate: false`, q/k/v/o biases, and the MoE (router bias, softmax over the
top-k logits, expert biases, the clamped SwiGLU with a limit low enough to bite, gate/up
interleaved in the checkpoint). Every attention backend that runs sinks takes the paged
steps: torch, cpu (its native kernels route sink layers to the torch path) and triton
(interpreted on CPU). Weights are sharpened (large spread, a decisive router, a scaled-up
LM head) so that near-ties are rare; float32 throughout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_dense_families_parity import prompt
from transformers import AutoModelForCausalLM, GptOssConfig

from kvflow.gpu_worker.layers.moe import FusedMoE
from kvflow.gpu_worker.model_loader import load_model

YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}


def gpt_oss_config(vocab_size: int = 96, **overrides: Any) -> GptOssConfig:
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
        rope_parameters=YARN, swiglu_limit=1.0, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    return GptOssConfig(**{**fields, **overrides})


def sharpen_gpt_oss(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif "router" in name:
                param.copy_(0.6 * noise)  # decisive routing
            elif name.endswith("sinks"):
                param.copy_(1.0 + noise)  # sinks that take a real share
            else:
                param.copy_(0.15 * noise)
        model.get_output_embeddings().weight.mul_(3.0)


@pytest.fixture(scope="module")
def checkpoint(models_tmp: Path) -> tuple[Any, Path]:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(
        gpt_oss_config(), attn_implementation="eager"
    ).eval()
    sharpen_gpt_oss(hf_model, seed=1)
    path = models_tmp / "gpt-oss"
    hf_model.save_pretrained(path)
    return hf_model, path


@pytest.fixture(scope="module", params=["torch", "cpu", "triton"])
def kv_model(request: pytest.FixtureRequest, checkpoint: tuple[Any, Path]) -> torch.nn.Module:
    return load_model(checkpoint[1], torch.float32, torch.device("cpu"), request.param)


def test_layers_take_the_config_options(checkpoint, kv_model) -> None:
    layers = kv_model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [4, None]
    assert all(layer.self_attn.attn.sinks is not None for layer in layers)
    assert all(isinstance(layer.mlp, FusedMoE) for layer in layers)
    hf_sinks = checkpoint[0].model.layers[1].self_attn.sinks
    torch.testing.assert_close(layers[1].self_attn.attn.sinks, hf_sinks, rtol=0, atol=0)


def test_prefill_logits_and_logprobs_match_transformers(checkpoint, kv_model, prefill_logits):
    hf_model, _ = checkpoint
    tokens = prompt(21, seed=2)  # longer than the window (4) and YaRN's original context (16)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    actual = prefill_logits(kv_model, tokens)
    assert expected.std() > 0.5
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        actual.log_softmax(-1), expected.log_softmax(-1), atol=1e-4, rtol=1e-4
    )


def test_paged_mixed_batches_match_full_prefill(kv_model, paged_runner, prefill_logits) -> None:
    """Chunks over a cached prefix (past the window), decodes and a fresh prefill mixed
    across requests, on each backend, give the full-prefill logits."""
    a, b, c = prompt(19, seed=3), prompt(9, seed=4), prompt(6, seed=5)
    runner = paged_runner(kv_model, num_blocks=14, block_size=4)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    steps = [
        [("a", a[0:5]), ("b", b[0:7])],
        [("b", b[7:8]), ("a", a[5:9])],
        [("a", a[9:10]), ("c", c[0:6]), ("b", b[8:9])],
        [("a", a[10:11])],
        [("a", a[11:19])],  # a chunk past YaRN's original context (16)
    ]
    for chunks in steps:
        for (name, _), logits in zip(chunks, runner.step(chunks)):
            got[name].append(logits)
    for name, tokens in (("a", a), ("b", b), ("c", c)):
        expected = prefill_logits(kv_model, tokens)
        torch.testing.assert_close(torch.cat(got[name]), expected, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_and_logprobs_match_transformers(checkpoint, kv_model, paged_runner):
    hf_model, _ = checkpoint
    tokens = prompt(7, seed=6)  # past the window, and the output runs past YaRN's 16
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([tokens]), max_new_tokens=12, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    hf_tokens = out.sequences[0, 7:].tolist()
    hf_logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    runner = paged_runner(kv_model, num_blocks=8, block_size=4)
    logits = [runner.step([("r", tokens)])[0][-1]]
    generated = [int(logits[-1].argmax())]
    while len(generated) < 12:
        logits.append(runner.step([("r", generated[-1:])])[0][-1])
        generated.append(int(logits[-1].argmax()))
    assert generated == hf_tokens
    logprobs = torch.log_softmax(torch.stack(logits), dim=-1)
    torch.testing.assert_close(logprobs, hf_logprobs, atol=1e-4, rtol=1e-4)


def test_engine_chunked_prefill_prefix_hits_and_preemption_match_transformers(
    models_tmp: Path, embedded_model_dir: Path
) -> None:
    """One offline engine run (the cpu backend) with everything the window, the sinks and
    the paged cache must survive: prompts longer than the window, a token budget of 8
    (chunked prefill), a shared prefix (prefix-cache hits) and a cache too small for the
    batch (preemption)."""
    from test_dense_families_engine import MAX_TOKENS, hf_greedy
    from transformers import AutoTokenizer

    from kvflow import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gpt_oss_config(len(tokenizer)))
    sharpen_gpt_oss(model, seed=3)
    path = models_tmp / "gpt-oss-engine"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(100, 4000, (13,), generator=generator).tolist()
    prompts = [
        prefix + torch.randint(100, 4000, (n,), generator=generator).tolist() for n in (3, 6, 2, 5)
    ]
    expected = hf_greedy(path, prompts)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
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
