"""Is every worker rank alive? Heartbeats, and a hint when a connection drops.

Workers beat every second from a side thread (also while a long step runs: torch
releases the GIL). The input thread turns a dropped connection on the result socket
into `WorkerDisconnected`, which shortens the wait from `timeout_s` to `grace_s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Liveness:
    """Last sign of life per worker rank (monotonic seconds).

    A rank is dead after `timeout_s` of silence. Sooner when one of the workers'
    connections dropped (`suspect`): a live worker beats every second, so a rank
    silent for `grace_s` after the drop is the one that went away.
    """

    timeout_s: float
    last_seen: dict[int, float] = field(default_factory=dict)
    grace_s: float = 1.5
    suspect_since: float | None = None

    def beat(self, rank: int, now: float) -> None:
        self.last_seen[rank] = now

    def suspect(self, now: float) -> None:
        self.suspect_since = now

    def dead_reason(self, now: float) -> str | None:
        """Why some rank is considered dead, or None while all look alive."""
        suspect = self.suspect_since
        for rank, seen in self.last_seen.items():
            if now - seen > self.timeout_s:
                return f"worker rank {rank} sent no heartbeat for {self.timeout_s:g} s"
            if suspect is not None and seen < suspect and now - suspect > self.grace_s:
                return f"worker rank {rank} dropped its connection and went silent"
        if suspect is not None and all(seen >= suspect for seen in self.last_seen.values()):
            self.suspect_since = None  # every rank spoke since: a reconnect, not a death
        return None


@dataclass(frozen=True)
class WorkerDisconnected:
    """From the input thread: a connection of some worker dropped (not a wire message)."""


@dataclass
class EngineRefusals:
    """Peers refused on the tcp links of this engine's processes, cumulative by role:
    the scheduler's own, each worker rank's (in its heartbeats) and the detokenizer's."""

    workers: dict[int, int] = field(default_factory=dict)  # rank -> count
    others: dict[str, int] = field(default_factory=dict)  # role -> count

    def by_role(self) -> dict[str, int]:
        from kvflow.runtime.cluster_auth import REFUSALS

        return {"scheduler": REFUSALS.count, "worker": sum(self.workers.values()), **self.others}
