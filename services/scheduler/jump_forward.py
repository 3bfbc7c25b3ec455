"""Jump-forward: append the tokens a grammar forces without running the model for them.

Where a guided request's grammar allows exactly one token next, sampling can only
return that token (the mask leaves it the only finite logit), so the scheduler appends
it at once and looks again, until the grammar offers a choice, terminates, or a stop
condition holds. The tokens reach the worker in the next plan (`forced_token_ids`);
the request then computes them together with its last sampled token, as a short
prefill chunk, and samples once after them: k forced tokens cost one step, not k.

Exact by construction: a *string* the grammar forces (xgrammar's
`find_jump_forward_string`, SGLang's compressed FSM) is not used, because the model
may spell it with other tokens (`":` or `"` then `:`), and retokenizing it would change
the output. Only single-token masks are taken, so the output is token for token the
one without jump-forward under greedy sampling, and the same distribution otherwise
(a seeded request may draw different later tokens: its generator skips the steps).

Not for requests that report logprobs (a forced token has no model distribution to
report) or that still owe `min_tokens` (the worker then masks stop tokens itself).
"""

from __future__ import annotations

from kvflow.services.scheduler.grammar_matcher import fill_rows
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.step_features import StepBuilder, StepFeature

MAX_FORCED_PER_STEP = 256  # bounds one result's work; the rest is forced next step


def may_jump_forward(request: Request) -> bool:
    params = request.sampling_params
    return (
        request.grammar is not None
        and not request.is_finished
        and params.logprobs is None
        and request.num_output_tokens >= params.min_tokens
    )


def jump_forward(request: Request, max_model_len: int) -> list[int]:
    """Append the tokens `request`'s grammar forces next (checking stop conditions after
    each, as for sampled tokens); returns them."""
    if not may_jump_forward(request):
        return []
    grammar = request.grammar
    assert grammar is not None
    forced: list[int] = []
    while len(forced) < MAX_FORCED_PER_STEP:
        token_id = grammar.forced_token()
        if token_id is None:
            break
        accepted = grammar.accept(token_id)
        assert accepted, (request.request_id, token_id)  # the mask allowed only it
        request.append_output_token(token_id)
        forced.append(token_id)
        if request.check_stop(max_model_len):
            break
    return forced


class JumpForwardFeature(StepFeature):
    """Jump-forward as a scheduler step feature: forced tokens go out in the same delta
    as the sampled ones, and reach the worker in the next plan (`forced_token_ids`)."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.num_tokens = 0  # forced so far (the grammar stats' jump_forward_tokens)
        self._pending: dict[str, list[int]] = {}  # forced since the last plan

    def begin_step(self, step: StepBuilder) -> None:
        step.forced_token_ids, self._pending = self._pending, {}

    def on_tokens(self, applied: list[tuple[Request, list[int]]]) -> None:
        guided = [(r, ids) for r, ids in applied if r.grammar is not None]
        # The probes read the next masks: fill them all in one batched call.
        fill_rows([r.grammar for r, _ in guided if r.grammar and not r.is_finished])
        for request, new_token_ids in guided:
            forced = jump_forward(request, self.max_model_len)
            if forced and not request.is_finished:  # a finished request's KV is not needed
                self._pending.setdefault(request.request_id, []).extend(forced)
            self.num_tokens += len(forced)
            new_token_ids += forced

    def on_preempt(self, request: Request, step: StepBuilder | None) -> None:
        # It resumes with all its tokens: none is sent as forced.
        forced = self._pending if step is None else step.forced_token_ids
        forced.pop(request.request_id, None)

    def on_worker_lost(self) -> list[Request]:
        self._pending = {}  # the new worker knows no request
        return []

    def on_finish(self, request: Request) -> None:
        self._pending.pop(request.request_id, None)
