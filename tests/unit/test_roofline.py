"""Roofline estimates against hand-computed numbers for a tiny Llama shape, and the
batch description the scheduler derives from a real plan."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvflow.config import SchedulerConfig
from kvflow.metrics.roofline import (
    ModelShape,
    RooflineMeter,
    StepBatch,
    StepCost,
    estimate_step_cost,
    roofline_report,
)
from kvflow.proto.stats import PhaseTotals
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.scheduler import Scheduler

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}
SHAPE = ModelShape(64, 2, 4, 2, 16, 128, 100, 4)  # float32


@dataclass
class Req:
    num_prompt_tokens: int
    num_computed_tokens: int  # after scheduling
    num_tokens: int


def test_shape_from_config_json(tmp_path: Path) -> None:
    assert ModelShape.from_config_dict(TINY, "float32") == SHAPE
    qwen3 = {**TINY, "head_dim": 32}
    assert ModelShape.from_config_dict(qwen3, "bfloat16").head_dim == 32
    assert ModelShape.from_config_dict(qwen3, "bfloat16").dtype_bytes == 2
    (tmp_path / "config.json").write_text(json.dumps({"text_config": TINY}))
    assert ModelShape.from_model_dir(tmp_path, "float32") == SHAPE
    # q 64x64 + o 64x64 + k, v 64x32 each + gate, up, down 64x128 each
    assert SHAPE.layer_weights == 4096 + 4096 + 2048 + 2048 + 3 * 8192 == 36864
    assert SHAPE.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512


def test_prefill_of_one_prompt() -> None:
    batch = StepBatch.from_scheduled([Req(5, 5, 5)], [5])
    assert batch == StepBatch([5], [5], num_logits=1, num_prompt_tokens=5)
    assert batch.phase == "prefill"
    cost = estimate_step_cost(SHAPE, batch)
    # matmuls 2*5*2*36864 = 737280; attention 4*2*64*(1+2+3+4+5) = 7680;
    # LM head 2*1*64*100 = 12800
    assert cost.flops == 757_760
    # elements: weights 2*36864 + norms 5*64 + embedding rows 5*64 + LM head 100*64 = 80768;
    # activations 5*2*(7*64 + 4*64 + 2*32 + 3*128) + 1*(64 + 100) = 11684; x 4 bytes;
    # KV (5 read + 5 written) * 512
    assert cost.bytes == (80_768 + 11_684) * 4 + 10 * 512 == 374_928


def test_decode_of_two_requests() -> None:
    batch = StepBatch.from_scheduled([Req(5, 9, 9), Req(2, 3, 3)], [1, 1])
    assert batch == StepBatch([1, 1], [9, 3], num_logits=2, num_prompt_tokens=0)
    assert batch.phase == "decode"
    cost = estimate_step_cost(SHAPE, batch)
    # 2*2*2*36864 + 4*2*64*(9 + 3) + 2*2*64*100
    assert cost.flops == 294_912 + 6_144 + 25_600
    # weights 73728 + 320 + 2*64 + 6400; activations 2*2*1152 + 2*164; KV (12 + 2) * 512
    assert cost.bytes == (80_576 + 4_936) * 4 + 14 * 512


def test_q8_0_counts_its_blocks_for_matmul_weights() -> None:
    """34 bytes per 32 weights (codes and a half-float scale) for the layers' matmuls and
    the LM head; norms, embedding rows, activations and KV keep the dtype's bytes."""
    shape = ModelShape.from_config_dict(TINY, "float32", "q8_0")
    assert shape.matmul_weight_bytes == 34 / 32
    assert ModelShape.from_config_dict(TINY, "float32", "gguf").matmul_weight_bytes == 4
    batch = StepBatch.from_scheduled([Req(5, 9, 9), Req(2, 3, 3)], [1, 1])
    cost = estimate_step_cost(shape, batch)
    matmul = 2 * 36_864 + 6_400  # two layers' weights, the LM head
    assert cost.bytes == matmul * 34 / 32 + (320 + 2 * 64 + 4_936) * 4 + 14 * 512
    assert cost.flops == estimate_step_cost(SHAPE, batch).flops


def test_chunks_resumes_and_empty_steps() -> None:
    # A middle prefill chunk samples nothing; a resumed request recomputes its outputs.
    chunk = StepBatch.from_scheduled([Req(10, 8, 10), Req(5, 8, 8)], [4, 8])
    assert chunk == StepBatch([4, 8], [8, 8], num_logits=1, num_prompt_tokens=4 + 5)
    assert chunk.num_decode_tokens == 3 and chunk.phase == "prefill"
    tie = StepBatch.from_scheduled([Req(10, 2, 10), Req(1, 5, 5)], [1, 1])
    assert (tie.num_prompt_tokens, tie.phase) == (1, "decode")  # not a strict majority
    assert estimate_step_cost(SHAPE, StepBatch([], [], 0, 0)) == StepCost(0.0, 0.0)
    without_logits = estimate_step_cost(SHAPE, StepBatch([1], [1], 0, 1))
    with_logits = estimate_step_cost(SHAPE, StepBatch([1], [1], 1, 1))
    assert with_logits.flops - without_logits.flops == 2 * 64 * 100
    assert with_logits.bytes - without_logits.bytes == (100 * 64 + 64 + 100) * 4


def test_batch_from_a_real_plan() -> None:
    kv_cache = KVCacheManager(num_blocks=32, block_size=4)
    core = Scheduler(SchedulerConfig(max_num_batched_tokens=10), kv_cache, max_model_len=64)
    params = SamplingParams(max_tokens=4)
    core.add_request(Request("a", list(range(3)), params, max_tokens=4))
    core.add_request(Request("b", list(range(12)), params, max_tokens=4))
    plan = core.schedule()
    assert plan.num_scheduled_tokens == [3, 7]  # b is chunked by the budget
    assert StepBatch.from_plan(plan, core.requests) == StepBatch([3, 7], [3, 7], 1, 10)


def test_meter_and_report() -> None:
    meter = RooflineMeter(SHAPE)
    prefill = StepBatch([5], [5], 1, 5)
    decode = StepBatch([1, 1], [9, 3], 2, 0)
    assert meter.record(prefill, 0.5) == estimate_step_cost(SHAPE, prefill)
    meter.record(decode, 0.25)
    meter.record(decode, 0.25)
    assert meter.phases["prefill"] == PhaseTotals(1, 0.5, 757_760.0, 374_928.0)
    decode_cost = estimate_step_cost(SHAPE, decode)
    assert meter.phases["decode"] == PhaseTotals(
        2, 0.5, 2 * decode_cost.flops, 2 * decode_cost.bytes
    )
    report = roofline_report(meter.phases, peak_flops=3_031_040.0, peak_bandwidth=0.0)
    assert report["prefill"]["gflop_per_s"] == 0.001516  # 4 significant digits
    assert report["prefill"]["pct_compute_roofline"] == 50.0  # 1515520 FLOP/s of 3031040
    assert report["prefill"]["pct_bandwidth_roofline"] is None  # peak unknown
    assert report["prefill"]["flop_per_byte"] == 2.021  # 757760 / 374928
    assert RooflineMeter(None).record(prefill, 1.0) == StepCost(0.0, 0.0)
    assert roofline_report({"decode": PhaseTotals()}, 1.0, 1.0) == {}
