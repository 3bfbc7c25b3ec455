"""Batched sampling inputs for one decode step, built from per-request SamplingParams.

`SamplingMetadata.build` turns R requests' `SamplingParams` and token histories into the
tensors the `Sampler` reads. It also sorts the rows into three disjoint groups so the
sampler only does the [R, V] work a row actually needs::

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
  [R, V] work is skipped entirely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from kvflow.sampling_params import SamplingParams

# Candidates a top_p-only row starts from on CPU; rows whose nucleus is larger fall back
# to a radix select over the vocabulary (sorting [64, 49152] on CPU costs ~200 ms).
TOP_P_START_WIDTH = 64


@dataclass(frozen=True, eq=False)
class PenaltyTensors:
    """Inputs of presence/frequency/repetition penalties for the Rp rows that use one."""

    rows: torch.Tensor | None  # [Rp] int64 batch rows; None = every row (no gather)
    presence: torch.Tensor  # [Rp, 1] fp32
    frequency: torch.Tensor  # [Rp, 1] fp32
    repetition: torch.Tensor  # [Rp, 1] fp32, 1.0 = off
    output_counts: torch.Tensor  # [Rp, V] fp32, occurrences of each token in the output
    prompt_mask: torch.Tensor | None  # [Rp, V] bool; None when no row has repetition != 1


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

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: dict[int, torch.Generator],
        eos_token_ids: set[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Batch R requests' parameters; row i of every tensor is request i."""
        device = torch.device(device)
        top_k = [min(p.effective_top_k, vocab_size) for p in params]
        greedy, plain, truncated = _group_rows(params, top_k)
        for i in plain + truncated:
            assert params[i].seed is None or i in generators, f"seeded row {i} has no generator"
        seeded = {i: g for i, g in generators.items() if not params[i].greedy}
        width, has_top_p_only = _truncation_width(top_k, truncated, vocab_size, device)
        return cls(
            temperature=_floats([1.0 if p.greedy else p.temperature for p in params], device),
            top_k=_ints(top_k, device),
            top_p=_floats([p.top_p for p in params], device),
            min_p=_floats([p.min_p for p in params], device),
            greedy_rows=_ints(greedy, device),
            plain_rows=_ints(plain, device),
            truncated_rows=_ints(truncated, device),
            all_greedy=not plain and not truncated,
            all_random=not greedy,
            no_penalties=not any(map(_has_penalty, params)),
            no_top_k_top_p=not truncated,
            no_min_p=all(params[i].min_p == 0.0 for i in plain + truncated),
            truncation_width=width,
            may_fall_short=has_top_p_only and width < vocab_size,
            has_top_p_only=has_top_p_only,
            penalties=_build_penalties(
                params, prompt_token_ids, output_token_ids, vocab_size, device
            ),
            logit_bias=_build_logit_bias(params, device),
            banned=_build_banned(params, output_token_ids, eos_token_ids, device),
            generators=seeded,
            seeded_rows=_ints(list(seeded), device),
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
        )


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


def _floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _group_rows(
    params: Sequence[SamplingParams], top_k: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """(greedy, plain, truncated) row lists, each ascending; together range(R)."""
    greedy, plain, truncated = [], [], []
    for i, p in enumerate(params):
        if p.greedy:
            greedy.append(i)
        elif top_k[i] > 0 or p.top_p < 1.0:
            truncated.append(i)
        else:
            plain.append(i)
    return greedy, plain, truncated


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _truncation_width(
    top_k: list[int],
    truncated_rows: list[int],
    vocab_size: int,
    device: torch.device,
) -> tuple[int, bool]:
    """Candidates needed by the truncated rows, and whether some row is top_p-only."""
    top_p_only = any(top_k[i] == 0 for i in truncated_rows)
    # A top_k row needs exactly its k candidates; top_p-only rows start small on CPU and
    # fall back on demand, but on CUDA they take the full sort (fast there): no sync.
    start = vocab_size if device.type == "cuda" else TOP_P_START_WIDTH
    widths = [top_k[i] if top_k[i] > 0 else start for i in truncated_rows]
    return min(max(widths, default=1), vocab_size), top_p_only


def _build_penalties(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors | None:
    """Token counts for penalised rows only: presence/frequency see output tokens (OpenAI),
    repetition sees prompt + output tokens (vLLM / HF)."""
    rows = [i for i, p in enumerate(params) if _has_penalty(p)]
    if not rows:
        return None

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    repetition = [params[i].repetition_penalty for i in rows]
    needs_prompt = any(r != 1.0 for r in repetition)
    return PenaltyTensors(
        rows=None if len(rows) == len(params) else torch.tensor(rows, device=device),
        presence=column([params[i].presence_penalty for i in rows]),
        frequency=column([params[i].frequency_penalty for i in rows]),
        repetition=column(repetition),
        output_counts=_token_counts([output_token_ids[i] for i in rows], vocab_size, device),
        prompt_mask=(
            _token_counts([prompt_token_ids[i] for i in rows], vocab_size, device) > 0
            if needs_prompt
            else None
        ),
    )


def _token_counts(
    token_ids: list[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[len(token_ids), V] fp32 occurrence counts, one flat scatter-add for all rows."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(ids) for ids in token_ids], device=device)
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def _build_logit_bias(params: Sequence[SamplingParams], device: torch.device) -> LogitBias | None:
    triples = [(i, tok, b) for i, p in enumerate(params) for tok, b in (p.logit_bias or {}).items()]
    if not triples:
        return None
    rows, toks, values = zip(*triples)
    return LogitBias(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        token_ids=torch.tensor(toks, dtype=torch.int64, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def _build_banned(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: set[int],
    device: torch.device,
) -> BannedTokens | None:
    """Stop tokens (EOS unless ignore_eos, plus stop_token_ids) of rows below min_tokens."""
    pairs: list[tuple[int, int]] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else eos_token_ids)
        pairs.extend((i, tok) for tok in sorted(stops))
    if not pairs:
        return None
    rows, toks = zip(*pairs)
    return BannedTokens(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        token_ids=torch.tensor(toks, dtype=torch.int64, device=device),
    )
