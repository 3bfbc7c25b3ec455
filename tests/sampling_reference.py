"""An independent reference for the sampling tests: transformers' float32 logits with the
sampling steps applied as transformers' logits processors define them (and OpenAI's
presence/frequency penalties written out), plus a chi-square goodness-of-fit test.

Nothing here imports kvflow's sampler, so a bug there cannot hide in the reference.
Imported by name by tests/e2e and tests/integration (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

import torch

ALPHA = 1e-4  # false-alarm rate of one chi-square test (the tests use fixed seeds anyway)
MIN_EXPECTED = 5.0  # the usual validity rule for Pearson's statistic


@dataclass(frozen=True)
class Processing:
    """What the engine should do to the logits, in vLLM's order: logit_bias, penalties,
    temperature, then one of min_p / top_k / top_p. The two `*_see_prompt` switches
    describe the histories; flipping them builds the distribution a buggy engine samples."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    penalties_see_prompt: bool = False  # presence/frequency: OpenAI counts output tokens
    repetition_sees_prompt: bool = True  # transformers / vLLM: prompt + output tokens

    def but(self, **changes: object) -> Processing:
        return replace(self, **changes)  # type: ignore[arg-type]


class Reference:
    """transformers' model in float32: the logits every expectation starts from."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()

    @torch.inference_mode()
    def last_logits(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B, V] logits after each of B equally long sequences."""
        return self.model(torch.tensor(sequences)).logits[:, -1].float()

    @torch.inference_mode()
    def teacher_forced(
        self, prompt: list[int], outputs: Sequence[Sequence[int]], chunk: int = 32
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, logits [b, T, V]) per chunk of equally long outputs: row t holds
        the logits that predicted outputs[i][t], given the prompt and outputs[i][:t]."""
        start = len(prompt) - 1
        for first in range(0, len(outputs), chunk):
            rows = [prompt + list(out) for out in outputs[first : first + chunk]]
            logits = self.model(torch.tensor(rows)).logits[:, start:-1].float()
            yield first, logits


def probabilities(
    logits: torch.Tensor,  # [N, V] raw logits
    prompt: list[int],
    histories: Sequence[Sequence[int]],  # N output histories, the tokens before each row
    spec: Processing,
) -> torch.Tensor:  # [N, V]
    """Next-token probabilities after the processors of `spec`."""
    from transformers import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = logits.clone()
    for token_id, bias in spec.logit_bias:
        x[:, token_id] += bias
    output_counts = token_counts(histories, x.shape[1])  # [N, V]
    if spec.repetition != 1.0:
        x = _repetition(x, prompt, histories, output_counts, spec)
    counted = output_counts
    if spec.penalties_see_prompt:
        counted = counted + token_counts([prompt], x.shape[1])
    if spec.frequency != 0.0:
        x = x - spec.frequency * counted
    if spec.presence != 0.0:
        x = x - spec.presence * (counted > 0).float()
    unused: Any = torch.zeros(x.shape[0], 1, dtype=torch.int64)  # warpers ignore input_ids
    if spec.temperature != 1.0:
        x = TemperatureLogitsWarper(spec.temperature)(unused, x)
    if spec.min_p > 0.0:
        x = MinPLogitsWarper(spec.min_p)(unused, x)
    if spec.top_k > 0:
        x = TopKLogitsWarper(spec.top_k)(unused, x)
    if spec.top_p < 1.0:
        x = TopPLogitsWarper(spec.top_p)(unused, x)
    return x.softmax(dim=-1)


def _repetition(
    x: torch.Tensor,
    prompt: list[int],
    histories: Sequence[Sequence[int]],
    output_counts: torch.Tensor,
    spec: Processing,
) -> torch.Tensor:
    from transformers import RepetitionPenaltyLogitsProcessor

    if not spec.repetition_sees_prompt:  # the wrong history, written out
        r = spec.repetition
        return torch.where(output_counts > 0, torch.where(x > 0, x / r, x * r), x)
    # transformers wants one [N, L] id tensor: pad with a prompt token (already counted).
    length = len(prompt) + max(len(h) for h in histories)
    ids = [prompt + list(h) + [prompt[0]] * (length - len(prompt) - len(h)) for h in histories]
    return RepetitionPenaltyLogitsProcessor(spec.repetition)(torch.tensor(ids), x)


def token_counts(histories: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """[N, V] occurrences of each token in each history."""
    counts = torch.zeros(len(histories), vocab_size)
    rows = [row for row, history in enumerate(histories) for _ in history]
    ids = [token_id for history in histories for token_id in history]
    index = (torch.tensor(rows, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64))
    counts.index_put_(index, torch.ones(len(ids)), accumulate=True)
    return counts


# ---- a spread next-token distribution ------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """A prompt and its next-token probabilities at some temperature, most likely first."""

    prompt: list[int]
    logits: torch.Tensor  # [V] raw
    probs: torch.Tensor  # [V] at temperature, sorted descending
    token_ids: torch.Tensor  # [V] the tokens of `probs`

    def cumulative(self, count: int) -> float:
        return self.probs[:count].sum().item()

    def ratio(self, rank: int) -> float:
        return (self.probs[rank] / self.probs[0]).item()

    def next_probs(self, spec: Processing) -> torch.Tensor:
        return probabilities(self.logits.unsqueeze(0), self.prompt, [[]], spec)[0]


def pick_spread(reference: Reference, prompts: list[list[int]], temperature: float) -> Spread:
    """The prompt whose 5th most likely token is the most likely: then keeping one token
    too many or too few (of 4) in top-k, top-p or min-p moves a lot of probability."""
    best = None
    for prompt in prompts:
        logits = reference.last_logits([prompt])[0]
        probs, token_ids = (logits / temperature).softmax(dim=0).sort(descending=True)
        if best is None or probs[4] > best.probs[4]:
            best = Spread(prompt, logits, probs, token_ids)
    assert best is not None
    # The power of the truncation tests rests on these (true of the seeded tiny models).
    assert best.probs[4] > 0.04 and best.probs[3] > 1.2 * best.probs[4], best.probs[:6]
    return best


def distribution_cases(
    s: Spread, temperature: float
) -> dict[str, tuple[Processing, list[Processing]]]:
    """name -> (what the engine must sample, what a plausible bug would sample instead).
    top_k, top_p and min_p all keep the 4 most likely tokens; their bugs keep 3 or 5."""
    t = Processing(temperature=temperature)
    top_p = [(s.cumulative(k) + s.cumulative(k + 1)) / 2 for k in (2, 3, 4)]
    min_p = [math.sqrt(s.ratio(k) * s.ratio(k + 1)) for k in (2, 3, 4)]
    ids = s.token_ids.tolist()
    bias = ((ids[0], -0.3), (ids[4], 0.25), (ids[40], 1.0))
    return {
        "temperature": (t, [t.but(temperature=temperature * 1.25)]),
        "top_k": (t.but(top_k=4), [t.but(top_k=3), t.but(top_k=5)]),
        "top_p": (t.but(top_p=top_p[1]), [t.but(top_p=top_p[0]), t.but(top_p=top_p[2])]),
        "min_p": (t.but(min_p=min_p[1]), [t.but(min_p=min_p[2]), t.but(min_p=min_p[0])]),
        "logit_bias": (t.but(logit_bias=bias), [t, t.but(logit_bias=bias[:2])]),
    }


# ---- penalties over a history that repeats -------------------------------------------

# A logit bias makes four tokens likely at every step, so outputs repeat them and the
# penalties have something to count; two of them are in the prompt too, where
# presence/frequency must not see them and the repetition penalty must.
ATTRACTORS = (1000, 2000, 3000, 4000)
ATTRACTOR_BIAS = 12.0
PENALTY_TEMPERATURE = 0.7


def penalty_cases() -> dict[str, tuple[Processing, dict[str, Processing]]]:
    base = Processing(
        temperature=PENALTY_TEMPERATURE,
        logit_bias=tuple((t, ATTRACTOR_BIAS) for t in ATTRACTORS),
    )
    presence = base.but(presence=1.0)
    frequency = base.but(frequency=1.0)
    repetition = base.but(repetition=1.15)
    return {
        "presence": (
            presence,
            {
                "wrong sign": presence.but(presence=-1.0),
                "not applied": base,
                "counts the prompt": presence.but(penalties_see_prompt=True),
            },
        ),
        "frequency": (
            frequency,
            {
                "wrong sign": frequency.but(frequency=-1.0),
                "not applied": base,
                "counts the prompt": frequency.but(penalties_see_prompt=True),
                "as presence": base.but(presence=1.0),
            },
        ),
        "repetition": (
            repetition,
            {
                "inverted": repetition.but(repetition=1 / 1.15),
                "not applied": base,
                "ignores the prompt": repetition.but(repetition_sees_prompt=False),
            },
        ),
    }


def penalty_prompt(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode("Once upon a time")) + list(ATTRACTORS[:2])


def sampling_fields(spec: Processing) -> dict[str, Any]:
    """`spec` as SamplingParams / OpenAI request fields (logit_bias keyed by int)."""
    return {
        "temperature": spec.temperature,
        "top_k": spec.top_k,
        "top_p": spec.top_p,
        "min_p": spec.min_p,
        "presence_penalty": spec.presence,
        "frequency_penalty": spec.frequency,
        "repetition_penalty": spec.repetition,
        "logit_bias": dict(spec.logit_bias) or None,
    }


# ---- goodness of fit ----------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """Pearson's chi-square of observed against expected counts per category."""

    statistic: float
    critical: float
    table: str  # "category: observed / expected" lines, for failure messages

    @property
    def rejected(self) -> bool:
        return self.statistic > self.critical

    def __str__(self) -> str:
        return f"chi2 {self.statistic:.1f} vs critical {self.critical:.1f}\n{self.table}"


