"""The rejection sampler: the tokens it emits are distributed exactly as the target's
processed distribution (chi-square against transformers' logits processors, in
tests/sampling_reference.py), at the first position, after accepted runs and for the
bonus token; greedy rows are exact; seeded generators advance one draw per emitted
token. Each distribution check is also run against deliberately wrong acceptance and
resampling rules, which it must reject: the test can fail."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from sampling_reference import Fit, Processing, probabilities, sampling_fields, token_fit

from kvflow.gpu_worker import rejection_sampler as rs
from kvflow.gpu_worker.rejection_sampler import DraftBatch, RejectionSampler
from kvflow.gpu_worker.sampling_metadata import request_generator
from kvflow.gpu_worker.sampling_state import SamplingState, TokenRows
from kvflow.gpu_worker.spec_metadata import verification_metadata
from kvflow.sampling_params import SamplingParams

VOCAB = 12
EOS = 0
PROMPT = [3, 4, 5]
OUTPUT = [6]
NUM_SAMPLES = 20_000


def position_logits(seed: int, k: int) -> torch.Tensor:
    """[k + 1, V]: the target's logits after the context and after each draft (a model
    whose logits depend on the position only, so every sample shares them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k + 1, VOCAB, generator=g) * 1.5


def params_for(spec: Processing, **extra: object) -> SamplingParams:
    return SamplingParams(**sampling_fields(spec), **extra)  # type: ignore[arg-type]


def run_sampler(
    logits: torch.Tensor,  # [k + 1, V]
    drafts: list[list[int]],  # per sample
    params: SamplingParams | list[SamplingParams],
    draft_probs: torch.Tensor | None = None,  # [k, V] shared q
    seed: int = 0,
) -> tuple[rs.RejectionOutput, SamplingState]:
    """Every sample is a request in its own slot of the worker's sampling state (which
    builds the per-position metadata as the model runner does)."""
    n = len(drafts)
    per_request = params if isinstance(params, list) else [params] * n
    state = SamplingState(n, VOCAB, {EOS}, torch.device("cpu"))
    known = PROMPT + OUTPUT
    token_ids = torch.tensor([known] * n, dtype=torch.int32)
    rows = TokenRows(token_ids, np.full(n, len(known)), np.full(n, len(PROMPT)))
    for slot, p in enumerate(per_request):
        state.add(slot, p, token_ids[slot, len(PROMPT) :])
    verification = verification_metadata(state, rows, np.arange(n), drafts)
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    batch = DraftBatch(
        [len(d) for d in drafts], flat, None if draft_probs is None else draft_probs.repeat(n, 1)
    )
    sampler = RejectionSampler(torch.Generator().manual_seed(seed))
    out = sampler(
        logits.repeat(n, 1), verification.metadata, batch, verification.requests.generators
    )
    return out, state


def target_at(logits: torch.Tensor, spec: Processing, history: list[int], j: int) -> torch.Tensor:
    return probabilities(logits[j : j + 1], PROMPT, [OUTPUT + history], spec)[0]


def fits(
    logits: torch.Tensor, spec: Processing, out: rs.RejectionOutput, drafts: list[list[int]]
) -> Iterator[tuple[str, Fit]]:
    """The emitted token at each position j, over the samples that accepted d_<j there:
    it must follow p_j given that history (j == k: the bonus token)."""
    k = len(drafts[0])
    for j in range(k + 1):
        picked = [
            tokens[j]
            for tokens, ds in zip(out.token_ids, drafts)
            if len(tokens) > j and tokens[:j] == ds[:j]
        ]
        if len(picked) < 500:
            continue  # too few samples reach this position to test it
        groups: dict[tuple[int, ...], list[int]] = {}
        for tokens in out.token_ids:
            if len(tokens) > j:
                groups.setdefault(tuple(tokens[:j]), []).append(tokens[j])
        for history, samples in groups.items():
            if len(samples) >= 500:
                yield (
                    f"position {j} after {history}",
                    token_fit(target_at(logits, spec, list(history), j), samples),
                )


def assert_matches(logits, spec, out, drafts) -> int:  # type: ignore[no-untyped-def]
    checked = 0
    for name, fit in fits(logits, spec, out, drafts):
        assert not fit.rejected, f"{name}: {fit}"
        checked += 1
    return checked


def any_rejected(logits, spec, out, drafts) -> bool:  # type: ignore[no-untyped-def]
    return any(fit.rejected for _, fit in fits(logits, spec, out, drafts))


SPECS = {
    "top_p": Processing(temperature=1.0, top_p=0.9),
    "temperature, top_k": Processing(temperature=0.7, top_k=6),
    "min_p, bias": Processing(temperature=1.3, min_p=0.05, logit_bias=((7, 1.5),)),
    "penalties": Processing(temperature=0.9, presence=0.6, frequency=0.4, repetition=1.3),
}


