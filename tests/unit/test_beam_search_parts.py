"""Beam search's pieces: the OpenAI fields and vLLM's rules for them, copy-on-write forks
in the KV cache manager, the worker's block copies, and the search's stopping rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from kvflow.errors import InvalidRequestError
from kvflow.gpu_worker.block_copy import BlockCopyFeature
from kvflow.proto.step import StepPlan
from kvflow.sampling_params import (
    BeamSearch,
    BeamSearchParams,
    SamplingParams,
    child_sampling_params,
    validate_sampling_params,
)
from kvflow.services.frontend.errors import error_info
from kvflow.services.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
)
from kvflow.services.scheduler.beam_search import BeamSearch as Search
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager

# ---- the API's fields ------------------------------------------------------------------


def completion_params(**body: Any) -> SamplingParams:
    request = decode_request(msgspec.json.encode({"prompt": "x", **body}), CompletionRequest)
    params = request.to_sampling_params()
    validate_sampling_params(params)
    return params


def status_and_param(**body: Any) -> tuple[int, str | None]:
    with pytest.raises(InvalidRequestError) as info:
        completion_params(**body)
    status, error = error_info(info.value)
    return int(status), error.param


def test_use_beam_search_fields() -> None:
    params = completion_params(use_beam_search=True, n=2, best_of=4, length_penalty=0.5,
                               early_stopping=True)  # fmt: skip
    never = completion_params(use_beam_search=True, early_stopping="never").beam_search
    assert never is not None and never.early_stopping == "never"
    assert params.n == 2 and params.temperature == 0.0  # 0 unless one is given
    assert params.beam_search == BeamSearch(beam_width=4, length_penalty=0.5, early_stopping=True)
    assert completion_params(use_beam_search=True, n=3).beam_search.beam_width == 3  # type: ignore[union-attr]
    # Each engine request of the search carries the number of results.
    child = child_sampling_params(params, 1)
    assert child.n == 1 and child.beam_search is not None and child.beam_search.num_outputs == 2
    body = {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2}
    chat = decode_request(msgspec.json.encode(body), ChatCompletionRequest).to_sampling_params()
    assert chat.beam_search == BeamSearch(beam_width=2)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "top_k": 5}, "top_k"),
        ({"use_beam_search": True, "min_tokens": 2}, "min_tokens"),
        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
        ({"use_beam_search": True, "presence_penalty": 0.5}, "presence_penalty"),
        ({"use_beam_search": True, "response_format": {"type": "json_object"}},
         "structured_outputs"),
        ({"length_penalty": 2.0}, "length_penalty"),
        ({"early_stopping": True}, "early_stopping"),
        ({"best_of": 3}, "best_of"),
    ],
)  # fmt: skip
def test_bad_beam_search_bodies_are_400s(body: dict[str, Any], param: str) -> None:
    assert status_and_param(**body) == (400, param)


def test_offline_beam_search_params() -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=2.0).to_sampling_params()
    validate_sampling_params(params)
    assert params.n == 3 and params.max_tokens == 7
    assert params.beam_search == BeamSearch(beam_width=3, num_outputs=3, length_penalty=2.0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        validate_sampling_params(BeamSearchParams(2, 4, temperature=0.5).to_sampling_params())


# ---- copy-on-write forks -----------------------------------------------------------------


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    image_spans: list[tuple[int, int, str]] = field(default_factory=list)
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)


@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_full_blocks_and_copies_the_partial_one(caching: bool) -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=caching)
    parent = Req("p", list(range(10)))  # 2 full blocks + 2 tokens
    assert mgr.allocate_slots(parent, 10) is not None
    parent.num_computed_tokens = 10
    copies = mgr.fork(parent, "c")
    parent_ids, child_ids = mgr.get_block_ids("p"), mgr.get_block_ids("c")
    assert child_ids[:2] == parent_ids[:2] and child_ids[2] != parent_ids[2]
    assert copies == [[parent_ids[2], child_ids[2]]]
    assert [mgr.block_pool.blocks[b].ref_cnt for b in parent_ids] == [2, 2, 1]
    assert mgr.num_free_blocks == 8 - 4
    mgr.check_integrity()
    # The child computes on from position 10; a full block of its own gets hashed.
    child = Req("c", [*range(10), 77, 78])
    child.num_computed_tokens = 10
    assert mgr.allocate_slots(child, 2) == []
    mgr.check_integrity()
    mgr.free("p")
    mgr.free("c")
    mgr.check_integrity()
    assert mgr.num_free_blocks == 8


def test_fork_at_a_block_boundary_copies_nothing_and_a_full_pool_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    parent = Req("p", list(range(8)))
    assert mgr.allocate_slots(parent, 8) is not None
    parent.num_computed_tokens = 8
    assert mgr.fork(parent, "a") == []  # shares both blocks, one new for token 8
    assert mgr.get_block_ids("a")[:2] == mgr.get_block_ids("p")
    assert mgr.fork(parent, "b") is None  # no block left for its next token
    assert mgr.get_block_ids("b") == [] and mgr.num_free_blocks == 0
    mgr.check_integrity()


def test_worker_copies_blocks_in_every_cache() -> None:
    caches = [torch.randn(2, 6, 4, 2, 8) for _ in range(3)]  # [K/V, blocks, B, heads, D]
    before = [c.clone() for c in caches]
    feature = BlockCopyFeature(lambda: caches, torch.device("cpu"))
    feature.on_plan(StepPlan(1, [], [], [], [], kv_block_copies=[[1, 4], [2, 5]]))
    for cache, old in zip(caches, before):
        assert torch.equal(cache[:, 4], old[:, 1]) and torch.equal(cache[:, 5], old[:, 2])
        assert torch.equal(cache[:, :4], old[:, :4])


# ---- the search ---------------------------------------------------------------------------


def test_search_keeps_the_best_beams_and_ends_when_nothing_can_improve() -> None:
    search = Search(2, num_stop_ids=1, length_penalty=1.0, early_stopping=False,
                    max_new_tokens=10)  # fmt: skip
    assert search.num_candidates == 4
    stop = {9}.__contains__
    nexts = search.step([[(1, -0.1), (9, -0.2), (2, -1.0), (3, -2.0)]], [[]], stop)
    # Token 9 stops: a finished hypothesis (score / 1); beams continue on 1 and 2.
    assert [(c.parent, c.token_id) for c in nexts] == [(0, 1), (0, 2)]
    assert search.finished[0].token_ids == [9] and search.finished[0].stopped
    assert search.finished[0].score == np.float32(-0.2)
    # Both beams stop: k hypotheses, and the best running beam cannot beat the worst.
    top = [[(9, -0.1), (4, -5.0)], [(9, -0.1), (4, -6.0)]]
    assert search.step(top, [[1], [2]], stop) == [] and search.done
    assert [h.token_ids for h in search.best(2)] == [[1, 9], [9]]  # -0.1 and -0.2


@pytest.mark.parametrize("order", ["fcfs", "shortest"])
def test_a_started_searchs_beams_are_admitted_first(order: str) -> None:
    """A beam its siblings wait for goes before the queue's head (which may be waiting
    for blocks those siblings hold)."""
    from kvflow.services.scheduler.prefill_order import PrefillOrder
    from kvflow.services.scheduler.request import Request
    from kvflow.services.scheduler.request_queue import make_request_queue

    queue = make_request_queue("fcfs")
    params = SamplingParams(max_tokens=4)
    head, beam, tail = (Request(i, [1] * n, params, max_tokens=4) for i, n in
                        (("head", 3), ("beam", 9), ("tail", 2)))  # fmt: skip
    beam.expedite = True
    for request in (head, beam, tail):
        queue.push(request)
    first = next(iter(PrefillOrder(order).admission_order(queue)))
    assert first is beam
