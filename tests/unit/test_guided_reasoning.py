"""Structured outputs after the thinking: with `reasoning_end_token_ids` the constraint
starts once the output holds them, so the thinking is free text (engine core, real
tokenizer and xgrammar, a fake worker that samples from the plan's mask rows)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from test_guided_engine_core import REGEX, MaskWorker, compiler_for, make_core, run
from test_guided_engine_core import tokenizer as tokenizer

from kvflow.proto.engine import AddRequest
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.services.scheduler.grammar_matcher import RequestGrammar

THOUGHT = "Let me think: 1, 2, 3."


class ThinkingWorker(MaskWorker):
    """Writes `thought` + `end` while a request's row restricts nothing, then samples
    from its mask like MaskWorker."""

    def __init__(self, eos: int, thought: list[int], prompt_len: int) -> None:
        super().__init__(eos)
        self.thought = thought
        self.prompt_len = prompt_len

    def _pick(self, history: list[int], mask: np.ndarray | None) -> int:
        written = len(history) - self.prompt_len
        if mask is None and written < len(self.thought):
            return self.thought[written]
        return super()._pick(history, mask)


def test_the_constraint_starts_after_the_thinking(tokenizer: Any) -> None:
    end = tokenizer.encode("</think>", add_special_tokens=False)
    thought = tokenizer.encode(THOUGHT, add_special_tokens=False) + end
    prompt = [1, 7, 9, 11, 13, 17]
    core = make_core(tokenizer, 2, 64, compiler_for(tokenizer))
    guided = StructuredOutputsParams(regex=REGEX, reasoning_end_token_ids=end)
    params = SamplingParams(max_tokens=64, structured_outputs=guided)
    core.add_request(AddRequest("r", prompt, params, 0.0), now=0.0)
    worker = ThinkingWorker(tokenizer.eos_token_id, thought, len(prompt))
    tokens = run(core, worker)["r"]
    assert tokens[: len(thought)] == thought  # free text: the regex would refuse it
    assert tokens[-1] == tokenizer.eos_token_id
    assert re.fullmatch(REGEX, tokenizer.decode(tokens[len(thought) : -1]))
    # No mask row while thinking: the first rows appear once the end was sampled.
    rows = [rows for rows in worker.rows_seen if rows]
    assert len(rows) < len(worker.rows_seen) - len(thought) + 2


def test_rollback_into_the_thinking_reopens_it(tokenizer: Any) -> None:
    end = tokenizer.encode("</think>", add_special_tokens=False)
    compiled = compiler_for(tokenizer).submit(StructuredOutputsParams(regex="ab-[0-9]+"))
    grammar = RequestGrammar(compiled.result(timeout=60), end)
    thought = tokenizer.encode("zz top", add_special_tokens=False)
    answer = tokenizer.encode("ab-12", add_special_tokens=False)
    assert all(grammar.accept(t) for t in thought)
    assert grammar.in_reasoning and not grammar.next_row()[1]  # nothing restricted
    assert all(grammar.accept(t) for t in end) and not grammar.in_reasoning
    assert grammar.next_row()[1]  # now the regex restricts
    assert not grammar.accept(thought[0])  # thinking text no longer fits
    assert all(grammar.accept(t) for t in answer)
    grammar.rollback(len(answer) + 1)  # back inside the end tag (or before it)
    assert grammar.in_reasoning and grammar.num_accepted == len(thought) + len(end) - 1
    assert grammar.replay(thought + end + answer) and not grammar.in_reasoning
    assert grammar.accept(tokenizer.eos_token_id) and grammar.is_terminated