def one_hot_drafts(logits: torch.Tensor, spec: Processing) -> list[int]:
    """Each position's second most likely token: accepted often, rejected often."""
    drafts: list[int] = []
    for j in range(logits.shape[0] - 1):
        p = target_at(logits, spec, drafts, j)
        drafts.append(int(p.topk(2).indices[1]))
    return drafts


@pytest.mark.parametrize("name", list(SPECS))
def test_one_hot_drafts_keep_the_target_distribution(name: str) -> None:
    spec = SPECS[name]
    logits = position_logits(seed=len(name), k=3)
    drafts = [one_hot_drafts(logits, spec)] * NUM_SAMPLES
    out, _ = run_sampler(logits, drafts, params_for(spec), seed=1)
    assert assert_matches(logits, spec, out, drafts) >= 2
    assert all(len(t) == n + 1 for t, n in zip(out.token_ids, out.num_accepted))


def draft_model_samples(seed: int, k: int) -> tuple[torch.Tensor, list[list[int]]]:
    """A deliberately different draft distribution q_j per position, and each sample's
    drafts drawn from it."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(k, VOCAB, generator=g) * 1.5).softmax(dim=1)  # [k, V]
    drafts = torch.stack(
        [torch.multinomial(q[j], NUM_SAMPLES, replacement=True, generator=g) for j in range(k)],
        dim=1,
    )  # [N, k]
    return q, drafts.tolist()


@pytest.mark.parametrize("name", ["top_p", "temperature, top_k"])
def test_draft_model_drafts_keep_the_target_distribution(name: str) -> None:
    spec = SPECS[name]
    logits = position_logits(seed=7, k=2)
    q, drafts = draft_model_samples(seed=8, k=2)
    out, _ = run_sampler(logits, drafts, params_for(spec), draft_probs=q, seed=2)
    assert assert_matches(logits, spec, out, drafts) >= 3


MUTATIONS: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
    # accept with p_j(d) even when q is not one-hot
    "accept ignores q": (
        "accept_probs",
        lambda probs, drafts, rows: (
            probs.index_select(0, rows).gather(1, drafts.draft_token_ids.unsqueeze(1)).squeeze(1)
        ),
    ),
    # resample from p instead of max(0, p - q)
    "residual is p": ("residual_weights", lambda p, q, draft: p),
}


# With a one-hot q, p_j(d) is the right acceptance probability: that mutation is moot.
@pytest.mark.parametrize(
    ("mutation", "one_hot"),
    [("accept ignores q", False), ("residual is p", False), ("residual is p", True)],
)
def test_wrong_rules_fail_the_distribution_check(
    mutation: str, one_hot: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SPECS["top_p"]
    logits = position_logits(seed=7, k=2)
    if one_hot:
        q, drafts = None, [one_hot_drafts(logits, spec)] * NUM_SAMPLES
    else:
        q, drafts = draft_model_samples(seed=8, k=2)
    monkeypatch.setattr(rs, *MUTATIONS[mutation])
    out, _ = run_sampler(logits, drafts, params_for(spec), draft_probs=q, seed=2)
    assert any_rejected(logits, spec, out, drafts)


def test_reused_uniform_must_be_rescaled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing the residual with u itself (u >= a, so biased high) must be caught."""
    spec = SPECS["top_p"]
    logits = position_logits(seed=7, k=2)
    drafts = [one_hot_drafts(logits, spec)] * NUM_SAMPLES
    original = rs.sample_from_weights

    def biased(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return original(weights, 0.5 + 0.5 * uniforms)

    monkeypatch.setattr(rs, "sample_from_weights", biased)
    out, _ = run_sampler(logits, drafts, params_for(spec), seed=2)
    assert any_rejected(logits, spec, out, drafts)


def test_penalties_must_see_the_drafts_before_each_position() -> None:
    """The penalties' history at position j includes d_<j; a metadata that forgot them
    samples from another distribution, which the check tells apart."""
    spec = SPECS["penalties"]
    logits = position_logits(seed=3, k=2)
    logits[1] = logits[0]  # d_0 is likely again at position 1, where it is penalised
    draft = one_hot_drafts(logits, spec)
    drafts = [draft] * NUM_SAMPLES
    out, _ = run_sampler(logits, drafts, params_for(spec), seed=4)
    assert assert_matches(logits, spec, out, drafts) >= 2
    forgetful = spec.but(presence=0.0, frequency=0.0, repetition=1.0)  # what ignoring d_0 gives
    p_wrong, p_right = target_at(logits, forgetful, [], 1), target_at(logits, spec, [draft[0]], 1)
    assert (p_wrong - p_right).abs().max() > 0.05  # the check is able to tell


def test_greedy_accepts_while_drafts_equal_the_argmax() -> None:
    spec = Processing(temperature=0.0, logit_bias=((9, 2.0),))
    logits = position_logits(seed=5, k=3)
    biased = logits.clone()
    biased[:, 9] += 2.0
    argmax = biased.argmax(dim=1).tolist()  # [k + 1]
    wrong = (argmax[1] + 1) % VOCAB
    cases = [argmax[:3], [argmax[0], wrong, argmax[2]], [wrong, argmax[1], argmax[2]], []]
    params = SamplingParams(temperature=0.0, logit_bias={9: 2.0})
    for drafts, expected in zip(cases, [argmax, [argmax[0], argmax[1]], [argmax[0]], [argmax[0]]]):
        out, _ = run_sampler(logits[: len(drafts) + 1], [drafts], params)
        assert out.token_ids == [expected], (drafts, spec)
        assert out.num_accepted == [len(expected) - 1]
        # Beside a random row the general path serves it, with the same result.
        mixed, _ = run_sampler(
            logits[: len(drafts) + 1], [drafts, drafts], [params, SamplingParams(seed=3)]
        )
        assert mixed.token_ids[0] == expected


def test_seeded_requests_draw_once_per_emitted_token() -> None:
    spec = SPECS["top_p"]
    logits = position_logits(seed=7, k=3)
    drafts = [one_hot_drafts(logits, spec)] * 8
    params = [params_for(spec, seed=100 + r) for r in range(8)]
    out, state = run_sampler(logits, drafts, params, seed=1)
    again, _ = run_sampler(logits, drafts, params, seed=2)
    assert out.token_ids == again.token_ids  # the seeds decide, not the shared generator
    for r, tokens in enumerate(out.token_ids):
        # One draw for the output the request arrived with, then one per emitted token.
        replayed = request_generator(100 + r, "cpu", num_drawn=len(OUTPUT) + len(tokens))
        generator = state.generators[r]
        assert generator is not None
        assert torch.equal(generator.get_state(), replayed.get_state())
    assert {len(t) for t in out.token_ids} != {4}  # some rejected: the rewind mattered


def test_logprobs_are_the_raw_logprobs_of_emitted_tokens() -> None:
    logits = position_logits(seed=9, k=2)
    params = SamplingParams(temperature=0.8, logprobs=2)
    drafts = [[1, 2], [int(logits[0].argmax()), int(logits[1].argmax())]]
    out, _ = run_sampler(logits, drafts, params)
    assert out.logprobs is not None
    raw = logits.log_softmax(dim=1)
    row = 0
    for tokens in out.token_ids:
        for j, token in enumerate(tokens):
            assert out.logprobs.token_ids[row, 0] == token
            assert out.logprobs.logprobs[row, 0] == pytest.approx(raw[j, token].item())
            assert out.logprobs.token_ids[row, 1] == int(raw[j].argmax())
            row += 1
    assert row == out.logprobs.token_ids.shape[0]


def test_min_tokens_counts_the_drafts_before_each_position() -> None:
    """One output so far and min_tokens 3: EOS is banned at positions 0 and 1 only."""
    logits = position_logits(seed=4, k=3)
    logits[:, EOS] = 50.0  # EOS would win everywhere
    banned = logits.clone()
    banned[:2, EOS] = float("-inf")
    a0, a1 = int(banned[0].argmax()), int(banned[1].argmax())
    params = SamplingParams(temperature=0.0, min_tokens=3)
    out, _ = run_sampler(logits, [[a0, a1, EOS]], params)
    assert out.token_ids == [[a0, a1, EOS, EOS]]
    out, _ = run_sampler(logits, [[EOS, a1, EOS]], params)  # EOS at position 0 is banned
    assert out.token_ids == [[a0]]


def test_allowed_token_ids_hold_at_every_position() -> None:
    logits = position_logits(seed=5, k=2)
    allowed = [2, 3]
    best = [allowed[int(row[allowed].argmax())] for row in logits]
    assert any(int(row.argmax()) not in allowed for row in logits)
    params = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    out, _ = run_sampler(logits, [best[:2]], params)
    assert out.token_ids == [best]


def test_bad_words_see_the_drafts_before_each_position() -> None:
    """Output so far ends with 6: the bad word [8, 7] bans 7 only after the draft 8."""
    logits = position_logits(seed=6, k=2)
    logits[:, 7] = 50.0  # 7 would win everywhere ...
    logits[0, 8] = 60.0  # ... but 8 first
    after_ban = logits[1].clone()
    after_ban[7] = float("-inf")
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[8, 7]])
    out, _ = run_sampler(logits, [[8, 7]], params)
    assert out.token_ids == [[8, int(after_ban.argmax())]]
    out, _ = run_sampler(logits, [[8, 7]], SamplingParams(temperature=0.0))
    assert out.token_ids == [[8, 7, 7]]
    # [6, 8]: the output's own last token starts the word, so 8 is banned at position 0.
    out, _ = run_sampler(
        logits, [[8]], SamplingParams(temperature=0.0, bad_words_token_ids=[[6, 8]])
    )
    assert out.token_ids[0][0] != 8
