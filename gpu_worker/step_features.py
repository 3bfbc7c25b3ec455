"""Runner features: the optional parts of a step, each an object with hooks.

    ModelRunner.execute(plan):
        on_plan(plan)                      the plan is in (a pipeline stage posts its receive)
        batch.apply_plan(plan)
        before_forward(plan)               KV loads; the draft model's proposals
        inputs = batch.prepare_inputs(plan)
        on_inputs(plan, inputs)            M-RoPE rows that one rotary position serves
        forward(inputs, layer_hook(plan))  a KV producer copies each layer out meanwhile
        pool(plan, inputs, hidden) -> result              the pooling runner: replaces
                                                          logits, sampling and after_step
        logits; on_logits(plan, inputs, sampled rows)     a grammar bitmask
        sample or verify
        after_step(plan, inputs, logits, result)          prompt logprobs, KV save + stats,
                                                          stage spans
    A step with nothing scheduled calls on_idle(plan, result) after before_forward.

A feature overrides only the hooks it needs. `StepFeatures` keeps, per hook, the bound
methods of the features that override it, built once at registration: the runner loops
over them, so a hook no feature has is an empty loop, and a feature that is not
configured is not registered at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.proto.step import StepPlan, StepResult

if TYPE_CHECKING:
    from kvflow.gpu_worker.input_batch import ModelInputs


class StepFeature:
    """Base of a runner feature: every hook does nothing (and is not called)."""

    def on_plan(self, plan: StepPlan) -> None:
        """The plan arrived; the persistent batch does not hold it yet."""

    def before_forward(self, plan: StepPlan) -> None:
        """The batch holds the plan; the step's inputs are not built yet."""

    def on_inputs(self, plan: StepPlan, inputs: ModelInputs) -> None:
        """Edit the step's inputs (ids, positions) before its forward."""

    def layer_hook(self, plan: StepPlan) -> AfterLayer | None:
        """Called by each attention layer once its K/V are stored (None: not this step)."""
        return None

    def pool(self, plan: StepPlan, inputs: ModelInputs, hidden: torch.Tensor) -> StepResult:
        """The step's result from the forward's hidden states, in place of logits and
        sampling (the pooling runner; at most one feature overrides it)."""
        raise NotImplementedError  # never called: only overriding features are

    def on_logits(self, plan: StepPlan, inputs: ModelInputs, logits: torch.Tensor) -> None:
        """Edit the sampled rows' logits [Rs, V] in place before sampling."""

    def after_step(
        self, plan: StepPlan, inputs: ModelInputs, logits: torch.Tensor, result: StepResult
    ) -> None:
        """Add to the step's result; `logits` holds every logits row of the step."""

    def on_idle(self, plan: StepPlan, result: StepResult) -> None:
        """A step with nothing scheduled (requests waiting only for KV loads)."""

    def clear(self) -> None:
        """Every request is dropped (a new scheduler knows none of them)."""


_HOOKS = (
    "on_plan", "before_forward", "on_inputs", "layer_hook", "pool", "on_logits", "after_step", "on_idle", "clear",
)  # fmt: skip


class StepFeatures:
    """The registered features' hooks, in registration order, one tuple per hook."""

    def __init__(self, features: Sequence[StepFeature] = ()) -> None:
        self.features = tuple(features)
        hooks = {name: _overriding(self.features, name) for name in _HOOKS}
        self.on_plan: tuple[Callable[[StepPlan], None], ...] = hooks["on_plan"]
        self.before_forward: tuple[Callable[[StepPlan], None], ...] = hooks["before_forward"]
        self.on_inputs: tuple[Callable[[StepPlan, ModelInputs], None], ...] = hooks["on_inputs"]
        self._layer_hooks: tuple[Callable[[StepPlan], AfterLayer | None], ...] = hooks["layer_hook"]
        self.pool: tuple[Callable[[StepPlan, ModelInputs, torch.Tensor], StepResult], ...] = hooks[
            "pool"
        ]
        assert len(self.pool) <= 1, "one feature at most replaces the sampling"
        self.on_logits: tuple[Callable[[StepPlan, ModelInputs, torch.Tensor], None], ...] = hooks[
            "on_logits"
        ]
        self.after_step: tuple[
            Callable[[StepPlan, ModelInputs, torch.Tensor, StepResult], None], ...
        ] = hooks["after_step"]
        self.on_idle: tuple[Callable[[StepPlan, StepResult], None], ...] = hooks["on_idle"]
        self._clear: tuple[Callable[[], None], ...] = hooks["clear"]

    def layer_hook(self, plan: StepPlan) -> AfterLayer | None:
        """This step's per-layer callback: None when no feature wants one (a decode
        graph can run then), the features' callbacks in order otherwise."""
        if not self._layer_hooks:
            return None
        hooks = [h for h in (make(plan) for make in self._layer_hooks) if h is not None]
        if len(hooks) <= 1:
            return hooks[0] if hooks else None

        def each(cache: torch.Tensor) -> None:
            for hook in hooks:
                hook(cache)

        return each

    def clear(self) -> None:
        for clear in self._clear:
            clear()


def _overriding(features: tuple[StepFeature, ...], name: str) -> tuple[Any, ...]:
    """The bound `name` hook of each feature whose class overrides the base's."""
    base = getattr(StepFeature, name)
    return tuple(getattr(f, name) for f in features if getattr(type(f), name) is not base)
