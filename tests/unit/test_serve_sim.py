"""The virtual-clock serving run: exact timelines for small closed-loop workloads."""

from __future__ import annotations

import pytest

from kvflow.bench.serve_sim import StepCostModel, main, simulate, workload
from kvflow.config import SchedulerConfig

ONE_SECOND_STEPS = StepCostModel(fixed_s=1.0, per_decode_s=0.0, per_prefill_token_s=0.0)


def test_a_budget_for_the_whole_wave_gives_every_request_the_same_ttft() -> None:
    config = SchedulerConfig(max_num_batched_tokens=32)
    result = simulate(config, [(16, 4)] * 4, 2, ONE_SECOND_STEPS, gap_s=0.0)
    assert result.ttft_s == [1.0] * 4  # two waves of two, each prefilled in one step
    assert result.itl_s == [1.0] * 12
    assert result.num_steps == 8 and result.duration_s == 8.0
    assert result.summary()["out_tok_s"] == 2.0


def test_a_smaller_budget_streams_the_first_request_early_and_staggers_the_next_wave() -> None:
    config = SchedulerConfig(max_num_batched_tokens=16)
    result = simulate(config, [(16, 4)] * 4, 2, ONE_SECOND_STEPS, gap_s=0.5)
    # r0 prefills alone in step 1; r1's 16 tokens share steps 2 and 3 with r0's
    # decodes. r0 ends at t=4, r2 arrives at 4.5 and waits for the step under way, then
    # shares its prefill with r1's decodes (steps 5..7): every chunk that shares a step
    # with a decode is one token short.
    assert result.first_token_order == ["r0", "r1", "r2", "r3"]
    assert result.ttft_s == [1.0, 3.0, 2.5, 2.5]


def test_shortest_first_lets_the_short_prompt_stream_first() -> None:
    lengths = [(30, 2), (10, 2)]
    fcfs = simulate(SchedulerConfig(max_num_batched_tokens=16), lengths, 2, ONE_SECOND_STEPS)
    assert fcfs.first_token_order == ["r0", "r1"]
    config = SchedulerConfig(max_num_batched_tokens=16, prefill_order="shortest")
    shortest = simulate(config, lengths, 2, ONE_SECOND_STEPS)
    assert shortest.first_token_order == ["r1", "r0"]
    assert shortest.ttft_s == [1.0, 3.0]  # r1: 10 + 6 of r0; then r0's 16, 8


def test_cost_model_charges_decodes_and_prefill_tokens() -> None:
    cost = StepCostModel(fixed_s=0.01, per_decode_s=0.002, per_prefill_token_s=0.001)
    assert cost.seconds(num_decodes=8, num_prefill_tokens=256) == pytest.approx(0.282)
    result = simulate(SchedulerConfig(), [(100, 3)], 1, cost, gap_s=0.0)
    assert result.ttft_s == [pytest.approx(0.11)]
    assert result.itl_s == [pytest.approx(0.012)] * 2


def test_workloads_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert workload("w3", 3) == [(256, 128)] * 3
    mixed = workload("mixed", 64)
    assert all(32 <= p <= 480 and o == 128 for p, o in mixed) and len(set(mixed)) > 10
    main(["--num-prompts", "4", "--concurrency", "2", "--budgets", "512", "--orders", "fcfs"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("512 fcfs | ")
