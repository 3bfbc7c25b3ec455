"""Beam search through the offline engine agrees with transformers' `generate(num_beams=k)`
token for token (float32, a tiny random-weight Llama with sharpened weights), for several
widths, length penalties and early-stopping rules, with and without a stop token reached,
with async scheduling on; and the beams really share their KV blocks (counted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.sampling_params import BeamSearch, BeamSearchParams
from kvflow.services.scheduler.beam_feature import BeamSearchFeature

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 10


def sharpen(model: torch.nn.Module, seed: int) -> None:
    """Large random weights and a scaled-up LM head: the beams' scores are far from ties."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
        model.get_output_embeddings().weight.mul_(2.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Any:
    """(HF model in float32, its directory with the embedded tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    sharpen(hf_model, seed=3)
    path = tmp_path_factory.mktemp("beam-llama")
    hf_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf_model, path


def hf_search(
    hf_model: Any, prompt: list[int], stop_id: int | None, **beam: Any
) -> tuple[list[list[int]], list[float]]:
    """transformers' returned sequences (generated tokens only, up to the stop token) and
    their scores."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=MAX_TOKENS, eos_token_id=stop_id, pad_token_id=0,
            return_dict_in_generate=True, output_scores=True, **beam,
        )  # fmt: skip
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    sequences = out.sequences.tolist()
    return [s[len(prompt) : len(prompt) + n] for s, n in zip(sequences, lengths)], (
        out.sequences_scores.tolist()
    )


def hf_beams(hf_model: Any, prompt: list[int], stop_id: int | None, **beam: Any) -> list[list[int]]:
    return hf_search(hf_model, prompt, stop_id, **beam)[0]


def params(n: int, width: int, stop_id: int | None, **beam: Any) -> SamplingParams:
    return SamplingParams(
        n=n, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
        stop_token_ids=None if stop_id is None else [stop_id],
        beam_search=BeamSearch(beam_width=width, **beam),
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm(model: Any) -> LLM:
    return LLM(str(model[1]), dtype="float32", device="cpu", num_threads=1, num_blocks=256)


@pytest.fixture(scope="module")
def async_llm(model: Any) -> LLM:
    return LLM(
        str(model[1]), dtype="float32", device="cpu", num_threads=1, num_blocks=256,
        async_scheduling=True, block_size=4,
    )  # fmt: skip


CASES = [  # (width, n, length_penalty, early_stopping)
    (2, 1, 1.0, False),
    (3, 2, 0.0, True),
    (4, 4, 2.0, "never"),
    (4, 2, -1.0, False),
]


@pytest.mark.parametrize("engine", ["llm", "async_llm"])
@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop-token"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-n{c[1]}-lp{c[2]}-es{c[3]}")
def test_matches_transformers(
    model: Any, request: pytest.FixtureRequest, engine: str, stop: bool, case: tuple[Any, ...]
) -> None:
    hf_model, _ = model
    llm: LLM = request.getfixturevalue(engine)
    width, n, length_penalty, early_stopping = case
    beam = dict(length_penalty=length_penalty, early_stopping=early_stopping)
    for prompt in PROMPTS:
        ids = list(llm.tokenizer.encode(prompt))
        stop_id = None
        if stop:  # a token the free search writes early, so that some beams stop on it
            stop_id = hf_beams(hf_model, ids, None, num_beams=width, **beam)[0][2]
        expected, hf_scores = hf_search(
            hf_model, ids, stop_id, num_beams=width, num_return_sequences=n, **beam
        )
        out = llm.generate([ids], params(n, width, stop_id, **beam))[0]
        got = [list(c.token_ids) for c in out.outputs]
        assert got == expected, (prompt, got, expected)
        # The beams' logprob sums: transformers' scores times length ** length_penalty.
        scores = [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in out.outputs]
        assert scores == pytest.approx(hf_scores, rel=1e-4, abs=1e-4)
        if stop:
            if length_penalty <= 1.0:  # (a penalty > 1 may prefer the beams that go on)
                assert any(seq[-1] == stop_id for seq in got)
            assert all(c.finish_reason == ("stop" if c.token_ids[-1] == stop_id else "length")
                       for c in out.outputs)  # fmt: skip


def test_llm_beam_search_api(llm: LLM, model: Any) -> None:
    """vLLM's `LLM.beam_search(prompts, BeamSearchParams(...))`: every beam, best first."""
    hf_model, _ = model
    ids = list(llm.tokenizer.encode(PROMPTS[0]))
    (output,) = llm.beam_search(
        [{"prompt": PROMPTS[0]}], BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    )
    expected = hf_beams(hf_model, ids, None, num_beams=3, num_return_sequences=3)
    assert [s.tokens[len(ids) :] for s in output.sequences] == expected
    assert all(s.tokens[: len(ids)] == ids for s in output.sequences)
    assert output.sequences[0].text == llm.tokenizer.decode(output.sequences[0].tokens)
    assert output.sequences[0].cum_logprob > output.sequences[2].cum_logprob


