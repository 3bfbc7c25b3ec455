"""A worker rank's group (gpu_worker/distributed.py) over real gloo processes: a step's
collective that a peer never joins fails after the step timeout instead of hanging, and
the start-up agreement takes the smallest value of any rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from serve_harness import listening_sockets

from kvflow.gpu_worker.distributed import (
    RankInit,
    free_tcp_address,
    min_over_ranks,
    rank_group,
    rendezvous_store,
)
from kvflow.services.launch.dp_hosts import reachable_host

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


@pytest.mark.slow
def test_a_collective_times_out_and_startup_takes_the_minimum(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_tcp_address(), tmp_path), nprocs=2, join=True)
    assert [(tmp_path / f"min{r}").read_text() for r in range(2)] == ["10", "10"]
    outcome, took = (tmp_path / "step").read_text().rsplit(" ", 1)
    assert outcome == "raised RuntimeError"
    assert STEP_TIMEOUT_S - 0.5 <= float(took) < 3 * STEP_TIMEOUT_S


@pytest.mark.parametrize("host", ["127.0.0.1", "outside"])
def test_the_rendezvous_store_listens_on_its_host_only(host: str) -> None:
    """torch's store has no authentication: rank 0 serves it on the init address's own
    interface, never on 0.0.0.0 (which torch's default init_method would)."""
    if host == "outside":
        host = reachable_host("192.0.2.1")  # this host's address on its default route
        if host.startswith("127."):
            pytest.skip("no interface besides loopback")
    address = free_tcp_address(host)
    port = int(address.rsplit(":", 1)[1])
    store = rendezvous_store(RankInit(address, 2, 0, startup_timeout_s=5.0))
    try:
        assert listening_sockets(port) == [host]
        store.set("rank0", "here")
        peer = rendezvous_store(RankInit(address, 2, 1, startup_timeout_s=5.0))
        assert peer.get("rank0") == b"here"  # and the ranks still meet there
    finally:
        del store
