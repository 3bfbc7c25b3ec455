"""The launcher's child processes: start (spawn), wait for acks, watch, stop.

Children are started with multiprocessing's "spawn" method: a fresh interpreter that
gets only picklable arguments (config dataclasses, addresses, paths; never a socket).
Each child names itself ("kvflow-worker0" in ps and /proc/<pid>/comm), ignores SIGINT
(a terminal's Ctrl-C reaches the whole process group, but only the launcher decides
the order of shutdown) and dies with the launcher (PR_SET_PDEATHSIG).

Supervision (`supervise`, polled by the launcher's supervisor thread once every role is
ready): a dead worker is restarted (its model reloaded; the scheduler resumes its
requests once it answers) after a backoff that doubles per restart, at most
`RestartPolicy.max_worker_restarts` times. Any other dead role, or a worker past that
budget, is fatal: `watchdog()` names it from then on, and the launcher exits 1 so that
Docker's or systemd's restart policy takes over. Polling also reaps every exited child:
none is left a zombie.

Shutdown: `Shutdown` to the scheduler (once it is ready), which passes it to the
workers and the detokenizer; whoever is still alive after `timeout_s` gets SIGTERM
(which ends a child still loading at once), then SIGKILL.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from kvflow.errors import KvflowError
from kvflow.proto.control import LauncherInput, ProcessFailed, ProcessReady
from kvflow.proto.step import Shutdown
from kvflow.runtime.lifecycle import StopFlag, die_with_parent, set_process_name
from kvflow.runtime.sockets import TypedSocket
from kvflow.services.launch.spawn_guard import (
    UNGUARDED_MAIN_EXIT,
    exit_if_bootstrapping,
    unguarded_main_message,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100


class LaunchError(KvflowError):
    """A child failed or timed out at start-up; the message names it."""


@dataclass(frozen=True)
class RestartPolicy:
    """How often a dead worker is restarted before the launcher gives up."""

    max_worker_restarts: int = 3  # over the launcher's life; 0 = never restart
    backoff_s: float = 1.0  # before the first restart; doubled for each further one
    max_backoff_s: float = 30.0

    def backoff(self, num_restarts: int) -> float:
        return min(self.backoff_s * 2**num_restarts, self.max_backoff_s)


@dataclass
class Child:
    role: str
    rank: int
    process: BaseProcess
    target: Callable[..., int]
    args: tuple[Any, ...]
    ready: ProcessReady | None = None
    error: str | None = None  # from its ProcessFailed
    num_restarts: int = 0
    restart_at: float | None = None  # monotonic; set while a restart waits its backoff

    @property
    def name(self) -> str:
        return f"worker rank {self.rank}" if self.role == "worker" else self.role

    def exit_description(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"{self.name} {how}" + (f": {self.error}" if self.error else "")


class ChildProcesses:
    def __init__(self, context: zmq.Context, ack_address: str) -> None:
        self.children: list[Child] = []
        self.ack_address = ack_address
        self._acks = TypedSocket.open(
            context, zmq.PULL, ack_address, bind=True, recv_type=LauncherInput
        )
        self._context = context
        self._spawn = multiprocessing.get_context("spawn")
        self.fatal: str | None = None  # set by supervise(): what ended the engine

    def start(self, role: str, rank: int, target: Callable[..., int], *args: Any) -> Child:
        """Start `target(*args, launcher_address=...)` in a fresh interpreter."""
        exit_if_bootstrapping()  # we are a child re-running an unguarded main script
        child = Child(role, rank, self._process(role, rank, target, args), target, args)
        self.children.append(child)
        logger.info("started %s (pid %d)", child.name, child.process.pid)
        return child

    def _process(
        self, role: str, rank: int, target: Callable[..., int], args: tuple[Any, ...]
    ) -> BaseProcess:
        process = self._spawn.Process(
            target=_child_main,
            args=(os.getpid(), f"{role}{rank}", logging.getLogger().level, target, args),
            kwargs={"launcher_address": self.ack_address},
            name=f"kvflow-{role}{rank}",
        )
        process.start()
        return process

    def wait_ready(self, timeout_s: float, stop: StopFlag) -> None:
        """Until every child acked; LaunchError naming the one that failed or is late."""
        deadline = time.monotonic() + timeout_s
        while any(child.ready is None for child in self.children):
            self._read_acks(_POLL_MS)
            if any(c.error is not None or not c.process.is_alive() for c in self.children):
                self._read_acks(_POLL_MS)  # a root cause and its echoes arrive together
                raise LaunchError(self._first_failure())
            if stop.is_set():
                raise LaunchError("interrupted while starting")
            if time.monotonic() > deadline:
                late = ", ".join(c.name for c in self.children if c.ready is None)
                raise LaunchError(f"timed out after {timeout_s:g} s waiting for: {late}")

    def _first_failure(self) -> str:
        """In start order (workers first): a worker's failure also fails the scheduler."""
        for child in self.children:
            if child.error is not None:
                return f"{child.name} failed to start: {child.error}"
        for child in self.children:
            if child.process.exitcode == UNGUARDED_MAIN_EXIT:
                return unguarded_main_message()
        for child in self.children:
            if not child.process.is_alive():
                return f"{child.exit_description()} before it was ready"
        raise AssertionError("no child failed")

    def watchdog(self) -> str | None:
        """None while the engine runs or recovers; else why it cannot (thread-safe:
        it only reads what the supervisor thread found)."""
        return self.fatal

    def supervise(self, policy: RestartPolicy, now: float) -> str | None:
        """Reap dead children, restart dead workers within the budget (after their
        backoff); the fatal reason once there is one."""
        self._read_acks(0)
        for child in self.children:
            if self.fatal is None and not child.process.is_alive():
                self.fatal = self._on_dead(child, policy, now)
        return self.fatal

    def _on_dead(self, child: Child, policy: RestartPolicy, now: float) -> str | None:
        if child.role != "worker":
            return child.exit_description()
        if child.num_restarts >= policy.max_worker_restarts:
            budget = policy.max_worker_restarts
            return f"{child.exit_description()}; restart budget spent ({budget} restarts)"
        if child.restart_at is None:
            child.restart_at = now + policy.backoff(child.num_restarts)
            logger.error(
                "%s; restart %d of %d in %.1f s",
                child.exit_description(),
                child.num_restarts + 1,
                policy.max_worker_restarts,
                child.restart_at - now,
            )
        elif now >= child.restart_at:
            self._restart(child)
        return None

    def _restart(self, child: Child) -> None:
        child.process = self._process(child.role, child.rank, child.target, child.args)
        child.ready, child.error, child.restart_at = None, None, None
        child.num_restarts += 1
        logger.warning("restarted %s (pid %d)", child.name, child.process.pid)

    @property
    def num_worker_restarts(self) -> int:
        return sum(c.num_restarts for c in self.children if c.role == "worker")

    def shutdown(self, scheduler_input: str, timeout_s: float) -> None:
        """Shutdown via the scheduler, then SIGTERM and SIGKILL for stragglers."""
        start = time.monotonic()
        scheduler = next((c for c in self.children if c.role == "scheduler"), None)
        if scheduler is not None and scheduler.ready and scheduler.process.is_alive():
            # Open until the children exit: delivery may wait for a slow connect.
            socket = TypedSocket.open(self._context, zmq.PUSH, scheduler_input, bind=False)
            socket.send(Shutdown())
            self._join_all(timeout_s)
            socket.close()
        for stage, timeout in ((BaseProcess.terminate, timeout_s), (BaseProcess.kill, 2.0)):
            alive = [c for c in self.children if c.process.is_alive()]
            for child in alive:
                logger.warning("%s did not exit: %s", child.name, stage.__name__)
                stage(child.process)
            self._join_all(timeout)
        self._acks.close()
        logger.info("children stopped in %.1f s", time.monotonic() - start)

    def _join_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            child.process.join(max(0.0, deadline - time.monotonic()))

    def _read_acks(self, timeout_ms: int) -> None:
        while True:
            try:
                message = self._acks.recv(timeout_ms=timeout_ms)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropped a malformed ack: %s", exc)
                continue
            if message is None:
                return
            timeout_ms = 0
            self._record(message)

    def _record(self, message: ProcessReady | ProcessFailed) -> None:
        for child in self.children:
            if (child.role, child.rank) != (message.role, message.rank):
                continue
            match message:
                case ProcessReady():
                    child.ready = message
                case ProcessFailed(error=error):
                    child.error = error
                    logger.error("%s failed: %s", child.name, error)


def _child_main(
    parent_pid: int,
    name: str,
    log_level: int,
    target: Callable[..., int],
    args: tuple[Any, ...],
    **kwargs: Any,
) -> None:
    """Entry point of every child (runs in the spawned interpreter).

    Exits with os._exit once `target` returned (its sockets are closed and flushed by
    then): tearing down an interpreter that imported torch costs seconds of CPU.
    """
    die_with_parent(parent_pid)
    set_process_name(f"kvflow-{name}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(levelname)s {name} %(name)s: %(message)s")
    code = target(*args, **kwargs)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
