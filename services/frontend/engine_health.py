"""The frontend's verdicts on its engines' health, for `/health`, admission and routing.

Each engine's own verdict is `EngineLink.problem` (engine_link.py); over all of them the
server is healthy while at least one engine serves, and degraded while some, not all, do.
`EngineClient` (engine_client.py) keeps the links up to date and inherits these queries.
"""

from __future__ import annotations

import time

from kvflow.errors import EngineDeadError, InvalidRequestError
from kvflow.services.frontend.engine_link import EngineLink


class EngineHealth:
    """Read-only health queries over `engines`; the subclass owns and updates them."""

    engines: list[EngineLink]
    stats_timeout_s: float

    def engine_problems(self) -> dict[str, str | None]:
        """Engine label -> None while it serves, else why not."""
        now = time.monotonic()
        return {str(e.index): e.problem(now, self.stats_timeout_s) for e in self.engines}

    def health_problem(self) -> str | None:
        """None while at least one engine serves, else why none does."""
        problems = self.engine_problems()
        if any(problem is None for problem in problems.values()):
            return None
        if len(problems) == 1:
            return next(iter(problems.values()))
        return "; ".join(f"engine {label}: {problem}" for label, problem in problems.items())

    def check_rank(self, rank: int | None) -> None:
        """InvalidRequestError (400) for a rank this server lacks, EngineDeadError (503)
        for one that is down; None asks for nothing."""
        if rank is None:
            return
        if rank >= len(self.engines):
            raise InvalidRequestError(
                f"data_parallel_rank {rank} is out of range: "
                f"this server runs {len(self.engines)} engine(s)",
                param="data_parallel_rank",
            )
        problem = self.engine_problems()[str(rank)]
        if problem is not None:
            raise EngineDeadError(f"engine {rank} is not serving: {problem}")

    @property
    def is_healthy(self) -> bool:
        return self.health_problem() is None

    @property
    def every_engine_serves(self) -> bool:
        return all(problem is None for problem in self.engine_problems().values())

    @property
    def is_degraded(self) -> bool:
        """Serving, but not with every engine."""
        problems = self.engine_problems().values()
        return any(p is None for p in problems) and any(p is not None for p in problems)
