"""Beam search's bookkeeping for one request: which continuations survive a step.

Sans-IO and free of requests and blocks: it takes, per running beam, the top
log-probabilities of its next token and returns the beams of the next step as
(parent, token, score). `beam_feature.py` maps that onto KV blocks and requests.

The rules are those of transformers' `generate(num_beams=k, do_sample=False)`, so that
outputs agree token for token, and its float32 arithmetic (numpy scalars round as
torch's float32 tensors do)::

    step   candidates = every beam's top-K tokens, score = beam score + logprob
           keep the best K = max(2, 1 + #stop ids) * k of them (enough that k never stop)
           a candidate among the best k that stops (EOS, stop id, or the length limit)
               -> a finished hypothesis, scored score / generated_len ** length_penalty,
                  unless k hypotheses are in and early_stopping, or nothing can improve
           the best k candidates that do not stop -> the next step's beams
    done   when every candidate stops, when k hypotheses are in and early_stopping,
           or when the best running beam cannot beat the worst hypothesis (its score
           over the current length ** length_penalty; the length limit's instead when
           early_stopping == "never" and length_penalty > 0)

The first step runs on one beam (the prompt): transformers' other k - 1 copies start at
-1e9 and never reach the best K.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

_NEG = np.float32(-1.0e9)  # transformers' "impossible" score


@dataclass(frozen=True)
class Continuation:
    """A beam of the next step: running beam `parent` followed by `token_id`."""

    parent: int
    token_id: int
    score: np.float32  # cumulative logprob, prompt excluded


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens (the stop token included) and its score."""

    token_ids: list[int]
    score: np.float32  # length-penalised
    logprob: np.float32  # the tokens' logprob sum
    stopped: bool  # ended on a stop token (else on the length limit)


class BeamSearch:
    def __init__(
        self,
        beam_width: int,
        num_stop_ids: int,
        length_penalty: float,
        early_stopping: bool | str,
        max_new_tokens: int,
    ) -> None:
        self.beam_width = beam_width
        self.num_candidates = max(2, 1 + num_stop_ids) * beam_width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new_tokens = max_new_tokens
        self.scores: list[np.float32] = [np.float32(0.0)]  # per running beam
        self.num_generated = 0  # tokens each running beam has generated
        self.finished: list[Hypothesis] = []  # the best k, best first
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    def step(
        self,
        top_logprobs: Sequence[Sequence[tuple[int, float]]],
        generated: Sequence[list[int]],
        stops: Callable[[int], bool],
    ) -> list[Continuation]:
        """One step: per running beam, its top-K (token, logprob) and its generated
        tokens so far; returns the next step's beams (best first; [] when done)."""
        assert len(top_logprobs) == len(self.scores) == len(generated)
        candidates = self._best_candidates(top_logprobs)
        at_limit = self.num_generated + 1 >= self.max_new_tokens
        hits = [at_limit or stops(c.token_id) for c in candidates]
        running = [c for c, hit in zip(candidates, hits) if not hit][: self.beam_width]
        self._add_finished(candidates, hits, generated, stops)
        self.num_generated += 1
        self.scores = [c.score for c in running]
        self._check_improvable()
        full = len(self.finished) == self.beam_width and self.early_stopping is True
        self.done = all(hits) or not running or full or not self.improvable
        return [] if self.done else running

    def best(self, count: int) -> list[Hypothesis]:
        """The `count` best finished hypotheses, best first."""
        return self.finished[:count]

    def _best_candidates(
        self, top_logprobs: Sequence[Sequence[tuple[int, float]]]
    ) -> list[Continuation]:
        candidates = [
            Continuation(parent, token_id, np.float32(score + np.float32(logprob)))
            for parent, (score, top) in enumerate(zip(self.scores, top_logprobs))
            for token_id, logprob in top
        ]
        # Stable: equal scores keep the lower beam and then the better-ranked token.
        candidates.sort(key=lambda c: -c.score)
        return candidates[: self.num_candidates]

    def _add_finished(
        self,
        candidates: list[Continuation],
        hits: list[bool],
        generated: Sequence[list[int]],
        stops: Callable[[int], bool],
    ) -> None:
        full = len(self.finished) == self.beam_width and self.early_stopping is True
        if full or not self.improvable:
            return
        # A Python float, as transformers divides by: the scalar rounds to float32.
        length = float(self.num_generated + 1) ** self.length_penalty
        added = False
        for candidate, hit in list(zip(candidates, hits))[: self.beam_width]:
            if not hit:
                continue
            tokens = generated[candidate.parent] + [candidate.token_id]
            score = np.float32(candidate.score / length)
            stopped = stops(candidate.token_id)
            self.finished.append(Hypothesis(tokens, score, candidate.score, stopped))
            added = True
        if added:
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.beam_width :]

    def _check_improvable(self) -> None:
        if not self.improvable or len(self.finished) < self.beam_width or not self.scores:
            return
        length = self.num_generated
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens
        best_possible = np.float32(self.scores[0] / float(length) ** self.length_penalty)
        self.improvable = bool(best_possible > self.finished[-1].score)
