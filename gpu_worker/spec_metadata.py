"""Sampling metadata for verifying drafts: one row per verified position.

The persistent batch gives one `SamplingMetadata` row per sampled request. Verifying
request r's k_r drafts needs k_r + 1 rows (after the context, after d_0, ...), each
processed exactly as normal decoding would process it at that position::

    request rows      r                      params, bias: the request's own
    position rows     (r, 0) (r, 1) ... (r, k_r)
    history of (r, j) prompt + output + d_<j   penalties count d_<j as output tokens,
                                               and min_tokens counts them as outputs

Seeded generators stay per request (the rejection sampler draws for each request's
positions), so the expanded metadata carries none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvflow.gpu_worker.bad_words import banned_next_tokens
from kvflow.gpu_worker.sampling_metadata import (
    AllowedTokens,
    BannedTokens,
    LogitBias,
    PenaltyParams,
    PenaltyTensors,
    SamplingMetadata,
)
from kvflow.gpu_worker.sampling_state import SamplingState, TokenRows


@dataclasses.dataclass(frozen=True)
class DraftRows:
    """Where each request's positions land in the expanded rows."""

    num_draft_tokens: list[int]  # [R]
    draft_token_ids: list[list[int]]  # [R][k_r]
    request_of_row: torch.Tensor  # [N] int64, N = sum(k_r + 1)
    offsets: list[int]  # [R] first row of each request

    @classmethod
    def build(cls, drafts: Sequence[Sequence[int]], device: torch.device) -> DraftRows:
        counts = [len(d) for d in drafts]
        repeats = torch.tensor([k + 1 for k in counts], dtype=torch.int64)
        request_of_row = torch.repeat_interleave(torch.arange(len(counts)), repeats)
        offsets = np.concatenate([[0], np.cumsum([k + 1 for k in counts])[:-1]]).tolist()
        return cls(counts, [list(d) for d in drafts], request_of_row.to(device), offsets)

    def rows_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Expanded rows of the request rows `rows` [n], each request's positions in order."""
        wanted = rows.tolist()
        out = [self.offsets[r] + j for r in wanted for j in range(self.num_draft_tokens[r] + 1)]
        return torch.tensor(out, dtype=torch.int64, device=rows.device)


class Verification(NamedTuple):
    metadata: SamplingMetadata  # one row per position
    requests: SamplingMetadata  # one row per request (its generators are the seeded ones)
    rows: DraftRows


def verification_metadata(
    state: SamplingState, rows: TokenRows, slots: np.ndarray, drafts: Sequence[Sequence[int]]
) -> Verification:
    """The metadata of the requests in `slots` [R] with their drafts, from the
    persistent batch's sampling state."""
    requests = state.metadata(slots, rows)
    draft_rows = DraftRows.build(drafts, state.device)
    min_tokens: list[tuple[int, list[int]] | None] = []
    for slot in slots.tolist():
        entry = state.min_tokens.get(slot)
        owed = (
            0
            if entry is None
            else entry[0] - int(rows.num_tokens[slot] - rows.num_prompt_tokens[slot])
        )
        min_tokens.append((owed, entry[1]) if entry is not None and owed > 0 else None)
    counts = None
    if requests.penalties is not None:
        assert state.penalties.counts is not None
        counts = state.penalties.counts.index_select(0, requests.penalties.params.slots)
    bad_words = _bad_word_bans(state, rows, slots, draft_rows)
    expanded = expand_metadata(requests, draft_rows, min_tokens, counts, bad_words)
    return Verification(expanded, requests, draft_rows)


def _bad_word_bans(
    state: SamplingState, rows: TokenRows, slots: np.ndarray, drafts: DraftRows
) -> list[tuple[int, int]]:
    """(row, token) bans of bad words at each position: the history of (r, j) ends
    with the drafts d_<j."""
    pairs: list[tuple[int, int]] = []
    for r, slot in enumerate(slots.tolist()):
        sequences = state.bad_words.get(slot)
        if sequences is None:
            continue
        output = state.recent_output(slot, rows)
        for j in range(drafts.num_draft_tokens[r] + 1):
            history = output + drafts.draft_token_ids[r][:j]
            row = drafts.offsets[r] + j
            pairs.extend((row, token) for token in banned_next_tokens(sequences, history))
    return pairs


