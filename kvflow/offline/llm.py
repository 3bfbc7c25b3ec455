"""The offline API: `LLM(model).generate(prompts, params)`, as vLLM users know it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvflow.config import EngineConfig
from kvflow.errors import ConfigError, InvalidRequestError
from kvflow.heap import heap_frozen_while, keep_freed_memory
from kvflow.media import MediaOptions
from kvflow.offline.chat_messages import split_images
from kvflow.offline.engine import LLMEngine
from kvflow.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from kvflow.pooling import PoolingParams, check_dimensions, embedding_vector
from kvflow.proto.lora import LoRARequest
from kvflow.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    truncate_prompt,
    validate_sampling_params,
)
from kvflow.tokenizer import Conversation, apply_chat_template

# A text prompt, token ids, or {"prompt": text or ids, "multi_modal_data": {"image": a
# PIL image or a list of them}}: the prompt holds the model's image token once per image.
Prompt = str | list[int] | dict[str, Any]


class LLM:
    """An engine in this process. `model=None` serves the embedded SmolLM2-135M-Instruct."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        **engine_options: Any,
    ) -> None:
        config = EngineConfig.create(model=model, dtype=dtype, device=device, **engine_options)
        if config.parallel.data_parallel_size != 1:
            # One process, one engine core: D cores here would share the same CPU/GPU
            # and give no throughput; data parallelism is `kvflow serve`'s.
            raise ConfigError(
                "LLM runs one engine core in process; for data parallelism use "
                "`kvflow serve --data-parallel-size N`"
            )
        if config.scheduler.sheds_load:
            # generate() hands the engine every prompt at once, and wants every answer.
            raise ConfigError(
                "max_waiting_requests and max_queue_delay shed a server's load; LLM.generate "
                "runs every prompt it is given (set them on `kvflow serve`)"
            )
        if config.device.measure_weight_read:
            raise ConfigError(
                "measure_weight_read sets a server's /metrics bandwidth roof; `kvflow bench "
                "throughput` reports the weights' read pass offline (set it on `kvflow serve`)"
            )
        keep_freed_memory()  # this process runs the model's steps
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); also done at exit."""
        self.engine.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. `lora_request`:
        one adapter for every prompt, or one per prompt (None: the base model)."""
        if self.engine.pooling is not None:
            raise InvalidRequestError(
                "this engine runs the pooling runner: call embed(), or build the LLM "
                "with runner='generate'",
                param="runner",
            )
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        loras = _broadcast_loras(lora_request, len(prompt_list))
        return self._run(self._add_all(prompt_list, params_list, loras), use_tqdm)

    def _add_all(
        self,
        prompts: Sequence[Prompt],
        params_list: list[SamplingParams],
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Admit every prompt (all or none: a refused one aborts those before it)."""
        request_ids: list[str] = []
        loras = loras if loras is not None else [None] * len(prompts)
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                request_id = str(next(self._ids))
                text, images = _prompt_and_images(prompt)
                self.engine.add_request(request_id, text, params, images=images, lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order (an engine with runner="pooling")."""
        spec = self.engine.pooling
        if spec is None:
            raise InvalidRequestError(
                "embed() needs the pooling runner: LLM(model, runner='pooling')", param="runner"
            )
        dimensions = (pooling_params or PoolingParams()).dimensions
        check_dimensions(spec, dimensions)
        params = SamplingParams(max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens)
        validate_sampling_params(params)
        token_ids = [
            truncate_prompt(self._token_ids(p), params, self.engine.max_model_len)
            for p in _as_prompt_list(prompts)
        ]
        request_ids = self._add_all(token_ids, [params] * len(token_ids))
        pooled = self._run_pooled(request_ids, use_tqdm)
        return [
            EmbeddingRequestOutput(
                request_id,
                EmbeddingOutput(embedding_vector(pooled[request_id], spec, dimensions).tolist()),
                ids,
            )
            for request_id, ids in zip(request_ids, token_ids)
        ]

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):  # a prompt with images: generate() takes those
            raise InvalidRequestError(
                "embed() takes text or token ids, not images", param="prompts"
            )
        return list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)

    def _run_pooled(self, request_ids: list[str], use_tqdm: bool) -> dict[str, bytes]:
        """Step until every request is pooled; its vector by request id."""
        pooled: dict[str, bytes] = {}
        progress = tqdm(total=len(request_ids), desc="embedding", disable=not use_tqdm)
        try:
            with heap_frozen_while():
                while self.engine.has_unfinished_requests():
                    for delta in self.engine.step_deltas():
                        if delta.finish_reason == "error":
                            raise _failure(delta.error or "the engine failed", delta.error_param)
                        if delta.finish_reason is not None:
                            pooled[delta.req_id] = delta.pooled
                            progress.update(1)
        except BaseException:
            if self.engine.has_unfinished_requests():
                self.engine.recover_from_failed_step()
            raise
        finally:
            progress.close()
        return pooled

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. A
        message's content may be a list of text and image parts (chat_messages.py)."""
        conversations: list[Conversation]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        image_token = self.engine.image_token()
        prompts: list[Prompt] = []
        for conversation in conversations:
            rendered, images = split_images(list(conversation), image_token, MediaOptions())
            text = apply_chat_template(self.tokenizer, rendered, add_generation_prompt)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Sequence[Prompt | dict[str, Any]],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (a string, token ids, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": [...]}); every beam comes back, best first."""
        prompt_list = [_unwrap_prompt(p) for p in prompts]
        outputs = self.generate(prompt_list, params.to_sampling_params(), use_tqdm=use_tqdm)
        results = []
        for output in outputs:
            sequences = []
            for completion in output.outputs:
                tokens = output.prompt_token_ids + completion.token_ids
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                logprob = completion.cumulative_logprob or 0.0
                reason, stop = completion.finish_reason, completion.stop_reason
                sequences.append(BeamSearchSequence(tokens, text, logprob, reason, stop))
            results.append(BeamSearchOutput(sequences))
        return results

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm)
        try:
            with heap_frozen_while():  # the steps' collections scan only what they make
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            progress.update(1)
        except BaseException:  # incl. KeyboardInterrupt: the next generate() must work
            # A failed step already failed every request; an interrupt between steps
            # leaves them to fail here.
            if self.engine.has_unfinished_requests():
                self.engine.recover_from_failed_step()
            raise
        finally:
            progress.close()
        return [finished[request_id] for request_id in request_ids]


