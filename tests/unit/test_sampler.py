"""Sampler and SamplingMetadata: exact expectations for the deterministic parts, support
and frequency checks (fixed generators, so every run draws the same numbers) for the
random parts."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvflow.gpu_worker.sampler import (
    Sampler,
    apply_logits_processors,
    compute_prompt_logprobs,
)
from kvflow.gpu_worker.sampling_metadata import SamplingMetadata, request_generator
from kvflow.gpu_worker.sampling_state import SamplingState, TokenRows
from kvflow.gpu_worker.vocab_ops import (
    row_argmax,
    row_count_at_least,
    row_topk,
    sample_from_weights,
)
from kvflow.sampling_params import SamplingParams as SP

EOS = 0


def new_state(
    params: Sequence[SP],
    vocab_size: int,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> tuple[SamplingState, TokenRows]:
    """A persistent sampling state with request i in slot i, and its token rows."""
    rows = len(params)
    prompts = prompts if prompts is not None else [[]] * rows
    outputs = outputs if outputs is not None else [[]] * rows
    histories = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    token_ids = torch.zeros(rows, max(map(len, histories), default=0) + 1, dtype=torch.int32)
    for i, history in enumerate(histories):
        token_ids[i, : len(history)] = torch.tensor(history, dtype=torch.int32)
    token_rows = TokenRows(
        token_ids,
        np.array([len(h) for h in histories], dtype=np.int64),
        np.array([len(p) for p in prompts], dtype=np.int64),
    )
    state = SamplingState(rows, vocab_size, {EOS}, torch.device("cpu"))
    for i, p in enumerate(params):
        state.add(i, p, torch.tensor(outputs[i], dtype=torch.int64))
    return state, token_rows


def build(
    params: Sequence[SP],
    vocab_size: int,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> SamplingMetadata:
    state, token_rows = new_state(params, vocab_size, prompts, outputs)
    return state.metadata(np.arange(len(params)), token_rows)


def sample(logits: torch.Tensor, params: Sequence[SP], seed: int = 0, **kw) -> torch.Tensor:
    sampler = Sampler(torch.Generator().manual_seed(seed))
    metadata = build(params, logits.shape[1], **kw)
    return sampler(logits.clone(), metadata).sampled_token_ids


def draws(logits_row: torch.Tensor, params: SP, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one row: the same row repeated n times in one batch."""
    return sample(logits_row.expand(n, -1).contiguous(), [params] * n, seed=seed)