def expand_metadata(
    md: SamplingMetadata,
    drafts: DraftRows,
    min_tokens: Sequence[tuple[int, list[int]] | None],  # per request: (min left, stop ids)
    penalty_counts: torch.Tensor | None,  # [Rp, V] output counts of the penalised requests
    bad_word_bans: Sequence[tuple[int, int]] = (),  # (expanded row, token)
) -> SamplingMetadata:
    """`md` with one row per verified position. `min_tokens[r]`: how many more outputs
    request r must produce before its stop ids are allowed, with those ids (None: none).
    """
    rep = drafts.request_of_row  # [N]
    return dataclasses.replace(
        md,
        temperature=md.temperature.index_select(0, rep),
        top_k=md.top_k.index_select(0, rep),
        top_p=md.top_p.index_select(0, rep),
        min_p=md.min_p.index_select(0, rep),
        greedy_rows=drafts.rows_of(md.greedy_rows),
        plain_rows=drafts.rows_of(md.plain_rows),
        truncated_rows=drafts.rows_of(md.truncated_rows),
        penalties=_penalties(md.penalties, drafts, penalty_counts),
        logit_bias=_logit_bias(md.logit_bias, drafts),
        banned=_banned(drafts, min_tokens, md.temperature.device, bad_word_bans),
        allowed=_allowed(md.allowed, drafts),
        generators={},
        seeded_rows=md.seeded_rows[:0],
    )


def _logit_bias(bias: LogitBias | None, drafts: DraftRows) -> LogitBias | None:
    if bias is None:
        return None
    rows, tokens, values = [], [], []
    for entry_row, token, value in zip(bias.rows.tolist(), bias.token_ids, bias.values):
        for j in range(drafts.num_draft_tokens[entry_row] + 1):
            rows.append(drafts.offsets[entry_row] + j)
            tokens.append(token)
            values.append(value)
    device = bias.rows.device
    return LogitBias(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        token_ids=torch.stack(tokens),
        values=torch.stack(values),
    )


def _allowed(allowed: AllowedTokens | None, drafts: DraftRows) -> AllowedTokens | None:
    """Each allowed row's mask at every one of its positions."""
    if allowed is None:
        return None
    repeats = [drafts.num_draft_tokens[r] + 1 for r in allowed.rows.tolist()]
    counts = torch.tensor(repeats, dtype=torch.int64, device=allowed.mask.device)
    return AllowedTokens(
        rows=drafts.rows_of(allowed.rows), mask=allowed.mask.repeat_interleave(counts, dim=0)
    )


def _banned(
    drafts: DraftRows,
    min_tokens: Sequence[tuple[int, list[int]] | None],
    device: torch.device,
    bad_word_bans: Sequence[tuple[int, int]],
) -> BannedTokens | None:
    """Row (r, j) has j more outputs than request r: banned while j < outputs still owed."""
    pairs = [
        (drafts.offsets[r] + j, token)
        for r, entry in enumerate(min_tokens)
        if entry is not None
        for j in range(min(entry[0], drafts.num_draft_tokens[r] + 1))
        for token in entry[1]
    ]
    pairs += bad_word_bans
    if not pairs:
        return None
    rows, tokens = zip(*pairs)
    return BannedTokens(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        token_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
    )


def _penalties(
    pen: PenaltyTensors | None, drafts: DraftRows, counts: torch.Tensor | None
) -> PenaltyTensors | None:
    """Histories grow by d_<j and the output counts count d_<j (dense [V] count rows:
    only the few penalised requests' positions need them)."""
    if pen is None:
        return None
    assert counts is not None
    params = pen.params
    device = pen.token_ids.device
    req_rows = params.rows if params.rows is not None else torch.arange(len(counts), device=device)
    histories, count_rows, expanded_rows, index = [], [], [], []
    for i, r in enumerate(req_rows.tolist()):
        history = pen.token_ids[i].tolist()
        row_counts = counts[i].clone()
        for j in range(drafts.num_draft_tokens[r] + 1):
            if j > 0:
                token = drafts.draft_token_ids[r][j - 1]
                history.append(token)
                row_counts[token] += 1
            histories.append(list(history))
            count_rows.append(row_counts.clone())
            expanded_rows.append(drafts.offsets[r] + j)
            index.append(i)
    width = max(len(h) for h in histories)
    ids = torch.tensor([h + [h[0]] * (width - len(h)) for h in histories], device=device)
    dense = torch.stack(count_rows)  # [Rp', V]
    take = torch.tensor(index, dtype=torch.int64, device=device)
    expanded = PenaltyParams(
        rows=torch.tensor(expanded_rows, dtype=torch.int64, device=device),
        slots=params.slots.index_select(0, take),
        presence=params.presence.index_select(0, take),
        frequency=params.frequency.index_select(0, take),
        repetition=params.repetition.index_select(0, take),
    )
    return PenaltyTensors(expanded, ids, dense.gather(1, ids))
