"""Two pipeline stages over real gloo processes (gpu_worker/stage_link.py): a step's
activations and spans arrive intact, with no header, and a stage whose predecessor
never sends fails after the step timeout instead of hanging."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kvflow.gpu_worker.distributed import RankInit, free_tcp_address, rank_group
from kvflow.gpu_worker.parallel_state import get_pp_group
from kvflow.gpu_worker.stage_link import StageLink

pytestmark = pytest.mark.slow

STEP_TIMEOUT_S = 3.0
HIDDEN = 8


def _rank(rank: int, address: str, out: Path) -> None:
    init = RankInit(address, 2, rank, timeout_s=STEP_TIMEOUT_S, pipeline_parallel_size=2)
    with rank_group(init, "cpu"):
        stage = get_pp_group()
        link = StageLink(stage, HIDDEN, torch.float32, torch.device("cpu"))
        link.begin(num_tokens=3)
        if rank == 0:
            assert stage.is_first and stage.next_rank == 1
            assert link.activations() is None
            hidden = torch.arange(3 * HIDDEN, dtype=torch.float32).view(3, HIDDEN)
            link.send((hidden, -hidden))
            link.wait_sent()
            time.sleep(3 * STEP_TIMEOUT_S)  # never sends the second step
            return
        assert stage.is_last and stage.prev_rank == 0
        acts = link.activations()
        assert acts is not None
        hidden, residual = acts
        assert torch.equal(hidden, torch.arange(3 * HIDDEN, dtype=torch.float32).view(3, HIDDEN))
        assert torch.equal(residual, -hidden)
        spans = link.spans().tolist()  # stage 0's prepare + compute, then ours
        assert [row[0] for row in spans] == [0, 0, 1, 1]
        assert all(start <= end for _, start, end in spans)
        link.begin(num_tokens=3)
        start = time.monotonic()
        try:
            link.activations()
            outcome = "received"
        except RuntimeError as exc:
            outcome = "raised: " + str(exc).split(":")[0]
        (out / "second").write_text(f"{outcome}|{time.monotonic() - start:.2f}")


def test_activations_arrive_and_a_silent_stage_times_out(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_tcp_address(), tmp_path), nprocs=2, join=True)
    outcome, took = (tmp_path / "second").read_text().split("|")
    assert outcome == "raised: pipeline stage 1"
    assert STEP_TIMEOUT_S - 0.5 <= float(took) < 3 * STEP_TIMEOUT_S
