"""LLaVA through the offline engine: greedy tokens equal transformers' at float32, with
1 and 2 images per prompt, two tower resolutions and two input image sizes, a CLIP or a
SigLIP tower (feature layers and select strategies); chunked
prefill splitting an image's placeholder run; the encoder cache and the prefix cache on
a second turn; different images never sharing KV. (A text-only model's refusal of
images: tests/unit/test_chat_images.py.)"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from llava_fixture import make_llava_dir, random_image

from kvflow import LLM, SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
ONE = "USER: <image>\nWhat is this? ASSISTANT:"
TWO = "USER: <image> and <image>\nHow do they differ? ASSISTANT:"


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Any:
    made: dict[int, Path] = {}

    def make(size: int) -> Path:
        if size not in made:
            path = tmp_path_factory.mktemp(f"llava{size}")
            made[size] = make_llava_dir(path, embedded_model_dir, size)
        return made[size]

    return make


@pytest.fixture(scope="module")
def llava_dir(llava_dirs: Any) -> Path:
    return llava_dirs(28)  # type: ignore[no-any-return]


@functools.cache
def _hf(path: Path) -> tuple[Any, Any]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(path))
    model = LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    return processor, model.eval()


def hf_greedy(path: Path, prompt: str, images: list[Any]) -> tuple[list[int], list[int]]:
    """(transformers' expanded prompt ids, its greedy continuation)."""
    processor, model = _hf(path)
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids) :].tolist()


CASES = {
    "one-small": (ONE, [(1, 40, 30)]),
    "one-large": (ONE, [(2, 90, 70)]),
    "two-mixed": (TWO, [(3, 40, 30), (4, 90, 70)]),
}


PRESSURE = {"async_scheduling": True, "num_blocks": 12}  # two steps in flight, preemption


@pytest.mark.parametrize(
    ("tower", "budget", "options"),
    [(28, 2048, {}), (42, 2048, {}), (42, 5, {}), (42, 5, PRESSURE)],
    ids=["28", "42", "42-chunked", "42-chunked-async-preempted"],
)
def test_greedy_parity(llava_dirs: Any, tower: int, budget: int, options: dict[str, Any]) -> None:
    """Every case in one engine run (batched). A 5-token budget makes chunked prefill
    cut the 9-token placeholder runs, and each chunk must get its slice; with 12 KV
    blocks requests are preempted and resume with their images."""
    llava_dir = llava_dirs(tower)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": [random_image(*s) for s in sizes]}}
        for text, sizes in CASES.values()
    ]
    expected = [hf_greedy(llava_dir, p["prompt"], p["multi_modal_data"]["image"]) for p in prompts]
    llm = LLM(
        str(llava_dir), dtype="float32", device="cpu", max_num_batched_tokens=budget,
        block_size=4, enable_prefix_caching=False, **options,
    )  # fmt: skip
    outputs = llm.generate(prompts, GREEDY)
    if options:
        assert llm.engine.core.scheduler.num_preemptions > 0
    for output, (prompt_ids, tokens) in zip(outputs, expected):
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == tokens
    llm.close()


SIGLIP = {  # tower size, (feature layer, strategy), step budget (5: chunked prefill)
    "28-last-full": (28, -1, "full", 2048),
    "42-second-default-chunked": (42, -2, "default", 5),
    "28-layers-full-chunked": (28, [-3, -1], "full", 5),
}


@pytest.mark.parametrize("case", list(SIGLIP))
def test_siglip_greedy_parity(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path, case: str
) -> None:
    """A SigLIP tower: the tower's image processor (fixed-size resize, 0.5 mean/std),
    no class token, learned positions; 1 and 2 images in one batched run."""
    tower, layer, strategy, budget = SIGLIP[case]
    path = make_llava_dir(
        tmp_path_factory.mktemp("siglip"), embedded_model_dir, tower, tower="siglip",
        feature_layer=layer, strategy=strategy,
    )  # fmt: skip
    cases = [CASES["one-small"], CASES["two-mixed"]]
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": [random_image(*s) for s in sizes]}}
        for text, sizes in cases
    ]
    expected = [hf_greedy(path, p["prompt"], p["multi_modal_data"]["image"]) for p in prompts]
    llm = LLM(
        str(path), dtype="float32", device="cpu", max_num_batched_tokens=budget,
        block_size=4, enable_prefix_caching=False,
    )  # fmt: skip
    for output, (prompt_ids, tokens) in zip(llm.generate(prompts, GREEDY), expected):
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == tokens
    llm.close()


@pytest.fixture(scope="module")
def llm(llava_dir: Path) -> Iterator[LLM]:
    engine = LLM(str(llava_dir), dtype="float32", device="cpu", block_size=4)
    yield engine
    engine.close()


