"""Qwen2.5-VL through the offline engine: the frontend's preprocessing and M-RoPE
positions equal transformers'; greedy tokens equal transformers' at float32 with 1 and
2 images per prompt and two image sizes, on the CPU-native and torch attention backends
(Triton: tests/kernels/test_engine_triton.py); chunked prefill splitting an image's
placeholder run, with preemption; the prefix cache and the encoder cache on a second turn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llava_fixture import random_image
from qwen_vl_fixture import IMAGE, _hf, hf_expand, hf_greedy, make_qwen_vl_dir

from kvflow import LLM, SamplingParams
from kvflow.mrope import mrope_positions, positions_array
from kvflow.qwen_vl_images import QwenVLImagePrompter

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
ONE = f"User: {IMAGE}\nWhat is this? Assistant:"
TWO = f"User: {IMAGE} and {IMAGE}\nHow do they differ? Assistant:"
SMALL, LARGE = (40, 30), (200, 150)  # 2 x 3 and 5 x 7 merged patches (1 and 6 windows)


@pytest.fixture(scope="module")
def qwen_vl_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Path:
    return make_qwen_vl_dir(tmp_path_factory.mktemp("qwen_vl"), embedded_model_dir)


@pytest.mark.parametrize("size", [SMALL, LARGE, (90, 400)])
def test_preprocessing_matches_transformers(qwen_vl_dir: Path, size: tuple[int, int]) -> None:
    image = random_image(5, *size)
    prompter = QwenVLImagePrompter(qwen_vl_dir)
    tokenizer = _hf(qwen_vl_dir)[0]
    ids, inputs = hf_expand(qwen_vl_dir, ONE, [image])
    expanded = prompter.expand(tokenizer.encode(ONE), [image])
    assert expanded.token_ids == ids
    (ours,) = expanded.images
    assert ours.grid_thw == inputs["image_grid_thw"][0].tolist()
    pixels = np.frombuffer(ours.pixels.data, dtype="<f4").reshape(ours.pixels.shape)
    np.testing.assert_allclose(pixels, inputs["pixel_values"].numpy(), rtol=0, atol=1e-5)


def test_mrope_positions_match_transformers(qwen_vl_dir: Path) -> None:
    images = [random_image(1, *LARGE), random_image(2, *SMALL)]
    tokenizer, _, model = _hf(qwen_vl_dir)
    expanded = QwenVLImagePrompter(qwen_vl_dir).expand(tokenizer.encode(TWO), images)
    ids, inputs = hf_expand(qwen_vl_dir, TWO, images)
    input_ids = torch.tensor([ids])
    types = (input_ids == model.config.image_token_id).int()
    want, delta = model.model.get_rope_index(input_ids, types, inputs["image_grid_thw"])
    assert expanded.mrope is not None
    assert positions_array(expanded.mrope).tolist() == want[:, 0].tolist()
    assert expanded.mrope.delta == int(delta) < 0
    text_only = mrope_positions(5, [], 2)
    assert (positions_array(text_only).tolist(), text_only.delta) == ([list(range(5))] * 3, 0)


CASES = {
    "one-small": (ONE, [(1, *SMALL)]),
    "one-large": (ONE, [(2, *LARGE)]),
    "two-mixed": (TWO, [(3, *SMALL), (4, *LARGE)]),
    "text-only": ("User: no picture here. Assistant:", []),
}
PRESSURE = {"async_scheduling": True, "num_blocks": 16}  # two steps in flight, preemption
# A fixed KV cache: the default's 2 GiB need not be free on a busy test host.
BLOCKS = {"num_blocks": 256}


def _prompts() -> list[dict[str, Any]]:
    return [
        {"prompt": text, "multi_modal_data": {"image": [random_image(*s) for s in sizes]}}
        for text, sizes in CASES.values()
    ]


@pytest.fixture(scope="module")
def expected(qwen_vl_dir: Path) -> list[tuple[list[int], list[int]]]:
    """transformers' (prompt ids, greedy tokens) of each case, once for every variant."""
    return [
        hf_greedy(qwen_vl_dir, p["prompt"], p["multi_modal_data"]["image"], MAX_TOKENS)
        for p in _prompts()
    ]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize(
    ("budget", "options"),
    [(2048, {}), (7, {}), (7, PRESSURE)],
    ids=["whole", "chunked", "chunked-async-preempted"],
)
def test_greedy_parity(
    qwen_vl_dir: Path,
    expected: list[tuple[list[int], list[int]]],
    backend: str,
    budget: int,
    options: dict[str, Any],
) -> None:
    """Every case in one engine run (batched, text-only beside images). A 7-token budget
    cuts the 6- and 35-token placeholder runs; each chunk must get its slice of the
    features and of the positions. With 16 KV blocks (the longest request fills them)
    requests are preempted and resume."""
    prompts = _prompts()
    llm = LLM(
        str(qwen_vl_dir), dtype="float32", device="cpu", max_num_batched_tokens=budget,
        block_size=4, enable_prefix_caching=False, attention_backend=backend,
        **{**BLOCKS, **options},
    )  # fmt: skip
    outputs = llm.generate(prompts, GREEDY)
    if "async_scheduling" in options:
        assert llm.engine.core.scheduler.num_preemptions > 0
    graphs = llm.engine.runner.decode_graphs
    if graphs is not None:  # decodes beside image requests replay (M-RoPE's rows agree)
        assert graphs.num_replays > 0
    for output, (prompt_ids, tokens) in zip(outputs, expected):
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == tokens
    llm.close()


