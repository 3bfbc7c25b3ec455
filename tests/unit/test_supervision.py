"""The launcher's supervision of its children, without processes: a dead worker is
restarted after a doubling backoff until the budget is spent; any other dead role, or
a spent budget, is fatal and named by the watchdog."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvflow.services.launch.children import Child, ChildProcesses, RestartPolicy


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None


@pytest.fixture
def children(monkeypatch: pytest.MonkeyPatch) -> Iterator[ChildProcesses]:
    context = zmq.Context()
    processes = iter(range(100, 200))
    monkeypatch.setattr(
        ChildProcesses, "_process", lambda self, *args: FakeProcess(next(processes))
    )
    group = ChildProcesses(context, "inproc://acks")
    yield group
    group._acks.close()
    context.term()


def start(children: ChildProcesses, role: str) -> Child:
    return children.start(role, 0, lambda: 0)


def kill(child: Child) -> None:
    process: Any = child.process
    process.exitcode = -9


def test_a_dead_worker_is_restarted_with_doubling_backoff_until_the_budget_is_spent(
    children: ChildProcesses,
) -> None:
    policy = RestartPolicy(max_worker_restarts=2, backoff_s=1.0)
    worker = start(children, "worker")
    start(children, "scheduler")
    kill(worker)
    assert children.supervise(policy, 10.0) is None and worker.restart_at == 11.0
    assert children.supervise(policy, 10.5) is None and worker.process.pid == 100
    assert children.supervise(policy, 11.0) is None and worker.process.pid == 102
    assert worker.num_restarts == 1 and worker.process.is_alive()
    kill(worker)
    assert children.supervise(policy, 20.0) is None and worker.restart_at == 22.0
    assert children.supervise(policy, 22.0) is None and worker.num_restarts == 2
    assert children.watchdog() is None
    kill(worker)
    fatal = children.supervise(policy, 30.0)
    assert fatal == "worker rank 0 was killed by SIGKILL; restart budget spent (2 restarts)"
    assert children.watchdog() == fatal and children.num_worker_restarts == 2


def test_any_other_dead_role_is_fatal_at_once(children: ChildProcesses) -> None:
    start(children, "worker")
    scheduler = start(children, "scheduler")
    scheduler.error = "boom"
    process: Any = scheduler.process
    process.exitcode = 1
    assert children.supervise(RestartPolicy(), 0.0) == "scheduler exited with code 1: boom"


def test_backoff_is_capped() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.backoff(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
