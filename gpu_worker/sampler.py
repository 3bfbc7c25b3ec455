"""Batched sampling of the next token from the LM head's logits.

Order of operations (vLLM's), each step skipped when no row needs it:

    logits [R, V] fp32
      1. logit_bias          sparse add; allowed_token_ids: every other token -> -inf
      2. min_tokens          stop ids of rows below min_tokens -> -inf; so are bad words'
                             last tokens where the output ends with the rest of the word
      3. penalties           repetition (prompt + output), frequency, presence (output)
      4. greedy rows         argmax of the logits after 1-3
      5. temperature         logits / T
      6. min_p               drop p < min_p * p_max
      7. top_k, top_p        keep the k most likely, then the nucleus of what is left
      8. sample              inverse CDF with one uniform per row

Step 8 draws by inverse CDF (running sum of the unnormalised probabilities in token-id
order, binary search for u * total) rather than by the exponential race argmax(p / q),
q ~ Exp(1): both are exact and free of host syncs, but the race needs V random numbers
per row, and on this CPU drawing [64, 49152] exponentials costs ~120 ms (uniforms
~15 ms) where exp + block sums cost a few ms. With one uniform per row, a seeded row
consumes exactly one draw of its own generator per step, whatever else is in the batch.

Truncated rows (top_k / top_p) do not sort the vocabulary: `row_topk(width)` gives the
candidates in descending order, and min_p, top_k and top_p each keep a *prefix* of them,
so one cumsum over [R, width] finds the kept set. A top_p-only row starts from 64
candidates; if its nucleus is larger it falls back to a whole-row threshold from a sorted
copy (numpy's sort on CPU). Both paths draw from the kept set in token-id order, so a
row's token does not depend on which path served it (which depends on the batch's width).

Logprobs are "raw": log_softmax of the logits as they come in, before bias, penalties
and temperature (vLLM's default `raw_logprobs`), so they describe the model itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvflow.gpu_worker.sampling_metadata import (
    AllowedTokens,
    BannedTokens,
    LogitBias,
    PenaltyTensors,
    SamplingMetadata,
)
from kvflow.gpu_worker.vocab_ops import (
    at_least,
    first_at_least,
    nucleus_threshold,
    row_argmax,
    row_count_at_least,
    row_topk,
    sample_from_weights,
    scaled_target,
)


class LogprobsTensors(NamedTuple):
    token_ids: torch.Tensor  # [N, K+1] int64; column 0 = the chosen token, 1..K = top-K
    logprobs: torch.Tensor  # [N, K+1] fp32
    ranks: torch.Tensor  # [N] int64, rank of column 0's token (1 = most likely)


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None  # present when some row asked for logprobs


class Sampler:
    """Samples one token per row. Unseeded rows share `generator` (the global RNG when
    None); seeded rows draw from the per-request generators in the metadata."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """`logits` [R, V] fp32 is consumed: it is overwritten along the way (bias, bans,
        penalties, then probabilities), which saves [R, V] allocations every step."""
        assert logits.dtype == torch.float32 and logits.dim() == 2, logits.shape
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=1)  # [R, V], before anything edits logits
        apply_logits_processors(logits, metadata)
        if metadata.all_greedy:
            sampled = row_argmax(logits)
        else:
            sampled = self._sample_mixed(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def _sample_mixed(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        num_rows = logits.shape[0]
        sampled = torch.empty(num_rows, dtype=torch.int64, device=logits.device)  # [R]
        uniforms = self._uniforms(md, num_rows, logits.device)  # [R]

        rows = md.greedy_rows
        if rows.numel():
            _put_rows(sampled, rows, row_argmax(_take_rows(logits, rows)))
        rows = md.plain_rows
        if rows.numel():
            tokens = _sample_full_vocab(
                _take_rows(logits, rows),
                _take_rows(md.temperature, rows),
                None if md.no_min_p else _take_rows(md.min_p, rows),
                _take_rows(uniforms, rows),
            )
            _put_rows(sampled, rows, tokens)
        rows = md.truncated_rows
        if rows.numel():
            params = _TruncationParams(
                logits=_take_rows(logits, rows),
                temperature=_take_rows(md.temperature, rows),
                top_k=_take_rows(md.top_k, rows),
                top_p=_take_rows(md.top_p, rows),
                min_p=None if md.no_min_p else _take_rows(md.min_p, rows),
                uniforms=_take_rows(uniforms, rows),
            )
            tokens = _sample_truncated(
                params, md.truncation_width, md.may_fall_short, md.has_top_p_only
            )
            _put_rows(sampled, rows, tokens)
        return sampled

    def _uniforms(self, md: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
        """One U[0, 1) per row: the shared generator for all rows, then each seeded row's
        own draw written over its slot (a per-row loop over seeded rows only)."""
        uniforms = torch.rand(num_rows, generator=self.generator, device=device)  # [R]
        if md.generators:
            draws = [torch.rand(1, generator=g, device=device) for g in md.generators.values()]
            uniforms.index_copy_(0, md.seeded_rows, torch.cat(draws))
        return uniforms


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Steps 1-3 in place: logit_bias and allowed_token_ids, min_tokens and bad-word
    bans, penalties."""
    if md.logit_bias is not None:
        apply_logit_bias(logits, md.logit_bias)
    if md.allowed is not None:
        apply_allowed_tokens(logits, md.allowed)
    if md.banned is not None:
        apply_banned_tokens(logits, md.banned)
    if md.penalties is not None:
        apply_penalties(logits, md.penalties)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    rows = logits.index_select(0, allowed.rows)
    rows.masked_fill_(~allowed.mask, float("-inf"))
    logits.index_copy_(0, allowed.rows, rows)


