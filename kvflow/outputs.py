"""What the offline API returns (vLLM's shapes, so user code ports over)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # first prompt token has none


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None  # beam search: the beam's logprob sum

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)

    # Shortcuts to the first sample: most requests have n=1.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> SampleLogprobs | None:
        return self.outputs[0].logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # float32 values; unit length when the model normalises

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One finished beam of `LLM.beam_search`: prompt and output tokens, and the text of
    both (vLLM's shape)."""

    tokens: list[int]
    text: str
    cum_logprob: float = 0.0  # the output tokens' logprob sum (no length penalty)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]
