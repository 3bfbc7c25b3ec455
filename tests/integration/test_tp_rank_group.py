"""A worker rank's group (gpu_worker/distributed.py) over real gloo processes: a step's
collective that a peer never joins fails after the step timeout instead of hanging, and
the start-up agreement takes the smallest value of any rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kvflow.gpu_worker.distributed import RankInit, free_tcp_address, min_over_ranks, rank_group

pytestmark = pytest.mark.slow

STEP_TIMEOUT_S = 3.0


def _rank(rank: int, address: str, out: Path) -> None:
    init = RankInit(address, 2, rank, timeout_s=STEP_TIMEOUT_S)
    with rank_group(init, "cpu") as group:
        (out / f"min{rank}").write_text(str(min_over_ranks(10 + 5 * rank, group, "cpu")))
        if rank == 1:
            time.sleep(3 * STEP_TIMEOUT_S)  # never joins the step below
            return
        start = time.monotonic()
        try:
            group.all_reduce(torch.ones(4))
            outcome = "completed"
        except RuntimeError as exc:
            outcome = f"raised {type(exc).__name__}"
        (out / "step").write_text(f"{outcome} {time.monotonic() - start:.2f}")


def test_a_collective_times_out_and_startup_takes_the_minimum(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_tcp_address(), tmp_path), nprocs=2, join=True)
    assert [(tmp_path / f"min{r}").read_text() for r in range(2)] == ["10", "10"]
    outcome, took = (tmp_path / "step").read_text().rsplit(" ", 1)
    assert outcome == "raised RuntimeError"
    assert STEP_TIMEOUT_S - 0.5 <= float(took) < 3 * STEP_TIMEOUT_S
