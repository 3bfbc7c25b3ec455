"""The in-process engine: the same sans-IO cores the served processes run, wired by
direct calls instead of sockets (scheduler -> model runner -> scheduler -> detokenizer).

`kvflow.LLM` drives it; tests use it to check that served and offline outputs agree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.config import EngineConfig
from kvflow.errors import InvalidRequestError
from kvflow.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from kvflow.proto.engine import TokenDelta
from kvflow.proto.step import TokenLogprobs
from kvflow.roofline import ModelShape, RooflineMeter, StepBatch
from kvflow.sampling_params import SamplingParams, child_request_ids, child_sampling_params
from kvflow.services.detokenizer.incremental import IncrementalDetokenizer
from kvflow.services.scheduler.admission import EngineLimits, check_lengths
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.tokenizer import load_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    """One of the n samples of a request (a scheduler request of its own)."""

    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class _Parent:
    output: RequestOutput
    params: SamplingParams
    num_unfinished: int
    children: list[str] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from kvflow.gpu_worker.model_files import resolve_model_dir
        from kvflow.gpu_worker.model_runner import ModelRunner, RunnerConfig

        self.config = config
        self.model_dir: Path = resolve_model_dir(config.model.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = load_eos_token_ids(self.model_dir, self.tokenizer)
        self.runner = ModelRunner(
            RunnerConfig(
                model_dir=self.model_dir,
                model=config.model,
                cache=config.cache,
                device=config.device,
                eos_token_ids=self.eos_token_ids,
            )
        )
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = resolve_max_model_len(
            self.runner.hf_config, config.model.max_model_len
        )
        num_blocks = self.runner.determine_num_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs(config.scheduler.max_num_seqs, self.max_model_len)
        self.kv_cache = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self.limits = EngineLimits(
            self.vocab_size,
            self.max_model_len,
            config.cache.block_size,
            num_blocks,
            self.eos_token_ids,
        )
        self._samples: dict[str, _Sample] = {}
        self._parents: dict[str, _Parent] = {}
        # Step time and estimated work per phase, for `kvflow bench`'s roofline report.
        self.roofline = RooflineMeter(
            ModelShape.try_from_model_dir(self.model_dir, config.model.dtype)
        )
        logger.info("engine ready: %d KV blocks of %d tokens", num_blocks, config.cache.block_size)

    # ---- requests ----------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        params.validate(self.vocab_size)
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            prompt_text, prompt_ids = None, list(prompt)
        max_tokens = check_lengths(prompt_ids, params, self.limits)
        output = RequestOutput(request_id, prompt_text, prompt_ids, outputs=[])
        parent = _Parent(output, params, num_unfinished=params.n)
        self._parents[request_id] = parent
        now = time.monotonic()
        for index, child_id in enumerate(child_request_ids(request_id, params.n)):
            child_params = child_sampling_params(params, index)
            completion = CompletionOutput(index, "", [])
            output.outputs.append(completion)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, child_params)
            self._samples[child_id] = _Sample(request_id, index, detok, completion)
            parent.children.append(child_id)
            self.scheduler.add_request(
                Request(
                    child_id,
                    prompt_ids,
                    child_params,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=now,
                    priority=priority,
                    cache_salt=cache_salt,
                    max_tokens=max_tokens,
                )
            )

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        self.scheduler.finish_requests(parent.children, RequestStatus.FINISHED_ABORTED)
        for child_id in parent.children:
            self._samples.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- stepping ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that changed (finished ones last)."""
        plan = self.scheduler.schedule(now=time.monotonic())
        if not plan.scheduled_req_ids:
            if plan.finished_req_ids:
                self.runner.execute(plan)  # let the worker drop finished requests
            return []
        batch = StepBatch.from_plan(plan, self.scheduler.requests)
        start = time.perf_counter()
        result = self.runner.execute(plan)
        self.roofline.record(batch, time.perf_counter() - start)
        deltas = self.scheduler.update_from_output(plan, result, now=time.monotonic())
        changed: dict[str, RequestOutput] = {}
        for delta in deltas:
            parent_output = self._apply_delta(delta)
            if parent_output is not None:
                changed[parent_output.request_id] = parent_output
        return list(changed.values())

    def _apply_delta(self, delta: TokenDelta) -> RequestOutput | None:
        sample = self._samples.get(delta.req_id)
        if sample is None:
            return None
        parent = self._parents[sample.parent_id]
        completion = sample.output
        completion.token_ids.extend(delta.new_token_ids)
        if delta.logprobs:
            completion.logprobs = (completion.logprobs or []) + self._logprob_dicts(delta.logprobs)
        if delta.prompt_logprobs and parent.output.prompt_logprobs is None:
            parent.output.prompt_logprobs = self._prompt_logprob_dicts(delta.prompt_logprobs)
        parent.output.num_cached_tokens = delta.num_cached_tokens
        # The scheduler finishes with "stop" only on an EOS or stop token id.
        stop_terminated = delta.finish_reason == "stop"
        update = sample.detokenizer.update(delta.new_token_ids, stop_terminated)
        completion.text = sample.detokenizer.output_text
        if update.stop_reason is not None and delta.finish_reason is None:
            # A stop string: the scheduler does not see text, so stop it from here.
            self.scheduler.finish_requests([delta.req_id], RequestStatus.FINISHED_STOPPED)
            completion.finish_reason, completion.stop_reason = "stop", update.stop_reason
        elif delta.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = (
                delta.finish_reason,
                delta.stop_reason,
            )
            sample.detokenizer.flush()
            completion.text = sample.detokenizer.output_text
        if completion.finish_reason is not None:
            self._finish_sample(delta.req_id, parent)
        return parent.output

    def _finish_sample(self, req_id: str, parent: _Parent) -> None:
        self._samples.pop(req_id, None)
        parent.num_unfinished -= 1
        if parent.num_unfinished == 0:
            parent.output.finished = True
            self._parents.pop(parent.output.request_id, None)

    def _logprob_dicts(self, entries: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        return [_logprob_dict(entry, self.tokenizer) for entry in entries]

    def _prompt_logprob_dicts(self, entries: list[TokenLogprobs]) -> PromptLogprobs:
        return [None, *self._logprob_dicts(entries)]


def _logprob_dict(entry: TokenLogprobs, tokenizer: Any) -> dict[int, Logprob]:
    result: dict[int, Logprob] = {}
    for position, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
        rank = entry.rank if position == 0 else position
        if token_id not in result:
            result[token_id] = Logprob(logprob, rank, tokenizer.decode([token_id]))
    return result


def resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    if requested is None:
        return model_max
    if requested > model_max:
        raise InvalidRequestError(
            f"max_model_len {requested} exceeds the model's context {model_max}"
        )
    return requested
