"""Pipeline stages hand a step's activations along: torch.distributed send/recv.

    stage 0: embed + its layers ── (hidden, residual), spans ──▶ stage 1: its layers ──▶ …
    last stage: its layers, norm, logits, sample; StepResult.stage_spans = every stage's

Each message is two tensors, never a pickled object: the activations [2, T, hidden]
(hidden and residual stacked, in the model's dtype) and the compute spans of the stages
so far, float64 [stage, 3] rows of (stage, start, end) in wall-clock seconds. Both
shapes follow from the plan (T = its scheduled tokens) and the stage's index, so a
receiver needs no header. Every rank runs every plan in order, so the s-th message a
stage sends is the s-th its successor receives.

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
        self.spans = torch.zeros(0, 3, dtype=torch.float64)  # earlier stages', this step

    def recv(self, num_tokens: int) -> Activations:
        """The previous stage's (hidden, residual) of this step; its spans in `spans`."""
        assert self.group.prev_rank is not None
        acts = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        spans = torch.empty(self.group.stage, 3, dtype=torch.float64, device=self.device)
        works = [
            dist.irecv(acts, src=self.group.prev_rank, group=self.group.group),
            dist.irecv(spans, src=self.group.prev_rank, group=self.group.group),
        ]
        self._wait(works, "receive from")
        self.spans = spans
        return acts[0], acts[1]

    def send(self, acts: Activations, started: float) -> None:
        """Hand (hidden, residual) on, with the spans so far plus this stage's."""
        assert self.group.next_rank is not None
        self.wait_sent()
        stacked = torch.stack(acts).to(self.device, self.dtype).contiguous()
        spans = self.spans_with_own(started)
        dst = self.group.next_rank
        self._sends = [
            dist.isend(stacked, dst=dst, group=self.group.group),
            dist.isend(spans, dst=dst, group=self.group.group),
        ]
        self._sent = (stacked, spans)

    def spans_with_own(self, started: float) -> torch.Tensor:
        """The spans received, and this stage's [started, now]."""
        now = time.time()
        own = torch.tensor(
            [[self.group.stage, started, now]], dtype=torch.float64, device=self.device
        )
        return torch.cat([self.spans.to(self.device), own])

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