def chi_square_critical(df: int, alpha: float = ALPHA) -> float:
    """Wilson-Hilferty's quantile of chi2(df): within 1% for df >= 3, and larger than the
    exact quantile (so conservative) for df 1-2 at small alpha."""
    z = NormalDist().inv_cdf(1.0 - alpha)
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(observed: dict[str, float], expected: dict[str, float]) -> Fit:
    """Categories whose expected count is below MIN_EXPECTED are merged, smallest first.
    A category with expected count 0 and any observation makes the statistic infinite
    (a token the reference never samples was sampled)."""
    total = sum(expected.values())
    assert abs(total - sum(observed.values())) < 1e-3 * total, (observed, expected)
    impossible = [c for c, e in expected.items() if e <= 1e-9 and observed.get(c, 0) > 0]
    groups = [([c], observed.get(c, 0.0), e) for c, e in expected.items() if e > 1e-9]
    groups.sort(key=lambda g: g[2])
    while len(groups) > 2 and groups[0][2] < MIN_EXPECTED:
        a, b, *rest = groups
        merged = (a[0] + b[0], a[1] + b[1], a[2] + b[2])
        groups = sorted([merged, *rest], key=lambda g: g[2])
    statistic = sum((o - e) ** 2 / e for _, o, e in groups)
    if impossible:
        statistic = math.inf
    lines = [f"{'+'.join(n)[:60]}: {o:.0f} / {e:.1f}" for n, o, e in groups]
    lines += [f"{c}: {observed[c]:.0f} / 0 (impossible)" for c in impossible]
    return Fit(statistic, chi_square_critical(max(1, len(groups) - 1)), "\n".join(lines))


