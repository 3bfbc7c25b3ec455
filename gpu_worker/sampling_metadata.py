"""What the `Sampler` reads for one step: the sampled rows' parameters as tensors.

The persistent batch keeps sampling parameters per slot (`sampling_state.py`) and hands
the sampler one `SamplingMetadata` per step, row i of every tensor being the i-th
sampled request. The rows are sorted into three disjoint groups so the sampler only
does the [R, V] work a row actually needs::

    greedy_rows     temperature == 0            -> argmax, no randomness consumed
    truncated_rows  random, top_k > 0 or top_p < 1
                                                -> sample among the top-`width` candidates
    plain_rows      random, no top_k / top_p    -> inverse-CDF sample over the whole vocab

Invariants:
- the three groups partition range(R) and each is sorted ascending, so a group with R
  members is exactly arange(R) and the sampler can skip gathering it;
- `generators` holds only random rows (a greedy row never consumes its generator), in the
  same order as `seeded_rows`;
- penalties, logit bias and min_tokens bans are None when no row uses them, so their
  work is skipped entirely;
- the sampler only reads these tensors: while the batch's composition stays the same,
  the next step gets the very same parameter tensors again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.sampling_params import SamplingParams

# Candidates a top_p-only row starts from on CPU; rows whose nucleus is larger fall back
# to a radix select over the vocabulary (sorting [64, 49152] on CPU costs ~200 ms).
TOP_P_START_WIDTH = 64

# Row kinds, as stored per slot.
GREEDY, PLAIN, TRUNCATED = 0, 1, 2


@dataclass(frozen=True, eq=False)
class PenaltyParams:
    """The Rp sampled rows with a presence/frequency/repetition penalty, and their slots
    in the persistent state (where their output-token counts live)."""

    rows: torch.Tensor | None  # [Rp] int64 batch rows; None = every row (no gather)
    slots: torch.Tensor  # [Rp] int64
    presence: torch.Tensor  # [Rp, 1] fp32
    frequency: torch.Tensor  # [Rp, 1] fp32
    repetition: torch.Tensor  # [Rp, 1] fp32, 1.0 = off


@dataclass(frozen=True, eq=False)
class PenaltyTensors:
    """Penalties are applied over each row's history only, never over [Rp, V]: a token
    outside the history has no output count and is not in the prompt, so every penalty
    leaves its logit as it is.

    `token_ids` holds the row's prompt + output tokens, padded to the longest row with
    its first prompt token; a token listed twice gets the same new value both times."""

    params: PenaltyParams
    token_ids: torch.Tensor  # [Rp, L] int64
    output_counts: torch.Tensor  # [Rp, L] fp32, occurrences of token_ids[i, j] in row i's output


@dataclass(frozen=True, eq=False)
class LogitBias:
    """Sparse (row, token, bias) triples added to the logits."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] fp32


@dataclass(frozen=True, eq=False)
class BannedTokens:
    """Sparse (row, token) pairs whose logit becomes -inf (stop tokens before min_tokens)."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64


@dataclass(frozen=True, eq=False)
class AllowedTokens:
    """Rows that may sample only some tokens (allowed_token_ids): the rest become -inf."""

    rows: torch.Tensor  # [Ra] int64
    mask: torch.Tensor  # [Ra, V] bool, True: may be sampled


@dataclass(frozen=True, eq=False)
class SamplingMetadata:
    temperature: torch.Tensor  # [R] fp32; greedy rows hold 1.0 so dividing is always safe
    top_k: torch.Tensor  # [R] int64, 0 = off, else clamped to V
    top_p: torch.Tensor  # [R] fp32, 1.0 = off
    min_p: torch.Tensor  # [R] fp32, 0.0 = off
    greedy_rows: torch.Tensor  # [Rg] int64
    plain_rows: torch.Tensor  # [Rn] int64
    truncated_rows: torch.Tensor  # [Rt] int64
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k_top_p: bool
    no_min_p: bool  # no random row has min_p > 0
    # Candidates the truncated rows are sampled from; `may_fall_short` says a top_p-only
    # row's nucleus may not fit them (never on CUDA, where such rows take the whole
    # sorted vocabulary so that no host sync is needed to find the rows that fall short).
    truncation_width: int
    may_fall_short: bool
    has_top_p_only: bool  # some truncated row has top_p < 1 and top_k off
    penalties: PenaltyTensors | None
    logit_bias: LogitBias | None
    banned: BannedTokens | None
    generators: dict[int, torch.Generator]  # random seeded row -> its own generator
    seeded_rows: torch.Tensor  # [S] int64, the keys of `generators` in order
    max_num_logprobs: int | None  # None: no row asked for logprobs
    allowed: AllowedTokens | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


def row_kind(params: SamplingParams) -> int:
    if params.greedy:
        return GREEDY
    if params.effective_top_k > 0 or params.top_p < 1.0:
        return TRUNCATED
    return PLAIN


def has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def truncation_width(top_k: np.ndarray, vocab_size: int, device: torch.device) -> tuple[int, bool]:
    """Candidates needed by the truncated rows (their clamped top_k [Rt]), and whether
    some row is top_p-only (top_k 0)."""
    top_p_only = bool((top_k == 0).any())
    # A top_k row needs exactly its k candidates; top_p-only rows start small on CPU and
    # fall back on demand, but on CUDA they take the full sort (fast there): no sync.
    start = vocab_size if device.type == "cuda" else TOP_P_START_WIDTH
    widths = np.where(top_k > 0, top_k, start)
    return min(int(widths.max(initial=1)), vocab_size), top_p_only


def request_generator(seed: int, device: torch.device | str, num_drawn: int = 0) -> torch.Generator:
    """The per-request generator a seeded request keeps for its whole life.

    A request resumed after preemption reaches the worker again with `num_drawn` output
    tokens, each of which took exactly one draw (the `Sampler`'s contract). Those draws
    are replayed: a fresh generator would hand out its first draws again, so the tokens
    of a seeded request would depend on whether the KV cache was full."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    for _ in range(num_drawn):  # one call per draw: CUDA's philox offsets count calls
        torch.rand(1, generator=generator, device=generator.device)
    return generator