@pytest.fixture(scope="module")
def llm(qwen_vl_dir: Path) -> Iterator[LLM]:
    engine = LLM(str(qwen_vl_dir), dtype="float32", device="cpu", block_size=4, **BLOCKS)
    yield engine
    engine.close()


def test_second_turn_hits_both_caches(llm: LLM, qwen_vl_dir: Path) -> None:
    """The next turn reuses the first's KV past the image (the prefix cache) and its
    positions stay right after the hit; the same image after other text is an encoder
    cache hit, its KV computed at the new positions."""
    cache = llm.engine.runner.images.cache  # type: ignore[union-attr]
    counters = llm.engine.core.counters
    hits, misses = cache.hits, cache.misses
    queries, counted_hits = counters.mm_encoder_cache_queries, counters.mm_encoder_cache_hits
    image = random_image(7, *LARGE)
    first = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert (cache.hits - hits, cache.misses - misses) == (0, 1)
    answer = llm.tokenizer.decode(first.outputs[0].token_ids)
    second = ONE + answer + " User: Sure? Assistant:"
    out = llm.generate({"prompt": second, "multi_modal_data": {"image": image}}, GREEDY)[0]
    pad = llm.engine.runner.model.image_token_id
    last_image_token = len(first.prompt_token_ids) - first.prompt_token_ids[::-1].index(pad)
    assert out.num_cached_tokens >= last_image_token
    assert list(out.outputs[0].token_ids) == hf_greedy(qwen_vl_dir, second, [image], MAX_TOKENS)[1]
    other = "System: be brief. " + ONE
    out = llm.generate({"prompt": other, "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(qwen_vl_dir, other, [image], MAX_TOKENS)[1]
    assert (cache.hits - hits, cache.misses - misses) == (1, 1)
    assert counters.mm_encoder_cache_queries - queries == 2  # the cached turn looked nothing up
    assert counters.mm_encoder_cache_hits - counted_hits == 1


def test_chat_shows_image_parts_as_vision_placeholders(llm: LLM, qwen_vl_dir: Path) -> None:
    """LLM.chat renders each image part as <|vision_start|><|image_pad|><|vision_end|>."""
    image_a, image_b = random_image(11, *SMALL), random_image(12, *LARGE)
    parts = [
        {"type": "image_pil", "image_pil": image_a},
        {"type": "text", "text": "and"},
        {"type": "image_pil", "image_pil": image_b},
        {"type": "text", "text": "How do they differ?"},
    ]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY)[0]
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{IMAGE}\nand\n{IMAGE}\nHow do they differ?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_ids, tokens = hf_greedy(qwen_vl_dir, text, [image_a, image_b], MAX_TOKENS)
    assert out.prompt_token_ids == prompt_ids
    assert list(out.outputs[0].token_ids) == tokens