def log_probs(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# ---- vocab_ops: blocked argmax / top-k / counting agree with torch ----------------------


@pytest.mark.parametrize("vocab_size", [300, 4096, 5000])
def test_row_ops_match_torch(vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(vocab_size)
    x = torch.randn(6, vocab_size, generator=gen)
    x[1, 10] = x[1, vocab_size - 1] = 50.0  # tie for the max: argmax takes the first
    x[2, vocab_size - 1] = 60.0  # max in the short last block
    assert torch.equal(row_argmax(x), x.argmax(dim=1))
    for k in (1, 5, 17):
        values, ids = row_topk(x, k)
        want_values, _ = x.topk(k, dim=1)
        assert torch.equal(values, want_values)
        assert torch.equal(x.gather(1, ids), values)
    threshold = x[:, 7:8]
    assert torch.equal(row_count_at_least(x, threshold), (x >= threshold).sum(dim=1))


@pytest.mark.parametrize("vocab_size", [40, 700])
def test_sample_from_weights_edges(vocab_size: int) -> None:
    weights = torch.zeros(3, vocab_size)
    weights[:, 5] = 1.0
    weights[:, vocab_size - 3] = 2.0
    first = sample_from_weights(weights, torch.zeros(3))
    last = sample_from_weights(weights, torch.full((3,), 1.0 - 2**-24))
    assert first.tolist() == [5, 5, 5]
    assert last.tolist() == [vocab_size - 3] * 3


# ---- metadata ---------------------------------------------------------------------------


def test_build_groups_and_flags() -> None:
    params = [
        SP(temperature=0.0),
        SP(temperature=0.7, seed=3),
        SP(top_k=10),
        SP(top_p=0.5, min_p=0.1),
        SP(temperature=0.0, seed=4),
    ]
    md = build(params, 100)
    assert md.greedy_rows.tolist() == [0, 4]
    assert md.plain_rows.tolist() == [1]
    assert md.truncated_rows.tolist() == [2, 3]
    assert (md.all_greedy, md.all_random, md.no_top_k_top_p, md.no_min_p) == (
        False,
        False,
        False,
        False,
    )
    assert md.temperature.tolist() == pytest.approx([1.0, 0.7, 1.0, 1.0, 1.0])
    assert md.top_k.tolist() == [0, 0, 10, 0, 0]
    assert md.truncation_width == 64 and md.may_fall_short and md.has_top_p_only
    assert list(md.generators) == [1] and md.seeded_rows.tolist() == [1]  # greedy: no draw
    assert md.no_penalties and md.penalties is None
    assert md.logit_bias is None and md.banned is None and md.max_num_logprobs is None

    md = build([SP(temperature=0.0, logprobs=2), SP(temperature=0.0, logprobs=5)], 100)
    assert md.all_greedy and md.max_num_logprobs == 5


# ---- greedy -------------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(10, 1000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits, [SP(temperature=0.0)] * 10), logits.argmax(dim=1))

    # Mixed batch: greedy rows and top_k=1 rows are argmax; others are anything valid.
    params = [SP(temperature=0.0), SP(), SP(top_k=1), SP(top_p=0.3), SP(temperature=0.0)] * 2
    tokens = sample(logits, params)
    want = logits.argmax(dim=1)
    for row in (0, 2, 4, 5, 7, 9):
        assert tokens[row] == want[row]

    # Greedy follows the biased logits.
    biased = sample(logits[:1], [SP(temperature=0.0, logit_bias={7: 100.0})])
    assert biased.tolist() == [7]


# ---- seeds ----------------------------------------------------------------------------------


SEEDED = [
    SP(temperature=0.9, seed=7),
    SP(temperature=1.0, top_k=20, seed=7),
    # Nucleus of ~200 tokens: past the 64 first candidates alone, inside them next to a
    # top_k=300 row, so the two sampling paths must agree.
    SP(temperature=1.0, top_p=0.6, seed=7),
]
OTHERS = [SP(), SP(temperature=0.0), SP(top_k=300), SP(top_p=0.8), SP(temperature=1.3)]


def _seeded_run(params: SP, layout: list[int], steps: int = 20, vocab: int = 500) -> list[int]:
    """Tokens of one seeded request over `steps` steps; `layout` lists the batch rows,
    -1 marking the seeded request and i >= 0 OTHERS[i]."""
    sampler = Sampler(torch.Generator().manual_seed(len(layout)))
    noise = torch.Generator().manual_seed(99 + len(layout))
    row = layout.index(-1)
    state, token_rows = new_state([params if i < 0 else OTHERS[i] for i in layout], vocab)
    tokens = []
    for step in range(steps):
        own = torch.randn(vocab, generator=torch.Generator().manual_seed(step)) * 0.5
        logits = torch.randn(len(layout), vocab, generator=noise) * 0.5
        logits[row] = own
        md = state.metadata(np.arange(len(layout)), token_rows)
        tokens.append(int(sampler(logits, md).sampled_token_ids[row]))
    return tokens


@pytest.mark.parametrize("params", SEEDED, ids=["plain", "top_k", "top_p"])
def test_seeded_request_is_independent_of_the_batch(params: SP) -> None:
    alone = _seeded_run(params, [-1])
    assert len(set(alone)) >= 10  # really random, not stuck
    for layout in ([0, -1, 1], [2, 0, 4, -1, 3], [-1, 2, 2, 1, 0, 3, 4, 0]):
        assert _seeded_run(params, layout) == alone, layout


def test_request_generator_replays_the_draws_already_taken() -> None:
    fresh = request_generator(7, "cpu")
    draws = [torch.rand(1, generator=fresh).item() for _ in range(5)]
    resumed = request_generator(7, "cpu", num_drawn=3)
    assert [torch.rand(1, generator=resumed).item() for _ in range(2)] == draws[3:]


def test_different_seeds_differ() -> None:
    one = _seeded_run(SP(temperature=1.0, seed=1), [-1])
    two = _seeded_run(SP(temperature=1.0, seed=2), [-1])
    assert one != two


# ---- truncation ------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [100, 2000])
def test_top_k_samples_only_the_k_largest(vocab_size: int) -> None:
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(5)) * 0.3
    top5 = set(logits.topk(5).indices.tolist())
    tokens = draws(logits, SP(top_k=5), 2000)
    assert set(tokens.tolist()) == top5


def test_top_p_keeps_the_nucleus() -> None:
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    assert set(draws(logits, SP(top_p=0.7), 2000).tolist()) == {0, 1}
    tokens = draws(logits, SP(top_p=0.9), 4000).tolist()
    assert set(tokens) == {0, 1, 2}
    freq = [tokens.count(t) / len(tokens) for t in (0, 1, 2)]
    assert freq == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95], abs=0.03)
    # top_k first, then top_p of the renormalised rest: 4/9, 3/9, 2/9 -> {0, 1} at 0.7.
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    assert set(draws(logits, SP(top_k=3, top_p=0.7), 2000).tolist()) == {0, 1}


