"""The per-step encoder budget (services/scheduler/encoder_budget.py): exact plans for
hand-made image requests, and a random workload whose encoder work per step, counted
as a worker would count it, never exceeds the budget."""

from __future__ import annotations

import random

import pytest

from kvflow.config import SchedulerConfig
from kvflow.proto.multimodal import ImageInput, PixelTensor
from kvflow.proto.step import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.encoder_budget import EncoderBudgetFeature
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.scheduler import Scheduler

IMAGE_TOKEN = 9


def make_scheduler(
    encoder: int, budget: int = 64, num_blocks: int = 256, cache: int = 0
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_encoder_input_tokens=encoder,
        encoder_cache_size=cache,
    )  # fmt: skip
    kv = KVCacheManager(num_blocks, 4, False)
    return Scheduler(config, kv, 1024, features=make_step_features(config, kv, 1024))


def image_request(
    req_id: str, layout: list[int | str], lengths: dict[str, int] | None = None
) -> Request:
    """`layout`: text token counts and image hashes in order, e.g. [2, "a", 3]; an
    image's run is `lengths[hash]` placeholders (8 by default)."""
    prompt: list[int] = []
    images = []
    for part in layout:
        if isinstance(part, int):
            prompt += [100 + len(prompt) + i for i in range(part)]
        else:
            length = (lengths or {}).get(part, 8)
            pixels = PixelTensor("float32", [1], b"\0" * 4)
            images.append(ImageInput(part, len(prompt), length, pixels))
            prompt += [IMAGE_TOKEN] * length
    params = SamplingParams(max_tokens=2)
    return Request(req_id, prompt, params, max_tokens=2, images=images)


def step(scheduler: Scheduler) -> tuple[StepPlan, int]:
    """One step with every request at its end sampling a token: (plan, encoder tokens)."""
    plan = scheduler.schedule()
    tokens = scheduler.feature(EncoderBudgetFeature).last_step_tokens  # type: ignore[union-attr]
    done = [
        r for r in plan.scheduled_req_ids
        if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens
    ]  # fmt: skip
    result = StepResult(plan.step_id, done, [[7] for _ in done])
    scheduler.update_from_output(plan, result)
    return plan, tokens


def scheduled(plan: StepPlan) -> dict[str, int]:
    return dict(zip(plan.scheduled_req_ids, plan.num_scheduled_tokens))


def test_an_image_over_the_rest_of_the_budget_waits_cut_before_its_run() -> None:
    scheduler = make_scheduler(encoder=12)
    scheduler.add_request(image_request("a", [2, "x", 2]))
    scheduler.add_request(image_request("b", [3, "y", 2]))
    scheduler.add_request(image_request("t", [5]))  # text only: never held back
    plan, tokens = step(scheduler)
    assert scheduled(plan) == {"a": 12, "b": 3, "t": 5}  # b stops before its run
    assert tokens == 8
    plan, tokens = step(scheduler)
    assert scheduled(plan) == {"a": 1, "b": 10, "t": 1}  # decodes, and b's image now
    assert tokens == 8


def test_cached_and_shared_images_cost_nothing() -> None:
    scheduler = make_scheduler(encoder=8)
    scheduler.add_request(image_request("a", [2, "x", 1]))
    scheduler.add_request(image_request("b", [1, "x", 1]))  # same image, same step: once
    plan, tokens = step(scheduler)
    assert scheduled(plan) == {"a": 11, "b": 10} and tokens == 8
    scheduler.add_request(image_request("c", [4, "x", "y", 1]))  # x cached, y fits
    plan, tokens = step(scheduler)
    assert scheduled(plan)["c"] == 21 and tokens == 8


def test_later_images_wait_behind_one_that_does_not_fit() -> None:
    """Arrival order among images: once one waits, a smaller one behind it waits too."""
    scheduler = make_scheduler(encoder=10)
    scheduler.add_request(image_request("a", [1, "x", 1]))
    scheduler.add_request(image_request("b", [1, "y", 1]))  # 8 > the 2 left
    scheduler.add_request(image_request("c", [1, "z", 1], {"z": 2}))  # 2 would fit
    plan, tokens = step(scheduler)
    assert scheduled(plan) == {"a": 10, "b": 1, "c": 1} and tokens == 8


def test_an_image_the_cache_mirror_dropped_costs_again() -> None:
    scheduler = make_scheduler(encoder=8, cache=16)  # two 8-feature images
    total = 0
    for n, key in enumerate(["x", "y", "x", "z", "x", "y"]):  # y is the least recent when z comes
        scheduler.add_request(image_request(f"r{n}", [1, key, 1]))
        while scheduler.has_unfinished_requests():
            total += step(scheduler)[1]
    assert total == 4 * 8  # x, y, z, then y again
    mirror = scheduler.feature(EncoderBudgetFeature).cache  # type: ignore[union-attr]
    assert "x" in mirror and "y" in mirror and "z" not in mirror


@pytest.mark.parametrize("budget", [64, 5], ids=["whole", "chunked"])
def test_an_image_larger_than_the_budget_goes_alone(budget: int) -> None:
    scheduler = make_scheduler(encoder=4, budget=budget)
    scheduler.add_request(image_request("a", [2, "x", 1]))
    scheduler.add_request(image_request("b", [1, "y", 1]))
    plans = [step(scheduler) for _ in range(8)]
    encoded = [tokens for _, tokens in plans if tokens]
    assert encoded == [8, 8]  # each alone in its step, never both in one
    assert all(tokens in (0, 8) for _, tokens in plans)  # nothing beside a lone image


def test_random_workload_never_encodes_more_than_the_budget() -> None:
    """A worker's view: a step encodes each image whose run it reaches and no earlier
    step encoded. That never exceeds the budget but for a lone oversized image, every
    image is encoded exactly once, and the scheduler's count agrees."""
    rng = random.Random(0)
    scheduler = make_scheduler(encoder=20, budget=24, num_blocks=512, cache=1000)
    lengths = {f"i{k}": rng.choice([4, 8, 12, 24]) for k in range(12)}
    for n in range(16):
        layout: list[int | str] = [rng.randint(0, 5)]
        for _ in range(rng.randint(0, 3)):
            layout += [rng.choice(list(lengths)), rng.randint(0, 3)]
        scheduler.add_request(image_request(f"r{n}", layout, lengths))
    requests = dict(scheduler.requests)
    encoded: set[str] = set()
    for _ in range(200):
        starts = {r: requests[r].num_computed_tokens for r in scheduler.requests}
        plan, counted = step(scheduler)
        work: dict[str, int] = {}
        for req_id, count in scheduled(plan).items():
            start = starts[req_id]
            for image in requests[req_id].images:
                reached = image.offset < start + count and image.offset + image.length > start
                if reached and image.hash not in encoded:
                    work[image.hash] = image.length
        encoded |= set(work)
        assert sum(work.values()) == counted
        assert counted <= 20 or len(work) == 1
        if not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert encoded == {i.hash for r in requests.values() for i in r.images}
