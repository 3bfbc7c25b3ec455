"""Sampling parameters of the persistent batch, kept per slot across steps.

A request's `SamplingParams` are read once, when it arrives in a slot: its temperature,
top_k, top_p and min_p go into per-slot tensors, its row kind (greedy / plain /
truncated), seeded generator, logit bias, min_tokens stop ids and penalty state into
per-slot entries. Each step then only gathers::

    slots [R]  the slot of each sampled row, in batch order
       │
       ├─ composition (which slots, in which order) unchanged since the last step?
       │     yes: reuse the gathered parameter tensors and row groups
       │     no:  index_select the per-slot tensors, split the rows into groups
       ├─ min_tokens bans of the rows still below min_tokens (usually none)
       ├─ bad-word bans of the rows whose output ends with a word's first tokens
       └─ penalty histories of the penalised rows (usually none)

Slots are reused: `remove` clears what a later occupant could otherwise inherit, and
every add or remove starts a new epoch, so a cached composition is never reused across
a change of occupant (a resumed request gets a fresh generator in the same slot).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from kvflow.gpu_worker.bad_words import banned_next_tokens, longest_prefix
from kvflow.gpu_worker.penalty_state import PenaltyParams, PenaltyState
from kvflow.gpu_worker.sampling_metadata import (
    GREEDY,
    PLAIN,
    TRUNCATED,
    AllowedTokens,
    BannedTokens,
    LogitBias,
    SamplingMetadata,
    request_generator,
    row_kind,
    truncation_width,
)
from kvflow.sampling_params import SamplingParams


class TokenRows(NamedTuple):
    """The batch's token ids per slot (host memory), shared with the sampling state."""

    token_ids: torch.Tensor  # [slots, max_model_len] int32, prompt + outputs
    num_tokens: np.ndarray  # [slots] int64
    num_prompt_tokens: np.ndarray  # [slots] int64


class _Composition(NamedTuple):
    """What depends only on which slots are sampled, in which order."""

    metadata: SamplingMetadata  # with banned=None, penalties=None
    penalties: PenaltyParams | None
    penalty_slots: np.ndarray  # [Rp] int64, the slots of the penalised rows
    min_tokens_rows: list[tuple[int, int]]  # (row, slot) of slots with min_tokens > 0
    bad_words_rows: list[tuple[int, int]]  # (row, slot) of slots with bad words


