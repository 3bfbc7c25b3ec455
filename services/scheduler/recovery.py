"""Worker crash recovery: the scheduler's side of a worker that died and comes back.

    running ──worker lost (ProcessFailed, silence, dropped connection)──▶ recovering
      │  steps in flight dropped; every running request preempted (recompute)
      │  hello "<scheduler incarnation>.<generation>" re-sent every HELLO_INTERVAL_S
    recovering ──WorkerInfo answering the current hello──▶ running (requests resume)
    recovering ──no answer for timeout_s──▶ dead (exit 1: a supervisor takes over)

Whoever restarts the worker (the launcher's supervisor, or Docker's restart policy)
is not the scheduler's concern: it only waits for a worker that answers its hello.
Each hello has its own id, so a WorkerInfo that answers an older hello (a worker that
was only slow) is not taken for the new worker's. A StepResult that arrives while
recovering comes from the dead worker's steps, which were dropped: it is ignored, and
since step ids only grow, a late one can never match a step planned afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HELLO_INTERVAL_S = 0.5  # also covers a new worker's SUB joining after a hello was sent
WORKER_RECOVERY_TIMEOUT_S = 600.0  # model reload + the supervisor's backoff


@dataclass
class WorkerRecovery:
    """Counts, and the state of a recovery under way (`reason` is None while running)."""

    incarnation: str  # the scheduler's
    timeout_s: float = WORKER_RECOVERY_TIMEOUT_S
    generation: int = 0  # hellos sent since start-up (the start-up one is 0)
    first_generation: int = 1  # the first hello of the recovery under way
    reason: str | None = None  # why the worker is considered lost, while recovering
    since: float = 0.0  # monotonic, when it was lost
    next_hello: float = 0.0
    num_worker_restarts: int = 0  # workers that came back after a loss
    num_resumed_requests: int = 0  # requests preempted by a loss (they resume)
    # The worker processes every hello tells to exit (SchedulerHello.leave): the other
    # ranks of a multi-rank group, as they were when one rank came back as a new process.
    # Kept after the recovery: their own restarts are expected, not a new loss.
    leaving: list[str] = field(default_factory=list)
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> its latest heartbeat's process

    @property
    def recovering(self) -> bool:
        return self.reason is not None

    def lost(self, reason: str, now: float, num_preempted: int) -> None:
        self.reason = reason
        self.since = now
        self.next_hello = now
        self.first_generation = self.generation + 1
        self.num_resumed_requests += num_preempted

    def hello_due(self, now: float) -> str | None:
        """The id of a hello to send now, or None."""
        if not self.recovering or now < self.next_hello:
            return None
        self.generation += 1
        self.next_hello = now + HELLO_INTERVAL_S
        return f"{self.incarnation}.{self.generation}"

    def answers(self, hello_id: str) -> bool:
        """Whether a WorkerInfo for `hello_id` ends the recovery: it answers a hello of
        this recovery (a new worker may answer one queued before the latest)."""
        prefix, _, generation = hello_id.rpartition(".")
        return (
            self.recovering
            and prefix == self.incarnation
            and generation.isdigit()
            and int(generation) >= self.first_generation
        )

    def back(self, now: float) -> float:
        """The worker answered: running again; how long the worker was away."""
        self.reason = None
        self.num_worker_restarts += 1
        return now - self.since

    def rank_restarted(self, rank: int, worker: str) -> bool:
        """Record the process a heartbeat of `rank` came from. True when a rank of a
        multi-rank group is back as a new process it was not told to be: the other
        ranks are still in the old group (a rank learns of a dead peer only at its next
        collective), where the new one would wait at the rendezvous for them for ever;
        `leaving` names them, every hello tells them to exit, and their restart policy
        forms the group again. (A rank merely silent, maybe slow, is not enough.)"""
        known, self.ranks[rank] = self.ranks.get(rank), worker
        if not known or known == worker or len(self.ranks) < 2 or known in self.leaving:
            return False
        self.leaving = sorted(w for r, w in self.ranks.items() if r != rank and w)
        return True

    def timed_out(self, now: float) -> str | None:
        if self.recovering and now - self.since > self.timeout_s:
            return f"{self.reason}; no worker came back within {self.timeout_s:g} s"
        return None