def test_second_turn_hits_both_caches(llm: LLM, llava_dir: Path) -> None:
    cache = llm.engine.runner.images.cache  # type: ignore[union-attr]
    image_token = llm.engine.runner.model.image_token_id
    hits, misses = cache.hits, cache.misses
    counters = llm.engine.core.counters  # what the engine's stats export as metrics
    queries, counted_hits = counters.mm_encoder_cache_queries, counters.mm_encoder_cache_hits
    image = random_image(7, 60, 50)
    first = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert (cache.hits - hits, cache.misses - misses) == (0, 1)
    # The next turn: the same image, the first turn's answer, a new question. Its KV
    # past the image comes from the prefix cache (nothing to encode there).
    answer = llm.tokenizer.decode(first.outputs[0].token_ids)
    second = ONE + answer + " USER: Sure? ASSISTANT:"
    out = llm.generate({"prompt": second, "multi_modal_data": {"image": image}}, GREEDY)[0]
    last_image_token = len(first.prompt_token_ids) - first.prompt_token_ids[::-1].index(image_token)
    assert out.num_cached_tokens >= last_image_token
    assert list(out.outputs[0].token_ids) == hf_greedy(llava_dir, second, [image])[1]
    # Other text before the same image: its KV must be computed, its features are cached.
    other_text = "SYSTEM: be brief. " + ONE
    llm.generate({"prompt": other_text, "multi_modal_data": {"image": image}}, GREEDY)
    assert (cache.hits - hits, cache.misses - misses) == (1, 1)
    # The prefix-cached second turn looked nothing up.
    assert counters.mm_encoder_cache_queries - queries == 2
    assert counters.mm_encoder_cache_hits - counted_hits == 1


def test_encoder_cache_counts_an_image_once_when_chunked(llava_dir: Path) -> None:
    """A 5-token budget splits each 9-row placeholder run over steps: one query per image
    a request places (the later chunks read the features the first one encoded); the
    same image again, twice in one prompt, is two hits."""
    llm = LLM(
        str(llava_dir), dtype="float32", device="cpu", max_num_batched_tokens=5,
        block_size=4, enable_prefix_caching=False,
    )  # fmt: skip
    image = random_image(10, 40, 30)
    llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY)
    counters = llm.engine.core.counters
    assert (counters.mm_encoder_cache_queries, counters.mm_encoder_cache_hits) == (1, 0)
    llm.generate({"prompt": TWO, "multi_modal_data": {"image": [image, image]}}, GREEDY)
    assert (counters.mm_encoder_cache_queries, counters.mm_encoder_cache_hits) == (3, 2)
    llm.close()


def test_different_images_never_share_kv(llm: LLM, llava_dir: Path) -> None:
    image_a, image_b = random_image(8, 50, 50), random_image(9, 50, 50)
    prompt = "USER: Look closely at this picture please: <image>\nWhat is it? ASSISTANT:"
    llm.generate({"prompt": prompt, "multi_modal_data": {"image": image_a}}, GREEDY)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image_b}}, GREEDY)[0]
    first_image_token = out.prompt_token_ids.index(llm.engine.runner.model.image_token_id)
    # Only whole blocks before the image's run are shared.
    assert 0 < out.num_cached_tokens <= first_image_token
    assert list(out.outputs[0].token_ids) == hf_greedy(llava_dir, prompt, [image_b])[1]
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image_b}}, GREEDY)[0]
    assert again.num_cached_tokens > first_image_token


def test_chat_takes_image_parts_as_the_server_does(llm: LLM, llava_dir: Path) -> None:
    """LLM.chat: an image as a data: URL and one as a PIL image, in the parts' order,
    give transformers' greedy tokens on the chat template's text."""
    image_a, image_b = random_image(11, 40, 30), random_image(12, 60, 50)
    buffer = io.BytesIO()
    image_a.save(buffer, format="PNG")  # type: ignore[attr-defined]
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "and"},
        {"type": "image_pil", "image_pil": image_b},
        {"type": "text", "text": "How do they differ?"},
    ]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY)[0]
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "<image>\nand\n<image>\nHow do they differ?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_ids, tokens = hf_greedy(llava_dir, text, [image_a, image_b])
    assert out.prompt_token_ids == prompt_ids
    assert list(out.outputs[0].token_ids) == tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_encoder_budget_spreads_images_over_steps(
    llava_dirs: Any, tmp_path: Path, async_scheduling: bool
) -> None:
    """Six image requests at once (9 features each, one shared) under a budget of 10
    features a step: the trace shows at most one image encoded per step, every image
    encoded once, and the tokens equal an unbudgeted run's."""
    import json

    path = llava_dirs(42)
    images = [random_image(20 + n % 5, 40, 30) for n in range(6)]  # 5 different
    prompts = [{"prompt": ONE, "multi_modal_data": {"image": image}} for image in images]
    outputs = {}
    for budget in (2048, 10):
        llm = LLM(
            str(path), dtype="float32", device="cpu", block_size=4,
            max_num_encoder_input_tokens=budget, async_scheduling=async_scheduling,
        )  # fmt: skip
        trace = tmp_path / f"trace{budget}.json"
        llm.engine.start_trace(trace)
        outputs[budget] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
        llm.engine.stop_trace()
        events = json.loads(trace.read_text())
        per_step = [e["args"]["computed"] for e in events if e["name"] == "encoder_tokens"]
        assert sum(per_step) == llm.engine.core.counters.mm_encoder_tokens == 5 * 9
        assert max(per_step) == (9 if budget == 10 else 5 * 9)
        llm.close()
    assert outputs[10] == outputs[2048]
