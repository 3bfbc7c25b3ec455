"""Presence / frequency / repetition penalty state of the persistent batch, per slot.

Each penalised slot keeps a row of output-token counts, updated incrementally: zeroed
(and filled with the outputs a resumed request already has) when its request arrives,
then one scatter-add of the token it samples each step. Nothing is ever rebuilt from
the token history, and nothing at all exists until a penalised request arrives::

    counts [slots, V] fp32     counts[s, t] = occurrences of t in slot s's output
                               (rows of unpenalised slots are never read or written)

Per step only the history positions are read (`PenaltyTensors`): a token that is in
neither the prompt nor the output keeps its logit under every penalty, so the [R, V]
work of a dense application is never needed. The prompt side of the repetition penalty
comes from the same history (the batch's token rows), so no prompt mask is kept.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.gpu_worker.sampling_metadata import PenaltyParams, PenaltyTensors, has_penalty
from kvflow.sampling_params import SamplingParams


class PenaltyState:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None  # [slots, V] fp32, made on first use
        self.active = np.zeros(num_slots, dtype=bool)  # the slot's request is penalised
        # [slots, 3] presence, frequency, repetition
        self.values = np.zeros((num_slots, 3), dtype=np.float32)

    def add(self, slot: int, params: SamplingParams, output_token_ids: torch.Tensor) -> None:
        """A request arrives in `slot` with the output it already has (after a resume)."""
        self.active[slot] = has_penalty(params)
        if not self.active[slot]:
            return
        if self.counts is None:
            shape = (len(self.active), self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
        row = self.counts[slot]
        row.zero_()
        tokens = output_token_ids.to(self.device, torch.int64)
        row.index_add_(0, tokens, torch.ones(len(tokens), device=self.device))
        self.values[slot] = (
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )

    def remove(self, slot: int) -> None:
        self.active[slot] = False

    def params(self, slots: np.ndarray) -> PenaltyParams | None:
        """The penalised rows of a batch whose row i is `slots[i]`; None if there are none."""
        rows = np.flatnonzero(self.active[slots])
        if rows.size == 0:
            return None
        values = torch.from_numpy(self.values[slots[rows]]).to(self.device)  # [Rp, 3]
        return PenaltyParams(
            rows=None if rows.size == slots.size else torch.from_numpy(rows).to(self.device),
            slots=torch.from_numpy(slots[rows]).to(self.device),
            presence=values[:, 0:1],
            frequency=values[:, 1:2],
            repetition=values[:, 2:3],
        )

    def tensors(
        self, params: PenaltyParams, token_rows: torch.Tensor, num_tokens: torch.Tensor
    ) -> PenaltyTensors:
        """This step's histories: `token_rows` [Rp, L] each penalised row's prompt +
        output token ids (on the host), of which the first `num_tokens` [Rp] are real."""
        assert self.counts is not None
        history = token_rows.to(torch.int64)  # [Rp, L]
        past_end = torch.arange(history.shape[1]) >= num_tokens.unsqueeze(1)  # [Rp, L]
        history = torch.where(past_end, history[:, :1], history).to(self.device)
        output_counts = self.counts[params.slots.unsqueeze(1), history]  # [Rp, L]
        return PenaltyTensors(params, history, output_counts)

    def record(self, params: PenaltyParams | None, sampled: torch.Tensor) -> None:
        """Count the tokens just sampled ([R] int64) in their slots' rows."""
        if params is None:
            return
        assert self.counts is not None
        tokens = sampled if params.rows is None else sampled.index_select(0, params.rows)
        ones = torch.ones(len(tokens), dtype=torch.float32, device=self.device)
        self.counts.index_put_((params.slots, tokens), ones, accumulate=True)
