"""A stream the proxy resumes (kv_params.py: its signed `kv_resume`) on this side: which
choices go on from which tokens, and which finished before the old stream broke.

    choice index ─▶ ResumedChoice(token_ids, finished)
        finished:   counted in usage, never generated again
        unfinished: sent with its tokens as AddRequest.output_token_ids; its first delta
                    brings their text (resumed_text), which its stream state absorbs
        absent:     the client has none of it: it starts as in any request
"""

from __future__ import annotations

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import SamplingParams
from kvflow.services.frontend.kv_params import ResumedChoice


def resumed_choices(
    resumed: list[ResumedChoice] | None, num_prompts: int, params: SamplingParams
) -> dict[int, ResumedChoice] | None:
    """Choice index -> its resumed state (None: not a resumed stream); 400 for choices the
    request does not have, and for a beam search (its beams are not choices)."""
    if resumed is None:
        return None
    by_index = {c.index: c for c in resumed}
    num_choices = num_prompts * params.n
    if params.beam_search is not None or len(by_index) < len(resumed) or any(
        not 0 <= index < num_choices for index in by_index
    ):  # fmt: skip
        raise InvalidRequestError(
            f"kv_resume names choices this request does not have (it has {num_choices}), "
            "or resumes a beam search",
            param="kv_resume",
        )
    return by_index


def samples_of(
    resume: dict[int, ResumedChoice] | None, prompt_index: int, n: int
) -> list[list[int] | None] | None:
    """A prompt's samples as the engine resumes them: the tokens each client has ([] for
    one it has none of), None for one that finished."""
    if resume is None:
        return None
    samples: list[list[int] | None] = []
    for index in range(prompt_index * n, (prompt_index + 1) * n):
        choice = resume.get(index)
        samples.append([] if choice is None else None if choice.finished else choice.token_ids)
    return samples