def _beam_ids(llm: LLM) -> list[str]:
    return [r for r in llm.engine.scheduler.requests if "#beam" in r]


def test_beams_share_prompt_blocks_and_copy_only_the_partial_one(model: Any) -> None:
    """9 prompt tokens in blocks of 4: after the first fork every beam holds 3 blocks,
    the 2 full prompt blocks shared by all (one reference per beam) and a partial block
    of its own (the forks' copied from the parent's); only new tokens are computed."""
    llm = LLM(str(model[1]), dtype="float32", device="cpu", num_threads=1,
              num_blocks=64, block_size=4)  # fmt: skip
    engine, width = llm.engine, 4
    prompt = list(range(100, 109))
    engine.add_request("r", prompt, params(width, width, None, length_penalty=1.0))
    kv = engine.kv_cache
    engine.step()  # the prompt's prefill, one beam; it reports and the beams fork
    beams = _beam_ids(llm)
    tables = [kv.get_block_ids(b) for b in beams]
    assert len(beams) == width and all(len(t) == 3 for t in tables)
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1
    assert len({t[2] for t in tables}) == width  # private partial blocks
    assert kv.num_blocks - kv.num_free_blocks == 2 + width  # not 3 * width
    shared = kv.block_pool.blocks[tables[0][0]]
    assert shared.ref_cnt == width
    feature = engine.scheduler.feature(BeamSearchFeature)
    assert feature is not None and feature.num_forks == width - 1
    kv.check_integrity()
    engine.step()  # the forks' first step: their copies are made, one token each
    # Computed: the prompt once, then one token per beam per step (no recompute).
    assert engine.core.counters.step_tokens[:2] == [len(prompt), width]
    while engine.has_unfinished_requests():
        engine.step()
    assert max(engine.core.counters.step_tokens[1:]) <= width
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and not engine.scheduler.requests


def test_preempted_group_recomputes_and_frees_everything(model: Any) -> None:
    """A cache too small for the group and a plain request at once: beams are preempted
    (the whole group, by recompute) and the result is still transformers'."""
    hf_model, path = model
    llm = LLM(str(path), dtype="float32", device="cpu", num_threads=1,
              num_blocks=11, block_size=4)  # fmt: skip
    ids = list(llm.tokenizer.encode(PROMPTS[1]))
    expected = hf_beams(hf_model, ids, None, num_beams=3, num_return_sequences=3)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([ids * 3, ids], [plain, params(3, 3, None)])
    assert [list(c.token_ids) for c in outputs[1].outputs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv_cache
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and not llm.engine.scheduler.requests


def test_abort_frees_every_beam(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("gone", PROMPTS[0], params(2, 4, None))
    for _ in range(3):
        engine.step()
    assert len(_beam_ids(llm)) == 4
    engine.abort_request("gone")
    kv = engine.kv_cache
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and not engine.scheduler.requests
    assert not engine.has_unfinished_requests()


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_beams_match_transformers(model: Any) -> None:
    """TP=2 ranks each copy their shard of a forked block; the beams stay transformers'."""
    hf_model, path = model
    llm = LLM(str(path), dtype="float32", device="cpu", num_threads=1, num_blocks=64,
              block_size=4, tensor_parallel_size=2)  # fmt: skip
    try:
        ids = list(llm.tokenizer.encode(PROMPTS[0]))
        expected = hf_beams(hf_model, ids, None, num_beams=3, num_return_sequences=2)
        out = llm.generate([ids], params(2, 3, None))[0]
        assert [list(c.token_ids) for c in out.outputs] == expected
    finally:
        llm.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_groups_competing_for_a_small_cache_keep_their_beams(
    model: Any, async_scheduling: bool
) -> None:
    """Two searches and a plain request in a cache that holds each alone but not all at
    once: forks that do not fit make their round recompute, beams get preempted, and
    every output is the one an ample cache gives; nothing is left held."""
    _, path = model
    prompts = [list(range(5, 11)), list(range(11, 20)), [20, 21, 22]]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    beams = [SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True,
                            beam_search=BeamSearch(beam_width=w)) for w in (3, 2)]  # fmt: skip
    results, pressure = [], 0
    for num_blocks in (64, 13):
        llm = LLM(str(path), dtype="float32", device="cpu", num_threads=1, block_size=4,
                  num_blocks=num_blocks, async_scheduling=async_scheduling)  # fmt: skip
        outputs = llm.generate(prompts, [*beams, plain])
        results.append([[list(c.token_ids) for c in o.outputs] for o in outputs])
        kv = llm.engine.kv_cache
        kv.check_integrity()
        assert kv.num_free_blocks == num_blocks and not llm.engine.scheduler.requests
        feature = llm.engine.scheduler.feature(BeamSearchFeature)
        assert feature is not None
        pressure = llm.engine.scheduler.num_preemptions + feature.num_recomputed_rounds
    assert results[0] == results[1]
    assert pressure > 0  # the small cache did push back
