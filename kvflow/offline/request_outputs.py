"""Offline results: the detokenizer's text deltas assembled into `RequestOutput`s.

One `RequestOutput` per user request; its n samples run as engine requests of their
own ("<id>#<index>", `child_request_ids`), each filling one `CompletionOutput`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.step import TokenLogprobs


@dataclass
class _Sample:
    parent: RequestOutput
    output: CompletionOutput


class RequestOutputs:
    def __init__(self) -> None:
        self._parents: dict[str, list[str]] = {}  # request id -> its samples' ids
        self._samples: dict[str, _Sample] = {}  # unfinished samples by engine request id

    def add(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], child_ids: list[str]
    ) -> None:
        output = RequestOutput(request_id, prompt, prompt_ids, outputs=[])
        for index, child_id in enumerate(child_ids):
            completion = CompletionOutput(index, "", [])
            output.outputs.append(completion)
            self._samples[child_id] = _Sample(output, completion)
        self._parents[request_id] = list(child_ids)

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its samples' engine request ids."""
        child_ids = self._parents.pop(request_id, [])
        for child_id in child_ids:
            self._samples.pop(child_id, None)
        return child_ids

    def request_ids(self) -> list[str]:
        """The unfinished requests' ids."""
        return list(self._parents)

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def apply(self, deltas: Sequence[RequestOutputDelta]) -> list[RequestOutput]:
        """The requests these deltas changed, in first-change order."""
        changed: dict[str, RequestOutput] = {}
        for delta in deltas:
            sample = self._samples.get(delta.req_id)
            if sample is None:
                continue
            _extend(sample, delta)
            parent = sample.parent
            if delta.finish_reason is not None:
                self._samples.pop(delta.req_id)
                if all(o.finish_reason is not None for o in parent.outputs):
                    parent.finished = True
                    self._parents.pop(parent.request_id, None)
            changed[parent.request_id] = parent
        return list(changed.values())


def _extend(sample: _Sample, delta: RequestOutputDelta) -> None:
    completion, parent = sample.output, sample.parent
    completion.token_ids.extend(delta.token_ids)
    completion.text += delta.text
    if delta.logprobs:
        entries = _logprob_dicts(delta.logprobs, delta.logprob_tokens)
        completion.logprobs = (completion.logprobs or []) + entries
    if delta.prompt_logprobs and parent.prompt_logprobs is None:
        prompt: PromptLogprobs = [None]
        prompt += _logprob_dicts(delta.prompt_logprobs, delta.prompt_logprob_tokens)
        parent.prompt_logprobs = prompt
    parent.num_cached_tokens = delta.num_cached_tokens
    if delta.cumulative_logprob is not None:
        completion.cumulative_logprob = delta.cumulative_logprob
    if delta.finish_reason is not None:
        completion.finish_reason = delta.finish_reason
        completion.stop_reason = delta.stop_reason


def _logprob_dicts(
    entries: list[TokenLogprobs], strings: list[list[str]]
) -> list[dict[int, Logprob]]:
    """Per position: the chosen token (its own rank) first, then the top-N by rank."""
    result = []
    for entry, tokens in zip(entries, strings):
        position: dict[int, Logprob] = {}
        for index, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
            if token_id not in position:
                rank = entry.rank if index == 0 else index
                position[token_id] = Logprob(logprob, rank, tokens[index])
        result.append(position)
    return result
