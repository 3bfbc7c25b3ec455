"""What the offline engine runs its steps on: one interface, two transports.

    StepExecutor.submit(plan) ... result() -> the oldest submitted plan's StepResult

`InProcessExecutor` wraps this process's `ModelRunner` (a plan runs at once and its
result waits in a queue); `WorkerGroupRunner` (services/launch/worker_group_runner.py)
sends plans to worker processes and awaits their results, so P pipeline stages hold P
micro-batches at once. The engine sees only this Protocol: no probing for methods.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from kvflow.proto.step import StepPlan, StepResult

if TYPE_CHECKING:
    from kvflow.gpu_worker.model_runner import ModelRunner


class StepExecutor(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """The KV cache groups' windows (kvflow/kv_groups.py)."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Plans submitted whose results `result()` has not returned yet."""
        ...

    def submit(self, plan: StepPlan) -> None:
        """Start one step; its result comes from `result()`, in submission order."""
        ...

    def result(self) -> StepResult:
        """The oldest submitted step's result (only while `num_in_flight`)."""
        ...

    def drop_all_requests(self) -> None:
        """After a failed step: forget the steps in flight and every request's batch
        state, so that the next plans start from a clean runner."""
        ...

    def close(self) -> None: ...


class InProcessExecutor:
    """This process's ModelRunner as a StepExecutor: `submit` runs the step."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._results: deque[StepResult] = deque()  # executed, not yet taken

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        return self.runner.kv_layout.windows

    @property
    def num_in_flight(self) -> int:
        return len(self._results)

    def submit(self, plan: StepPlan) -> None:
        self._results.append(self.runner.execute(plan))

    def result(self) -> StepResult:
        return self._results.popleft()

    def drop_all_requests(self) -> None:
        self._results.clear()
        self.runner.drop_all_requests()

    def close(self) -> None:
        self._results.clear()  # the model lives as long as the runner: nothing to stop