def _failure(message: str, param: str | None) -> Exception:
    """A request the engine failed: its own fault (a field named), else the engine's."""
    return InvalidRequestError(message, param=param) if param else RuntimeError(message)


def _unwrap_prompt(prompt: Prompt | dict[str, Any]) -> Prompt:
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    return str(prompt["prompt"])


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if prompts and isinstance(prompts, list) and isinstance(prompts[0], int):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _prompt_and_images(prompt: Prompt) -> tuple[str | list[int], list[Any]]:
    if not isinstance(prompt, dict):
        return prompt, []
    # {"prompt": text or ids} or vLLM's {"prompt_token_ids": ids}, + images
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(
            "a prompt dict has 'prompt' or 'prompt_token_ids', and 'multi_modal_data' "
            f"(got {sorted(prompt)})"
        )
    if "prompt_token_ids" in prompt:
        prompt = {**prompt, "prompt": list(prompt["prompt_token_ids"])}
    data = dict(prompt.get("multi_modal_data") or {})
    if set(data) - {"image"}:
        raise ValueError(f"multi_modal_data takes 'image' only (got {sorted(data)})")
    images = data.get("image", [])
    return prompt["prompt"], list(images) if isinstance(images, list | tuple) else [images]


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)


def _broadcast_loras(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    if len(lora) != count:
        raise ValueError(f"{len(lora)} LoRA requests for {count} prompts")
    return list(lora)
