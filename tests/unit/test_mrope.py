"""M-RoPE positions: the prompt-side table (kvflow/mrope.py) on the layout its docstring
draws, the worker's per-step slices of it (gpu_worker/mrope_feature.py) for a chunk that
splits an image, a generated token and a text-only request beside it, and admission's
check of the table's length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvflow.errors import InvalidRequestError
from kvflow.gpu_worker.mrope_feature import MRopeFeature
from kvflow.mrope import mrope_positions, positions_array
from kvflow.proto.engine import AddRequest
from kvflow.proto.multimodal import ImageInput, MRopePositions, PixelTensor
from kvflow.proto.step import CachedRequestData, NewRequestData, StepPlan
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.admission import check_image_spans

# T T [2 x 3 merged patches] T T: the image's patch grid is 1 x 4 x 6 (merge 2).
IMAGE = ImageInput("h", 2, 6, PixelTensor("float32", [24, 1], bytes(96)), [1, 4, 6])
TABLE = [
    [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
    [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
    [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
]


def test_prompt_table_and_delta() -> None:
    positions = mrope_positions(10, [IMAGE], merge=2)
    assert positions_array(positions).tolist() == TABLE
    assert positions.delta == 7 - 10  # generated token 10 sits at 7


class _Model:
    def __init__(self) -> None:
        self.positions: list[torch.Tensor | None] = []

    def set_mrope_positions(self, positions: torch.Tensor | None) -> None:
        self.positions.append(positions)


def _new(req_id: str, computed: int, mrope: MRopePositions | None) -> NewRequestData:
    return NewRequestData(req_id, list(range(10)), 10, SamplingParams(), [0], computed, mrope=mrope)


def test_feature_slices_chunks_and_continues_past_the_prompt() -> None:
    model = _Model()
    feature = MRopeFeature(model, torch.device("cpu"))  # type: ignore[arg-type]
    mrope = mrope_positions(10, [IMAGE], merge=2)
    # A chunk from index 3 to 6 (inside the image) beside a text-only request's tokens.
    plan = StepPlan(1, [_new("img", 3, mrope), _new("txt", 4, None)], [], ["txt", "img"], [2, 4])
    feature.on_plan(plan)
    feature.before_forward(plan)
    expected = [[4, 5, *row[3:7]] for row in TABLE]
    assert model.positions[-1] is not None and model.positions[-1].tolist() == expected
    assert feature.layer_hook(plan) is not None  # such a step runs eagerly
    # The last prompt token and a generated one (index 10 -> 7): the three rows agree, so
    # they are plain RoPE positions, written into the step's 1-D positions (its graph runs).
    decode = StepPlan(2, [], [CachedRequestData("img", [], 9)], ["img"], [2])
    feature.on_plan(decode)
    feature.before_forward(decode)
    assert model.positions[-1] is None and feature.layer_hook(decode) is None
    inputs = SimpleNamespace(positions=torch.tensor([9, 10]))
    feature.on_inputs(decode, inputs)  # type: ignore[arg-type]
    assert inputs.positions.tolist() == [6, 7]
    # Text-only steps keep their 1-D positions (and their graphs).
    text = StepPlan(
        3, [], [CachedRequestData("txt", [], 6)], ["txt"], [1], finished_req_ids=["img"]
    )
    feature.on_plan(text)
    feature.before_forward(text)
    assert model.positions[-1] is None and feature.layer_hook(text) is None


def test_admission_checks_the_table_length() -> None:
    image = ImageInput("h", 1, 1, PixelTensor("float32", [1, 1], bytes(4)), [1, 2, 2])
    good = mrope_positions(3, [image], merge=2)
    add = AddRequest("r", [1, 2, 3], SamplingParams(), 0.0, images=[image], mrope=good)
    assert check_image_spans(add) == [image]
    add.mrope = MRopePositions(0, bytes(12))
    with pytest.raises(InvalidRequestError, match="M-RoPE"):
        check_image_spans(add)