class SamplingState:
    def __init__(
        self, num_slots: int, vocab_size: int, eos_token_ids: set[int], device: torch.device
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.params: list[SamplingParams | None] = [None] * num_slots
        self.generators: list[torch.Generator | None] = [None] * num_slots
        self.kind = np.zeros(num_slots, dtype=np.int8)
        self.top_k = np.zeros(num_slots, dtype=np.int64)  # clamped to V, 0 = off
        self.min_p = np.zeros(num_slots, dtype=np.float32)
        self.num_logprobs = np.full(num_slots, -1, dtype=np.int64)  # -1: none asked
        # [3, slots] temperature (1.0 for greedy rows), top_p, min_p
        self.values = torch.zeros(3, num_slots, dtype=torch.float32, device=device)
        self.logit_bias: dict[int, LogitBias] = {}  # slot -> its bias (rows unset)
        self.min_tokens: dict[int, tuple[int, list[int]]] = {}  # slot -> (min, stop ids)
        self.allowed: dict[int, torch.Tensor] = {}  # slot -> [V] bool, allowed_token_ids
        self.bad_words: dict[int, list[list[int]]] = {}  # slot -> banned token sequences
        self.penalties = PenaltyState(num_slots, vocab_size, device)
        self._epoch = 0
        self._key: tuple[int, bytes] | None = None
        self._composition: _Composition | None = None

    def add(self, slot: int, params: SamplingParams, output_token_ids: torch.Tensor) -> None:
        """A request arrives in `slot`, with the output it already has when it resumes
        after a preemption (a seeded generator replays one draw per output token)."""
        self._epoch += 1
        self.params[slot] = params
        kind = row_kind(params)
        self.kind[slot] = kind
        self.top_k[slot] = min(params.effective_top_k, self.vocab_size)
        self.min_p[slot] = params.min_p
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        temperature = 1.0 if kind == GREEDY else params.temperature
        self.values[:, slot] = torch.tensor([temperature, params.top_p, params.min_p])
        self.generators[slot] = None
        if params.seed is not None:
            self.generators[slot] = request_generator(
                params.seed, self.device, len(output_token_ids)
            )
        if params.logit_bias:
            self.logit_bias[slot] = self._bias_of(params.logit_bias)
        if len(output_token_ids) < params.min_tokens:
            self.min_tokens[slot] = (params.min_tokens, self._stop_ids(params))
        if params.allowed_token_ids:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[torch.tensor(params.allowed_token_ids, dtype=torch.int64)] = True
            self.allowed[slot] = mask
        if params.bad_words_token_ids:
            self.bad_words[slot] = params.bad_words_token_ids
        self.penalties.add(slot, params, output_token_ids)

    def remove(self, slot: int) -> None:
        self._epoch += 1
        self.params[slot] = None
        self.generators[slot] = None
        self.logit_bias.pop(slot, None)
        self.min_tokens.pop(slot, None)
        self.allowed.pop(slot, None)
        self.bad_words.pop(slot, None)
        self.penalties.remove(slot)

    def metadata(self, slots: np.ndarray, rows: TokenRows) -> SamplingMetadata:
        """This step's metadata for sampled rows whose slots are `slots` [R] int64."""
        key = (self._epoch, slots.tobytes())
        if key != self._key or self._composition is None:
            self._composition = self._compose(slots)
            self._key = key
        composition = self._composition
        banned = self._banned(composition, rows)
        penalties = None
        if composition.penalties is not None:
            pen_slots = composition.penalty_slots
            num_tokens = rows.num_tokens[pen_slots]  # [Rp]
            history = rows.token_ids[torch.from_numpy(pen_slots), : int(num_tokens.max())]
            penalties = self.penalties.tensors(
                composition.penalties, history, torch.from_numpy(num_tokens)
            )
        if banned is None and penalties is None:
            return composition.metadata
        return dataclasses.replace(composition.metadata, banned=banned, penalties=penalties)

    def record_sampled(self, metadata: SamplingMetadata, sampled: torch.Tensor) -> None:
        """The rows' sampled tokens [R] int64, for the penalised slots' output counts."""
        if metadata.penalties is not None:
            self.penalties.record(metadata.penalties.params, sampled)

    # ---- per composition -------------------------------------------------------------

    def _compose(self, slots: np.ndarray) -> _Composition:
        slot_list = slots.tolist()
        penalties = self.penalties.params(slots)
        metadata = self._gather(slots, slot_list, no_penalties=penalties is None)
        min_tokens_rows = [(row, s) for row, s in enumerate(slot_list) if s in self.min_tokens]
        bad_words_rows = [(row, s) for row, s in enumerate(slot_list) if s in self.bad_words]
        penalty_slots = slots[np.flatnonzero(self.penalties.active[slots])]
        return _Composition(metadata, penalties, penalty_slots, min_tokens_rows, bad_words_rows)

    def _gather(
        self, slots: np.ndarray, slot_list: list[int], no_penalties: bool
    ) -> SamplingMetadata:
        """The per-slot parameters of rows `slots`, and the row groups."""
        kinds = self.kind[slots]
        greedy, plain, truncated = (np.flatnonzero(kinds == k) for k in (GREEDY, PLAIN, TRUNCATED))
        random_rows = np.flatnonzero(kinds != GREEDY)
        width, has_top_p_only = truncation_width(
            self.top_k[slots[truncated]], self.vocab_size, self.device
        )
        gens = self.generators
        seeded = {r: g for r in random_rows.tolist() if (g := gens[slot_list[r]]) is not None}
        values = self.values.index_select(1, self._tensor(slots))  # [3, R]
        num_logprobs = int(self.num_logprobs[slots].max(initial=-1))
        return SamplingMetadata(
            temperature=values[0],
            top_k=self._tensor(self.top_k[slots]),
            top_p=values[1],
            min_p=values[2],
            greedy_rows=self._tensor(greedy),
            plain_rows=self._tensor(plain),
            truncated_rows=self._tensor(truncated),
            all_greedy=random_rows.size == 0,
            all_random=greedy.size == 0,
            no_penalties=no_penalties,
            no_top_k_top_p=truncated.size == 0,
            no_min_p=not bool((self.min_p[slots[random_rows]] > 0).any()),
            truncation_width=width,
            may_fall_short=has_top_p_only and width < self.vocab_size,
            has_top_p_only=has_top_p_only,
            penalties=None,
            logit_bias=self._logit_bias(slot_list),
            banned=None,
            generators=seeded,
            seeded_rows=self._tensor(np.array(list(seeded), dtype=np.int64)),
            max_num_logprobs=None if num_logprobs < 0 else num_logprobs,
            allowed=self._allowed(slot_list),
        )

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device)

    def _logit_bias(self, slot_list: list[int]) -> LogitBias | None:
        parts = [
            (row, self.logit_bias[s]) for row, s in enumerate(slot_list) if s in self.logit_bias
        ]
        if not parts:
            return None
        return LogitBias(
            rows=torch.cat([torch.full_like(b.token_ids, row) for row, b in parts]),
            token_ids=torch.cat([b.token_ids for _, b in parts]),
            values=torch.cat([b.values for _, b in parts]),
        )

    def _allowed(self, slot_list: list[int]) -> AllowedTokens | None:
        parts = [(row, self.allowed[s]) for row, s in enumerate(slot_list) if s in self.allowed]
        if not parts:
            return None
        rows = torch.tensor([row for row, _ in parts], dtype=torch.int64, device=self.device)
        return AllowedTokens(rows=rows, mask=torch.stack([mask for _, mask in parts]))

    def _bias_of(self, logit_bias: dict[int, float]) -> LogitBias:
        device = self.device
        return LogitBias(
            rows=torch.empty(0, dtype=torch.int64, device=device),
            token_ids=torch.tensor(list(logit_bias), dtype=torch.int64, device=device),
            values=torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=device),
        )

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        """What min_tokens holds back: EOS unless ignore_eos, plus stop_token_ids."""
        stops = set(params.stop_token_ids or ()) | (
            set() if params.ignore_eos else self.eos_token_ids
        )
        return sorted(stops)

    # ---- per step ----------------------------------------------------------------------

    def _banned(self, composition: _Composition, rows: TokenRows) -> BannedTokens | None:
        """Stop ids of the rows still below min_tokens, and the bad words' next tokens."""
        pairs = self._min_tokens_bans(composition.min_tokens_rows, rows)
        for row, slot in composition.bad_words_rows:
            output = self.recent_output(slot, rows)
            pairs.extend((row, t) for t in banned_next_tokens(self.bad_words[slot], output))
        if not pairs:
            return None
        row_ids, token_ids = zip(*pairs)
        return BannedTokens(
            rows=torch.tensor(row_ids, dtype=torch.int64, device=self.device),
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
        )

    def recent_output(self, slot: int, rows: TokenRows) -> list[int]:
        """The end of the slot's output that a bad-word match can need."""
        end = int(rows.num_tokens[slot])
        start = max(int(rows.num_prompt_tokens[slot]), end - longest_prefix(self.bad_words[slot]))
        return rows.token_ids[slot, start:end].tolist()  # type: ignore[no-any-return]

    def _min_tokens_bans(
        self, min_tokens_rows: list[tuple[int, int]], rows: TokenRows
    ) -> list[tuple[int, int]]:
        """A slot that reached min_tokens leaves `min_tokens` for good: its output only
        grows while it holds the slot."""
        pairs: list[tuple[int, int]] = []
        for row, slot in min_tokens_rows:
            entry = self.min_tokens.get(slot)
            if entry is None:
                continue
            min_tokens, stop_ids = entry
            if rows.num_tokens[slot] - rows.num_prompt_tokens[slot] >= min_tokens:
                del self.min_tokens[slot]
                continue
            pairs.extend((row, token) for token in stop_ids)
        return pairs