def test_top_p_nucleus_larger_than_the_first_candidates() -> None:
    vocab = 1000
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))
    logits = torch.full((vocab,), -20.0)
    logits[perm[:300]] = -0.01 * torch.arange(300, dtype=torch.float32)
    probs = np.sort(torch.softmax(logits.double(), 0).numpy())[::-1]
    cumulative = np.cumsum(probs)
    size = int(np.searchsorted(cumulative, 0.5)) + 1  # smallest prefix reaching 0.5
    assert 64 < size < 300 and abs(cumulative[size - 1] - 0.5) > 1e-4
    nucleus = set(perm[:size].tolist())
    tokens = set(draws(logits, SP(top_p=0.5), 3000).tolist())
    assert tokens <= nucleus and len(tokens) > 0.9 * size


def test_min_p_drops_tokens_below_min_p_times_pmax() -> None:
    logits = log_probs([0.4, 0.3, 0.2, 0.06, 0.04])  # min_p 0.2 -> keep p >= 0.08
    assert set(draws(logits, SP(min_p=0.2), 3000).tolist()) == {0, 1, 2}
    assert set(draws(logits, SP(min_p=0.2, top_k=4), 3000).tolist()) == {0, 1, 2}
    wide = torch.cat([logits, torch.full((295,), -30.0)])  # whole-vocab path, V = 300
    assert set(draws(wide, SP(min_p=0.2), 3000).tolist()) == {0, 1, 2}


# ---- distribution ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab_size", "params"),
    [(8, SP()), (8, SP(temperature=0.5)), (8, SP(top_k=8)), (300, SP(temperature=2.0))],
    ids=["T1", "T0.5", "top_k=V", "V300-T2"],
)
def test_frequencies_match_softmax(vocab_size: int, params: SP) -> None:
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(3)) * 1.5
    n = 20000
    tokens = draws(logits, params, n, seed=11)
    freq = torch.bincount(tokens, minlength=vocab_size).double() / n
    want = torch.softmax(logits.double() / params.temperature, dim=0)
    assert (freq - want).abs().max().item() < 0.012


def test_small_temperature_concentrates_on_argmax() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, 1.5, -1.0])
    assert set(draws(logits, SP(temperature=0.01), 1000).tolist()) == {1}


# ---- logits processors -------------------------------------------------------------------------

BASE = [1.0, -1.0, 2.0, 0.5, -0.5, 3.0, -2.0, 0.25, 1.5, -3.0]


def processed(params: Sequence[SP], **kw) -> torch.Tensor:
    logits = torch.tensor([BASE] * len(params))
    apply_logits_processors(logits, build(params, len(BASE), **kw))
    return logits


def test_presence_and_frequency_penalties_exact() -> None:
    params = [SP(), SP(presence_penalty=0.25, frequency_penalty=0.5), SP()]
    outputs = [[3, 3], [3, 3, 5], [5]]
    prompts = [[1], [7, 1], [2]]
    out = processed(params, outputs=outputs, prompts=prompts)
    want = list(BASE)
    want[3] -= 0.5 * 2 + 0.25
    want[5] -= 0.5 * 1 + 0.25  # prompt tokens 7 and 1 are untouched
    assert out[1].tolist() == want
    assert out[0].tolist() == BASE and out[2].tolist() == BASE  # rows without penalties


