"""Runner features (gpu_worker/step_features.py and the features): each hook list holds
exactly the features that override it, in order; the features do their part of a step."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvflow import LLM, SamplingParams
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.gpu_worker.block_copy import BlockCopyFeature
from kvflow.gpu_worker.draft_feature import DraftModelFeature
from kvflow.gpu_worker.forward_paths import GraphForward, eager_forward
from kvflow.gpu_worker.grammar_feature import GrammarFeature
from kvflow.gpu_worker.input_batch import ModelInputs
from kvflow.gpu_worker.prompt_logprobs import PromptLogprobsFeature
from kvflow.gpu_worker.step_features import StepFeature, StepFeatures
from kvflow.kv_transfer.worker.runner_feature import IDLE_LOAD_WAIT_S, KVConnectorFeature
from kvflow.proto.kv_transfer import KVConnectorMeta, KVTransferStepStats
from kvflow.proto.step import NewRequestData, StepPlan, StepResult


def _plan(**fields: Any) -> StepPlan:
    base: dict[str, Any] = dict(
        step_id=7,
        new_requests=[],
        cached_requests=[],
        scheduled_req_ids=[],
        num_scheduled_tokens=[],
    )
    return StepPlan(**(base | fields))


def _inputs(num_reqs: int = 1, decode: bool = True) -> ModelInputs:
    query_len = 1 if decode else 3
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(num_reqs * query_len, dtype=torch.int64),
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32) * query_len,
        seq_lens=torch.full((num_reqs,), 4, dtype=torch.int32),
        block_tables=torch.zeros(num_reqs, 1, dtype=torch.int32),
        max_query_len=query_len,
        max_seq_len=4,
        query_start_loc_cpu=[i * query_len for i in range(num_reqs + 1)],
        seq_lens_cpu=[4] * num_reqs,
        logits_indices=torch.arange(num_reqs, dtype=torch.int64) * query_len + query_len - 1,
    )
    ids = torch.arange(num_reqs * query_len)
    return ModelInputs(ids, ids.clone(), metadata, [f"r{i}" for i in range(num_reqs)])


class _Recorder(StepFeature):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log


class _BeforeOnly(_Recorder):
    def before_forward(self, plan: StepPlan) -> None:
        self.log.append(f"{self.name}.before")


class _AfterAndClear(_Recorder):
    def after_step(self, plan: Any, inputs: Any, logits: Any, result: StepResult) -> None:
        self.log.append(f"{self.name}.after")

    def clear(self) -> None:
        self.log.append(f"{self.name}.clear")


class _Layers(_Recorder):
    def layer_hook(self, plan: StepPlan) -> Any:
        if plan.step_id < 0:
            return None
        return lambda cache: self.log.append(f"{self.name}.layer")


def test_no_features_no_hooks() -> None:
    features = StepFeatures()
    hooks = (features.on_plan, features.before_forward, features.on_logits)
    assert hooks == ((), (), ())
    assert (features.after_step, features.on_idle) == ((), ())
    assert features.layer_hook(_plan()) is None


def test_each_hook_holds_the_features_that_override_it_in_order() -> None:
    log: list[str] = []
    a, b, c = _BeforeOnly("a", log), _AfterAndClear("b", log), _BeforeOnly("c", log)
    features = StepFeatures([a, b, c])
    assert features.before_forward == (a.before_forward, c.before_forward)
    assert features.after_step == (b.after_step,)
    assert features.on_plan == () and features.on_logits == () and features.on_idle == ()
    for before in features.before_forward:
        before(_plan())
    features.clear()
    assert log == ["a.before", "c.before", "b.clear"]
    assert features.layer_hook(_plan()) is None


def test_layer_hooks_one_is_passed_through_several_are_chained() -> None:
    log: list[str] = []
    one = StepFeatures([_Layers("x", log)])
    hook = one.layer_hook(_plan())
    assert hook is not None
    hook(torch.zeros(1))
    assert log == ["x.layer"]
    assert one.layer_hook(_plan(step_id=-1)) is None  # this step needs none
    log.clear()
    two = StepFeatures([_Layers("x", log), _BeforeOnly("y", log), _Layers("z", log)])
    chained = two.layer_hook(_plan())
    assert chained is not None
    chained(torch.zeros(1))
    assert log == ["x.layer", "z.layer"]


class _FakeConnector:
    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.hook = lambda cache: None

    def start_load_kv(self, meta: Any) -> None:
        self.calls.append(("load", meta))

    def start_save_kv(self, meta: Any) -> Any:
        self.calls.append(("save", meta))
        return self.hook

    def wait_for_save(self, meta: Any) -> None:
        self.calls.append(("wait_save", meta))

    def wait_for_loads(self, timeout_s: float) -> None:
        self.calls.append(("wait_loads", timeout_s))

    def take_stats(self) -> KVTransferStepStats:
        return KVTransferStepStats(bytes_loaded=len(self.calls))


def test_kv_connector_feature_acts_only_on_plans_with_connector_meta() -> None:
    connector = _FakeConnector()
    feature = KVConnectorFeature(connector)  # type: ignore[arg-type]
    plain, meta = _plan(), KVConnectorMeta(loads=[], saves=[])
    with_meta = _plan(kv_connector=meta)
    feature.before_forward(plain)
    assert feature.layer_hook(plain) is None
    result = StepResult(step_id=0, req_ids=[], sampled_token_ids=[])
    feature.after_step(plain, _inputs(), torch.zeros(1, 4), result)
    assert connector.calls == []
    assert result.kv_transfer == KVTransferStepStats()  # still reported every step
    feature.before_forward(with_meta)
    assert feature.layer_hook(with_meta) is connector.hook
    feature.after_step(with_meta, _inputs(), torch.zeros(1, 4), result)
    assert connector.calls == [("load", meta), ("save", meta), ("wait_save", meta)]
    assert result.kv_transfer == KVTransferStepStats(bytes_loaded=3)
    idle = StepResult(step_id=0, req_ids=[], sampled_token_ids=[])
    feature.on_idle(plain, idle)
    assert connector.calls[-1] == ("wait_loads", IDLE_LOAD_WAIT_S)
    assert idle.kv_transfer == KVTransferStepStats(bytes_loaded=4)


class _FakeDrafter:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def forget(self, req_ids: list[str]) -> None:
        self.calls.append(("forget", list(req_ids)))

    def propose(self, batch: Any, req_ids: list[str]) -> dict[int, torch.Tensor]:
        self.calls.append(("propose", req_ids))
        return {0: torch.ones(2, 4)}

    def on_verified(self, req_ids: list[str], num_accepted: list[int]) -> None:
        self.calls.append(("verified", req_ids, num_accepted))

    def clear(self) -> None:
        self.calls.append(("clear",))


def test_draft_feature_proposes_then_keeps_what_was_accepted() -> None:
    drafter = _FakeDrafter()
    feature = DraftModelFeature(drafter, batch=None)  # type: ignore[arg-type]
    new = NewRequestData("n", [1], 1, SamplingParams(), [0], 0)
    feature.before_forward(_plan(finished_req_ids=["f"], new_requests=[new]))
    assert feature.probs == {}
    assert drafter.calls == [("forget", ["f"]), ("forget", ["n"])]
    result = StepResult(step_id=0, req_ids=["a"], sampled_token_ids=[[5]])
    feature.after_step(_plan(), _inputs(), torch.zeros(1, 4), result)  # no drafts: nothing
    assert len(drafter.calls) == 2
    drafter.calls.clear()
    feature.before_forward(_plan(spec_token_ids={"a": [0, 0]}))
    assert drafter.calls == [("forget", []), ("propose", ["a"])]
    assert list(feature.probs) == [0]
    verified = StepResult(step_id=0, req_ids=["a", "b"], sampled_token_ids=[[5, 6, 7], [8]])
    feature.after_step(_plan(), _inputs(2), torch.zeros(2, 4), verified)
    assert drafter.calls[-1] == ("verified", ["a", "b"], [2, 0])
    feature.clear()
    assert drafter.calls[-1] == ("clear",) and feature.probs == {}


class _FakeGraphs:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.num_replays = 0

    def can_run(self, md: AttentionMetadata) -> bool:
        return md.is_decode_only and md.num_reqs <= self.max_size

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any) -> torch.Tensor:
        self.num_replays += 1
        return torch.full((md.num_reqs, 2), 1.0)


class _FakeModel:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, **kw: Any) -> Any:
        self.calls += 1
        return torch.zeros(len(kw["output_rows"]), 2)


def test_graph_forward_replays_decodes_and_runs_the_rest_eagerly() -> None:
    graphs, model = _FakeGraphs(max_size=2), _FakeModel()
    forward = GraphForward(graphs)  # type: ignore[arg-type]
    hidden = forward(model, _inputs(2), None)  # type: ignore[arg-type]
    assert (graphs.num_replays, model.calls) == (1, 0)
    assert torch.equal(hidden, torch.ones(2, 2))
    for inputs, after_layer in [
        (_inputs(3), None),  # larger than the largest graph
        (_inputs(1, decode=False), None),  # a prefill
        (_inputs(1), lambda cache: None),  # a per-layer callback: a graph cannot call it
    ]:
        hidden = forward(model, inputs, after_layer)  # type: ignore[arg-type]
        assert hidden.shape == (inputs.metadata.num_reqs, 2) and not hidden.any()
    assert (graphs.num_replays, model.calls) == (1, 3)
    assert np.array_equal(_inputs(2).metadata.logits_indices.numpy(), [0, 1])


def test_a_runner_registers_only_what_is_configured(tiny_model_dir: Any) -> None:
    """No option: the per-request features only (grammar, prompt logprobs, block copies),
    an eager forward; a KV connector bound later becomes a feature, and unbinds."""
    llm = LLM(str(tiny_model_dir("llama")), num_threads=1, enforce_eager=True, num_blocks=16)
    runner = llm.engine.runner
    features = runner.features.features
    assert [type(f) for f in features] == [GrammarFeature, PromptLogprobsFeature, BlockCopyFeature]
    assert runner.forward_path is eager_forward
    assert runner.features.on_plan == (features[2].on_plan,)
    assert runner.features.before_forward == ()
    assert runner.features.layer_hook(_plan()) is None
    connector = _FakeConnector()
    runner.kv_connector = connector
    assert runner.kv_connector is connector
    assert [type(f) for f in runner.features.features][3:] == [KVConnectorFeature]
    assert len(runner.features.before_forward) == 1
    runner.kv_connector = None
    assert runner.features.features == features
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([[5, 6, 7]], params)
    assert len(output.token_ids) == 3
