"""The distribution the `Sampler` draws from, as a dense [R, V] tensor.

Speculative decoding must accept and resample against exactly the distribution normal
decoding samples from (sampler.py's order): logit_bias, min_tokens bans, penalties,
then temperature, min_p, top_k and top_p. The sampler never materialises it (it draws
among candidates); the rejection sampler needs p(draft token) and the residual
max(0, p - q), so it is written out here::

    logits [R, V]  --bias, bans, penalties-->  l
    greedy rows     one-hot at row_argmax(l)    (what the sampler's argmax picks)
    random rows     e = exp(l / T - max)        the row max maps to 1
                    min_p keeps e >= min_p; sorted descending, top_k keeps rank < k and
                    top_p the shortest prefix whose mass reaches top_p x what is left
                    p = e * keep / sum(e * keep)
"""

from __future__ import annotations

import torch

from kvflow.gpu_worker.sampler import apply_logits_processors
from kvflow.gpu_worker.sampling_metadata import SamplingMetadata
from kvflow.gpu_worker.vocab_ops import first_at_least, row_argmax


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[R, V] fp32 probabilities; `logits` [R, V] fp32 is overwritten (as the sampler
    does). Greedy rows are one-hot."""
    assert logits.dtype == torch.float32 and logits.dim() == 2, logits.shape
    apply_logits_processors(logits, md)
    probs = torch.zeros_like(logits)
    if md.greedy_rows.numel():
        rows = md.greedy_rows
        probs[rows, row_argmax(logits.index_select(0, rows))] = 1.0
    random_rows = torch.cat([md.plain_rows, md.truncated_rows])
    if random_rows.numel():
        weights = _random_weights(
            logits.index_select(0, random_rows),
            md.temperature.index_select(0, random_rows),
            md.top_k.index_select(0, random_rows),
            md.top_p.index_select(0, random_rows),
            md.min_p.index_select(0, random_rows),
        )
        probs.index_copy_(0, random_rows, weights / weights.sum(dim=1, keepdim=True))
    return probs


def _random_weights(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N], 1 = off
    min_p: torch.Tensor,  # [N], 0 = off
) -> torch.Tensor:  # [N, V] unnormalised, zero outside the kept set
    scaled = logits / temperature.unsqueeze(1)
    e = (scaled - scaled.amax(dim=1, keepdim=True)).exp()  # [N, V], max 1
    e = e * (e >= min_p.unsqueeze(1))
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        e = _truncate(e, top_k, top_p)
    return e


def _truncate(e: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the top_k largest, then the top_p nucleus of what is left (sampler.py's
    `_sample_candidates` rule, over the whole sorted row)."""
    vocab_size = e.shape[1]
    ranked, order = e.sort(dim=1, descending=True, stable=True)  # [N, V]
    rank = torch.arange(vocab_size, device=e.device)
    limit = torch.where(top_k > 0, top_k.clamp_max(vocab_size), vocab_size)  # [N]
    ranked = ranked * (rank < limit.unsqueeze(1))
    cdf = ranked.cumsum(dim=1)  # [N, V]
    goal = top_p * cdf[:, -1]  # [N]
    nucleus = 1 + first_at_least(cdf, goal.unsqueeze(1)).squeeze(1)  # [N]
    limit = torch.where(top_p < 1.0, torch.minimum(limit, nucleus), limit)
    kept = ranked * (rank < limit.unsqueeze(1))
    return torch.zeros_like(e).scatter_(1, order, kept)