def test_repetition_penalty_exact() -> None:
    out = processed([SP(repetition_penalty=2.0)], outputs=[[3, 4]], prompts=[[6, 1]])[0]
    want = list(BASE)
    want[3] = 0.5 / 2  # positive: divided
    want[4] = -0.5 * 2  # negative: multiplied
    want[6] = -2.0 * 2  # prompt tokens count too
    want[1] = -1.0 * 2
    assert out.tolist() == want


def test_logit_bias_shifts_exactly_and_minus_100_bans() -> None:
    out = processed([SP(logit_bias={2: 1.5, 4: -2.25})])[0]
    want = list(BASE)
    want[2] += 1.5
    want[4] -= 2.25
    assert out.tolist() == want

    logits = torch.tensor(BASE)  # token 5 is the argmax
    banned = SP(logit_bias={5: -100.0})
    assert 5 not in draws(logits, banned, 2000).tolist()
    assert sample(logits.unsqueeze(0), [SP(temperature=0.0, logit_bias={5: -100.0})]) != 5


def test_min_tokens_bans_stop_tokens_until_reached() -> None:
    params = [
        SP(min_tokens=3, stop_token_ids=[5]),
        SP(min_tokens=3, stop_token_ids=[5]),
        SP(min_tokens=3, stop_token_ids=[5], ignore_eos=True),
    ]
    out = processed(params, outputs=[[1, 2], [1, 2, 3], [1, 2]])
    inf = float("-inf")
    assert out[0, EOS] == inf and out[0, 5] == inf
    assert out[1].tolist() == BASE  # min_tokens reached
    assert out[2, EOS] == BASE[EOS] and out[2, 5] == inf
    assert torch.equal(out[0, 1:5], torch.tensor(BASE[1:5]))


# ---- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_sorted_and_ranked() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(8)) * 2
    raw = logits.log_softmax(dim=1)
    params = [
        SP(temperature=0.0, logprobs=3, logit_bias={9: 5.0}),
        SP(temperature=0.7, logprobs=1, presence_penalty=1.0),
        SP(top_k=5),
        SP(top_p=0.5, logprobs=0),
    ]
    md = build(params, 300, outputs=[[1], [2, 9], [], []])
    out = Sampler(torch.Generator().manual_seed(0))(logits.clone(), md)
    assert out.logprobs is not None
    ids, lps, ranks = out.logprobs
    sampled = out.sampled_token_ids
    assert ids.shape == lps.shape == (4, 4)
    assert torch.equal(ids[:, 0], sampled)
    assert torch.equal(lps[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    want_lps, want_ids = raw.topk(3, dim=1)
    assert torch.equal(lps[:, 1:], want_lps) and torch.equal(ids[:, 1:], want_ids)
    assert torch.all(lps[:, 1:-1] >= lps[:, 2:])
    chosen = raw.gather(1, sampled.unsqueeze(1))
    assert torch.equal(ranks, (raw >= chosen).sum(dim=1))
    assert sampled[0] == 9 and ranks[0] > 1  # greedy took the biased token; raw rank


def test_prompt_logprobs_tiny_example() -> None:
    probs = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]
    logits = torch.tensor(probs).log() + 4.0  # a constant shift must not matter
    out = compute_prompt_logprobs(logits, torch.tensor([2, 1]), k=2)
    assert out.token_ids.tolist() == [[2, 0, 1], [1, 1, 2]]
    want = [[math.log(p) for p in row] for row in ([0.2, 0.5, 0.3], [0.6, 0.6, 0.3])]
    assert out.logprobs.tolist() == [pytest.approx(row, abs=1e-6) for row in want]
    assert out.ranks.tolist() == [3, 1]


def test_all_rows_valid_in_a_mixed_batch() -> None:
    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(4))
    params = [SP(), SP(top_p=0.9), SP(top_k=3, min_p=0.5), SP(temperature=0.0), SP(min_p=0.3)]
    tokens = sample(logits[:5], params)
    counts = Counter(tokens.tolist())
    assert all(0 <= t < 700 for t in counts)
    assert tokens[3] == logits[3].argmax()
    assert tokens[2] in logits[2].topk(3).indices