def token_fit(probs: torch.Tensor, samples: Sequence[int]) -> Fit:
    """One next-token distribution [V] against samples of it: a category per token
    expected at least MIN_EXPECTED times, the other possible tokens together, and
    every impossible token (probability 0, e.g. cut by top-k) on its own."""
    n = len(samples)
    big = (probs * n >= MIN_EXPECTED).nonzero().squeeze(1).tolist()
    expected = {f"token {t}": probs[t].item() * n for t in big}
    expected["other tokens"] = n - sum(expected.values())
    observed = dict.fromkeys(expected, 0.0)
    for token_id in samples:
        if token_id in big:
            key = f"token {token_id}"
        elif probs[token_id].item() > 0.0:
            key = "other tokens"
        else:
            key = f"token {token_id}"
            expected.setdefault(key, 0.0)
        observed[key] = observed.get(key, 0.0) + 1
    return chi_square(observed, expected)


class ConditionalTally:
    """Goodness of fit of many next-token distributions (each step of each sample,
    conditioned on its own history), one sampled token each. Under the reference a row
    falls into category c with probability probs(c), so expected counts are sums of
    probabilities. Categories: the token's rank (1, 2, 3, 4-6, 7+) crossed with its
    place in the history (HISTORY_GROUPS), which is where penalties move probability.
    A sum of unequal categoricals is less spread than a multinomial: chi2 stays
    conservative."""

    def __init__(self) -> None:
        self.observed: dict[str, float] = {}
        self.expected: dict[str, float] = {}

    def add(self, probs: torch.Tensor, chosen: torch.Tensor, groups: torch.Tensor) -> None:
        """probs [N, V]; chosen [N] int64; groups [N, V] int64 (see history_groups)."""
        top, top_ids = probs.topk(6, dim=1)  # [N, 6]
        top_groups = groups.gather(1, top_ids)  # [N, 6]
        num_groups = len(HISTORY_GROUPS)
        group_mass = probs.new_zeros(len(probs), num_groups).scatter_add_(1, groups, probs)
        top_mass = probs.new_zeros(len(probs), num_groups).scatter_add_(1, top_groups, top)
        rest = (group_mass - top_mass).clamp_min(0).sum(dim=0).tolist()  # [G], ranks 7+
        for g, group in enumerate(HISTORY_GROUPS):
            in_top = (top * (top_groups == g)).sum(dim=0).tolist()  # [6]
            for bucket, mass in zip(_RANK_BUCKETS, in_top):
                self._count(self.expected, f"{bucket}, {group}", mass)
            self._count(self.expected, f"rank 7+, {group}", rest[g])

        chosen_p = probs.gather(1, chosen.unsqueeze(1))  # [N, 1]
        ranks = (probs > chosen_p).sum(dim=1).tolist()  # 0-based; ties take the better rank
        chosen_groups = groups.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        for rank, g, p in zip(ranks, chosen_groups, chosen_p.squeeze(1).tolist()):
            key = "impossible"
            if p > 0.0:
                key = f"{_RANK_BUCKETS[min(rank, 6)]}, {HISTORY_GROUPS[g]}"
            self._count(self.observed, key, 1.0)
        self.expected.setdefault("impossible", 0.0)

    @staticmethod
    def _count(table: dict[str, float], key: str, value: float) -> None:
        table[key] = table.get(key, 0.0) + value

    def fit(self) -> Fit:
        return chi_square(self.observed, self.expected)