def apply_banned_tokens(logits: torch.Tensor, banned: BannedTokens) -> None:
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    logits.index_put_((banned.rows, banned.token_ids), neg_inf)


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> None:
    """Repetition divides positive / multiplies negative logits of tokens seen in prompt
    or output; then logit -= frequency * count + presence * [count > 0] (output only).

    Only each row's history is read and written (`PenaltyTensors`): every history token
    is seen, and a token outside it is left as it is by all three penalties."""
    ids = pen.token_ids  # [Rp, L]
    rows = pen.params.rows
    if rows is None:
        rows = torch.arange(ids.shape[0], device=ids.device)
    index = (rows.unsqueeze(1).expand_as(ids), ids)
    x = logits[index]  # [Rp, L]
    # A vanishing penalty (5e-324 is 0 in float32) would turn a grammar-masked -inf into
    # NaN (-inf * 0) and positive logits into inf: the row would sample garbage, even
    # outside its grammar. Kept positive, and the quotient finite.
    finfo = torch.finfo(x.dtype)
    repetition = pen.params.repetition.clamp(min=finfo.tiny)
    x = torch.where(x > 0, (x / repetition).clamp(max=finfo.max), x * repetition)
    counts = pen.output_counts
    x = x - pen.params.frequency * counts - pen.params.presence * (counts > 0)
    logits.index_put_(index, x)  # a token listed twice gets the same value twice


def _sample_full_vocab(
    logits: torch.Tensor,  # [N, V], overwritten
    temperature: torch.Tensor,  # [N]
    min_p: torch.Tensor | None,  # [N]
    uniforms: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N] int64
    """Inverse-CDF sample over the whole vocabulary, in token-id order."""
    return sample_from_weights(_to_unnormalised_probs(logits, temperature, min_p), uniforms)


