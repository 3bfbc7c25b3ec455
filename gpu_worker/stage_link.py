"""Pipeline stages hand a step's activations along: torch.distributed send/recv.

    stage 0: embed + its layers ── (hidden, residual), spans ──▶ stage 1: its layers ──▶ …
    last stage: its layers, norm, logits, sample; StepResult.stage_spans = every stage's

Each message is two tensors, never a pickled object: the activations [2, T, hidden]
(hidden and residual stacked, in the model's dtype) and the busy spans of the stages
so far, float64 [2 * stage, 3] rows of (stage, start, end) in wall-clock seconds, two
per stage: from the plan's arrival to when it waits for its input, and from the input's
arrival to its hand-off (to its sample, on the last stage). Both shapes follow from the
plan (T = its scheduled tokens) and the stage's index, so a receiver needs no header
and posts its receive as soon as the plan is in. Every rank runs every plan in order,
so the s-th message a stage sends is the s-th its successor receives.

Sends are asynchronous (`isend`): a stage goes on to its next micro-batch while its
successor still runs the last one, and waits for the previous send only before the
next. Every wait is bounded by the group's step timeout: a stage whose neighbour died
or hangs raises instead of stalling the engine.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvflow.gpu_worker.parallel_state import PPGroup

Activations = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual), each [T, hidden]


class StageLink:
    """One rank's hand-offs, step by step: `begin(num_tokens)` as the plan arrives (posts
    the receive, so the activations land while the batch is prepared), `activations()`
    when the forward needs them, `send(...)` when this stage is done (not the last)."""

    def __init__(
        self, group: PPGroup, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        assert group.size > 1, "one stage hands nothing along"
        self.group = group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device  # NCCL sends device tensors, gloo host ones
        self._timeout = timedelta(seconds=group.timeout_s)
        self._sends: list[dist.Work | None] = []  # the previous step's, awaited before the next
        self._sent: tuple[torch.Tensor, ...] = ()  # kept alive until those complete
        self._recvs: list[dist.Work | None] = []
        self._acts = self._spans = torch.zeros(0)
        # This step's times (wall clock): plan in, waiting for activations from .. to.
        self._began = self._waited_from = self._waited_to = 0.0

    def begin(self, num_tokens: int) -> None:
        """A step of `num_tokens` tokens starts here: post its receive (not the first)."""
        self._began = time.time()
        if self.group.is_first:
            return
        src, group = self.group.prev_rank, self.group.group
        assert src is not None
        self._acts = torch.empty(
            2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device
        )
        rows = 2 * self.group.stage  # two spans per earlier stage
        self._spans = torch.empty(rows, 3, dtype=torch.float64, device=self.device)
        self._recvs = [
            dist.irecv(self._acts, src=src, group=group),
            dist.irecv(self._spans, src=src, group=group),
        ]

    def activations(self) -> Activations | None:
        """The previous stage's (hidden, residual) of this step; None on the first."""
        self._waited_from = time.time()
        if self.group.is_first:
            self._waited_to = self._waited_from
            return None
        self._wait(self._recvs, "receive from")
        self._recvs = []
        self._waited_to = time.time()
        return self._acts[0], self._acts[1]

    def send(self, acts: Activations) -> None:
        """Hand (hidden, residual) on, with the spans so far plus this stage's."""
        assert self.group.next_rank is not None
        self.wait_sent()
        stacked = torch.stack(acts).to(self.device, self.dtype).contiguous()
        spans = self.spans().to(self.device)
        dst, group = self.group.next_rank, self.group.group
        self._sends = [
            dist.isend(stacked, dst=dst, group=group),
            dist.isend(spans, dst=dst, group=group),
        ]
        self._sent = (stacked, spans)

    def spans(self) -> torch.Tensor:
        """[2 * (stage + 1), 3] float64: the earlier stages' spans and this stage's two,
        (stage, start, end): plan in .. waiting for activations, and activations there
        .. now. The gap between them is the wait (zero on the first stage)."""
        stage = self.group.stage
        own = torch.tensor(
            [[stage, self._began, self._waited_from], [stage, self._waited_to, time.time()]],
            dtype=torch.float64,
        )
        if self.group.is_first:
            return own
        return torch.cat([self._spans.cpu(), own])

    def wait_sent(self) -> None:
        self._wait(self._sends, "send to")
        self._sends, self._sent = [], ()

    def _wait(self, works: list[dist.Work | None], what: str) -> None:
        for work in works:
            if work is None:  # not a member of the group: cannot happen (every rank is)
                continue
            try:
                work.wait(self._timeout)
            except RuntimeError as exc:
                peer = self.group.prev_rank if what.startswith("receive") else self.group.next_rank
                raise RuntimeError(
                    f"pipeline stage {self.group.stage}: {what} rank {peer} failed: {exc}"
                ) from exc
