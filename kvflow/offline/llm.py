"""The offline API: `LLM(model).generate(prompts, params)`, as vLLM users know it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvflow.config import EngineConfig
from kvflow.errors import ConfigError
from kvflow.heap import heap_frozen_while, keep_freed_memory
from kvflow.offline.engine import LLMEngine
from kvflow.outputs import RequestOutput
from kvflow.proto.lora import LoRARequest
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer import Conversation, apply_chat_template

Prompt = str | list[int]


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
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        loras = _broadcast_loras(lora_request, len(prompt_list))
        request_ids = []
        try:
            for prompt, params, lora in zip(prompt_list, params_list, loras):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params, lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations: list[Conversation]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        prompts: list[Prompt] = [
            apply_chat_template(self.tokenizer, c, add_generation_prompt) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

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


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts, list) and isinstance(prompts[0], int):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


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
