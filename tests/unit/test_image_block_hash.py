"""Images in the prefix cache's block hashes: a block covering any placeholder token of
an image carries that image's hash, so the same text with different images never shares
a block from the image on, and the same image with the same text does. Also the
scheduler side: admission checks the spans, and a new request carries only the images
its prefill has still to compute."""

from __future__ import annotations

import pytest

from kvflow.block_hash import extend_block_hashes, image_keys
from kvflow.errors import InvalidRequestError
from kvflow.proto.engine import AddRequest
from kvflow.proto.multimodal import ImageInput, PixelTensor
from kvflow.proto.sampling import SamplingParams
from kvflow.services.scheduler.admission import check_image_spans

TOKENS = list(range(100, 124))  # 6 blocks of 4; the image's run is tokens 6..13
IMAGE = 99


def hashes(spans: list[tuple[int, int, str]]) -> list[bytes]:
    return extend_block_hashes([], TOKENS, 4, None, spans)


def test_image_keys_cover_exactly_the_overlapping_blocks() -> None:
    spans = [(6, 8, "a"), (16, 2, "b")]
    assert [image_keys(spans, s, s + 4) for s in range(0, 24, 4)] == [
        (), ("a",), ("a",), ("a",), ("b",), (),
    ]  # fmt: skip


def test_same_text_other_image_shares_only_the_blocks_before_it() -> None:
    plain, a, b = hashes([]), hashes([(6, 8, "a")]), hashes([(6, 8, "b")])
    assert a[0] == b[0] == plain[0]  # block 0 ends before the image
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # chained: every later block differs
    assert hashes([(6, 8, "a")]) == a  # the same image and text: the same keys


def image(offset: int, length: int, key: str = "h") -> ImageInput:
    return ImageInput(key, offset, length, PixelTensor("float32", [1], b"\0" * 4))


def add(images: list[ImageInput], length: int = 10) -> AddRequest:
    return AddRequest("r", [IMAGE] * length, SamplingParams(), 0.0, images=images)


def test_admission_checks_the_spans() -> None:
    assert check_image_spans(add([image(0, 3), image(3, 4)])) == [image(0, 3), image(3, 4)]
    wrong_size = ImageInput("h", 0, 2, PixelTensor("float32", [2, 2], b"\0" * 4))
    not_float = ImageInput("h", 0, 2, PixelTensor("int8", [4], b"\0" * 4))
    for bad in (
        [image(2, 4), image(4, 2)],
        [image(8, 4)],
        [image(0, 0)],
        [wrong_size],
        [not_float],
    ):
        with pytest.raises(InvalidRequestError):
            check_image_spans(add(bad))


def test_a_new_request_carries_only_the_images_still_to_compute() -> None:
    from kvflow.proto.step import NewRequestData
    from kvflow.services.scheduler.image_inputs import ImageInputsFeature
    from kvflow.services.scheduler.request import Request
    from kvflow.services.scheduler.step_features import StepBuilder

    images = [image(0, 4, "a"), image(6, 4, "b")]
    request = Request("r", [IMAGE] * 12, SamplingParams(), max_tokens=4, images=images)
    feature = ImageInputsFeature()
    for cached, expected in ((0, images), (8, [images[1]]), (10, [])):
        step = StepBuilder(budget=100, running=[])
        new = NewRequestData("r", request.all_token_ids, 12, SamplingParams(), [], cached)
        step.new_requests.append(new)
        request.num_computed_tokens = 12  # the scheduler counted this step's tokens
        feature.on_scheduled(request, 12 - cached, step)
        feature.end_step(step)
        assert new.images == expected


def test_kv_transfer_keys_carry_the_images_too() -> None:
    from kvflow.kv_transfer.scheduler.block_keys import prompt_block_keys

    prompt = TOKENS[:22]  # 5 full blocks and a partial one; image "b" in the tail
    a = prompt_block_keys(prompt, 4, None, None, [(6, 4, "a"), (20, 2, "b")])
    b = prompt_block_keys(prompt, 4, None, None, [(6, 4, "a"), (20, 2, "c")])
    plain = prompt_block_keys(prompt, 4, None)
    assert a[:5] == b[:5] and a[5] != b[5]  # only the tail block differs
    assert a[0] == plain[0] and a[1] != plain[1]