def _to_unnormalised_probs(
    logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Overwrites logits [N, V] with exp(l / T - max) (the row max maps to exactly 1),
    zeroed below min_p. In place: a fresh [64, 49152] tensor costs ~1 ms of page faults."""
    scaled = logits.div_(temperature.unsqueeze(1))
    probs = scaled.sub_(scaled.amax(dim=1, keepdim=True)).exp_()
    if min_p is not None:
        # p / p_max < min_p is probs < min_p since the row max is exactly 1.
        probs.mul_(at_least(probs, min_p.unsqueeze(1)))
    return probs


class _TruncationParams(NamedTuple):
    logits: torch.Tensor  # [N, V], overwritten when top_p-only rows need whole-row mass
    temperature: torch.Tensor  # [N]
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N]
    min_p: torch.Tensor | None  # [N]; None when no row uses min_p
    uniforms: torch.Tensor  # [N]


def _sample_truncated(
    p: _TruncationParams, width: int, may_fall_short: bool, has_top_p_only: bool
) -> torch.Tensor:  # [N] int64
    """Sample rows with top_k / top_p among their top-`width` candidates. A top_p-only row
    whose nucleus reaches past them is redone over the whole vocabulary, keeping the
    weights at or above its nucleus threshold (CPU only: picking those rows needs the host
    to look at `short`; on CUDA the width is V and nothing falls short)."""
    vals, idx = row_topk(p.logits, width)  # [N, C] descending
    probs = None  # [N, V]: top_p-only rows need the mass of the whole row
    if has_top_p_only:
        probs = _to_unnormalised_probs(p.logits, p.temperature, p.min_p)
    full_mass = None if probs is None else probs.sum(dim=1)
    tokens, short, goal = _sample_candidates(p, vals, idx, full_mass)
    if may_fall_short and probs is not None:
        rows = short.nonzero().squeeze(1)
        if rows.numel():
            row_probs = probs.index_select(0, rows)  # [S, V]
            threshold = nucleus_threshold(row_probs, goal.index_select(0, rows))
            kept = row_probs.mul_(at_least(row_probs, threshold.unsqueeze(1)))
            retry = sample_from_weights(kept, p.uniforms.index_select(0, rows))
            tokens.index_copy_(0, rows, retry)
    return tokens


def _sample_candidates(
    p: _TruncationParams,
    vals: torch.Tensor,  # [N, C] the C largest logits of each row, descending
    idx: torch.Tensor,  # [N, C] their token ids
    full_mass: torch.Tensor | None,  # [N] mass of the whole row, for top_p-only rows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns tokens [N] int64, short [N] bool (the nucleus reaches past the candidates:
    only top_p-only rows when C < V) and the top_p goal [N] (top_p times the mass that
    min_p and top_k left).

    With candidates sorted by descending logit, each filter keeps a prefix::

        e     = exp(v / T - v_0 / T)   1 = e_0 >= e_1 >= ... >= e_{C-1}
        min_p keeps e_i >= min_p;  top_k keeps i < k;  top_p keeps the shortest prefix
        whose mass reaches top_p of what min_p and top_k left (cumsum >= goal)
    """
    width = vals.shape[1]
    vals = vals / p.temperature.unsqueeze(1)
    probs = (vals - vals[:, :1]).exp_()  # [N, C]
    cdf = probs.cumsum(dim=1)  # [N, C]
    limit = torch.where(p.top_k > 0, p.top_k.clamp_max(width), width)  # [N]
    if p.min_p is not None:
        limit = torch.minimum(limit, (probs >= p.min_p.unsqueeze(1)).sum(dim=1))
    mass = cdf.gather(1, (limit - 1).unsqueeze(1)).squeeze(1)  # [N]
    unbounded = (p.top_k == 0) & (limit == width)  # support may extend past the candidates
    if full_mass is not None:
        mass = torch.where(unbounded, full_mass, mass)
    goal = p.top_p * mass  # [N]
    nucleus = 1 + first_at_least(cdf, goal.unsqueeze(1)).squeeze(1)  # [N]
    limit = torch.where(p.top_p < 1.0, torch.minimum(limit, nucleus), limit)
    short = unbounded & (cdf[:, -1] < goal)
    keep = torch.arange(width, device=idx.device) < limit.unsqueeze(1)  # [N, C]
    return _sample_by_id(idx, probs * keep, p.uniforms), short, goal


def _sample_by_id(ids: torch.Tensor, weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw among candidates `ids` [N, C] with `weights` [N, C], walking them
    in token-id order: the order the whole-vocabulary fallback walks, so a row's token
    does not depend on which of the two paths served it."""
    sorted_ids, order = ids.sort(dim=1)  # [N, C]
    cdf = weights.gather(1, order).cumsum(dim=1)  # [N, C]
    pos = first_at_least(cdf, scaled_target(uniforms.unsqueeze(1), cdf[:, -1:]))  # [N, 1]
    return sorted_ids.gather(1, pos).squeeze(1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Column 0: `token_ids`' logprob; 1..k: the row's top-k. Ranks follow vLLM: the number
    of tokens at least as likely as the chosen one (ties take the worse rank)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = row_count_at_least(logprobs, chosen)  # [N]
    top_logprobs, top_ids = row_topk(logprobs, k)  # [N, k]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([chosen, top_logprobs], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> LogprobsTensors:
    """logits [P, V] at prompt positions 0..P-1; next_token_ids [P] the prompt tokens at
    1..P. Raw logprobs, as for sampled tokens."""
    return gather_logprobs(logits.log_softmax(dim=1), next_token_ids, k)


def _take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows]; a group that covers the whole batch is arange(R), so no copy is needed."""
    return t if rows.numel() == t.shape[0] else t.index_select(0, rows)


def _put_rows(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    if rows.numel() == out.shape[0]:
        out.copy_(values)
    else:
        out.index_copy_(0, rows, values)