HISTORY_GROUPS = ("new", "in prompt only", "once in output", "2+ times in output")
_RANK_BUCKETS = ("rank 1", "rank 2", "rank 3", "rank 4-6", "rank 4-6", "rank 4-6", "rank 7+")


def history_groups(prompt: list[int], histories: Sequence[Sequence[int]], vocab_size: int):  # type: ignore[no-untyped-def]
    """[N, V] int64 index into HISTORY_GROUPS of every token, given each row's history."""
    counts = token_counts(histories, vocab_size).clamp_max(2).long()  # 0, 1, 2+
    in_prompt = token_counts([prompt], vocab_size) > 0  # [1, V]
    return torch.where(counts > 0, counts + 1, in_prompt.long())


def tally_conditionals(
    reference: Reference,
    prompt: list[int],
    outputs: Sequence[Sequence[int]],
    specs: dict[str, Processing],
) -> tuple[dict[str, ConditionalTally], torch.Tensor]:
    """Teacher-force every output (all of one length) through transformers and tally its
    tokens against each spec's distributions. Also returns the raw logprobs [N, T] of
    the output tokens (the model's own, before any processing)."""
    tallies = {name: ConditionalTally() for name in specs}
    raw = []
    for first, logits in reference.teacher_forced(prompt, outputs):  # [b, T, V]
        b, steps, vocab = logits.shape
        rows = outputs[first : first + b]
        histories = [list(out[:t]) for out in rows for t in range(steps)]
        chosen = torch.tensor([token for out in rows for token in out])  # [b * T]
        flat = logits.reshape(b * steps, vocab)
        raw.append(flat.log_softmax(dim=1).gather(1, chosen.unsqueeze(1)).view(b, steps))
        groups = history_groups(prompt, histories, vocab)
        for name, spec in specs.items():
            tallies[name].add(probabilities(flat, prompt, histories, spec), chosen, groups)
    return tallies, torch.cat(raw)
