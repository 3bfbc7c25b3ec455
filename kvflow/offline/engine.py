"""The in-process engine: the served pipeline's cores, wired by direct calls.

    add_request ─▶ AddRequest per sample ─▶ EngineCore.add_request, DetokenizerStreams.add
    step: EngineCore.schedule ─▶ StepExecutor.submit ... result ─▶ EngineCore.update
          ─▶ DetokenizerStreams.process ─▶ stop-string aborts back to the core
                                        └▶ RequestOutputDelta ─▶ RequestOutputs

The same `EngineCore` runs in the scheduler process and the same `DetokenizerStreams`
in the detokenizer process, so the offline and served paths share every rule: only the
transport differs. With async scheduling the core plans step N+1 before step N's
result is applied, exactly as over ZeroMQ: results wait in a queue, in order. The
executor (gpu_worker/executor.py) is this process's ModelRunner or, with tensor/pipeline
parallelism, worker processes that take each plan as it is made and return results in
order, so P pipeline stages hold P micro-batches at once. A step that raises fails the
unfinished requests and leaves the engine ready for the next ones.
`kvflow.LLM` drives this; tests use it to check that served and offline outputs agree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.config import EngineConfig
from kvflow.errors import InvalidRequestError
from kvflow.image_inputs import Prompter, is_vision_model, make_image_prompter
from kvflow.lora_files import LoRAAdapterCheck
from kvflow.metrics.roofline import ModelShape, RooflineMeter, StepCost
from kvflow.model_limits import read_model_limits
from kvflow.offline.request_outputs import RequestOutputs
from kvflow.outputs import RequestOutput
from kvflow.pooling import engine_pooling
from kvflow.proto.engine import AddRequest, EngineOutputs, TokenDelta
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.lora import LoRARequest
from kvflow.proto.multimodal import ImageInput
from kvflow.proto.step import StepResult
from kvflow.sampling_params import (
    SamplingParams,
    child_request_ids,
    child_sampling_params,
    truncate_prompt,
    with_bad_words_token_ids,
)
from kvflow.services.detokenizer.streams import DetokenizerStreams
from kvflow.services.scheduler.assembly import EngineShape, build_engine_core
from kvflow.services.scheduler.engine_core import StepInFlight
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.services.scheduler.step_trace import StepSample, StepTrace
from kvflow.structured_outputs import check_grammar
from kvflow.tokenizer import load_eos_token_ids, load_tokenizer

if TYPE_CHECKING:
    from kvflow.gpu_worker.executor import StepExecutor
    from kvflow.gpu_worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

OFFLINE_FRONTEND = "offline"  # the detokenizer's routing id of every offline request


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from kvflow.gpu_worker.model_files import resolve_model_dir
        from kvflow.services.launch.worker_group import check_model_split, check_parallelism

        check_parallelism(config)  # never run on one process what asked for more
        self.config = config
        self.model_dir: Path = resolve_model_dir(config.model.model)
        check_model_split(config.parallel, self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir, config.model.skip_tokenizer_init)
        self.eos_token_ids = load_eos_token_ids(self.model_dir, self.tokenizer)
        model_limits = read_model_limits(self.model_dir, config.model.max_model_len)
        self.max_model_len = model_limits.max_model_len
        self.executor = self._start_executor()
        self.vocab_size = self.executor.vocab_size
        self.pooling = engine_pooling(
            config.model.runner, self.model_dir, config.model.pooler_config
        )
        shape = EngineShape(
            self.vocab_size,
            self.max_model_len,
            self.executor.num_blocks,
            self.eos_token_ids,
            self.pooling,
            self.executor.kv_group_windows,
        )
        self.core = build_engine_core(config, shape, lambda: self.tokenizer)
        self.streams = DetokenizerStreams(self.tokenizer)
        self.outputs = RequestOutputs()
        self._prompter: Prompter | None = None  # a vision model's, on first use
        self.lora_adapters = LoRAAdapterCheck(config.lora, self.model_dir)
        self.trace: StepTrace | None = None  # start_trace()
        # Step time and estimated work per phase, for `kvflow bench`'s roofline report.
        self.roofline = RooflineMeter(
            ModelShape.try_from_model_dir(
                self.model_dir, config.model.dtype, config.model.quantization
            )
        )
        logger.info(
            "engine ready: %d KV blocks of %d tokens", shape.num_blocks, config.cache.block_size
        )

    def _start_executor(self) -> StepExecutor:
        if self.config.parallel.world_size > 1:  # one process per rank, driven over ZeroMQ
            from kvflow.services.launch.worker_group_runner import WorkerGroupRunner

            return WorkerGroupRunner(self.config, self.model_dir)
        from kvflow.gpu_worker.executor import InProcessExecutor
        from kvflow.gpu_worker.runner_factory import build_runner

        return InProcessExecutor(build_runner(self.config, self.model_dir).runner)

    @property
    def runner(self) -> ModelRunner:
        """This process's model runner (an engine of one rank)."""
        from kvflow.gpu_worker.executor import InProcessExecutor

        if not isinstance(self.executor, InProcessExecutor):
            raise AttributeError("a multi-rank engine runs its model in worker processes")
        return self.executor.runner

    def close(self) -> None:
        """Stop the worker processes of a multi-rank engine (a no-op in process)."""
        self.stop_trace()
        self.executor.close()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.core.scheduler.kv_cache

    # ---- requests ----------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        images: Sequence[Any] = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Admit a request (one engine request per sample when n > 1); raises
        InvalidRequestError with the engine's reason when it cannot run. `images`: PIL
        images, one per image token of the prompt (kvflow/image_inputs.py)."""
        if lora_request is not None:  # a bad adapter fails here, not in a step
            self.lora_adapters.check(lora_request)
        prompt_text = prompt if isinstance(prompt, str) else None
        prompt_ids = list(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        image_inputs: list[ImageInput] = []
        mrope = None
        if images:
            prompt_ids, image_inputs, mrope = self._image_prompter().expand(
                prompt_ids, list(images)
            )
        prompt_ids = truncate_prompt(prompt_ids, params, self.max_model_len)
        params = with_bad_words_token_ids(params, self.tokenizer)
        if params.structured_outputs is not None:  # a bad grammar fails here, not later
            check_grammar(params.structured_outputs)
        now = time.time()
        child_ids = child_request_ids(request_id, params.n)
        self.outputs.add(request_id, prompt_text, prompt_ids, child_ids)
        try:
            for index, child_id in enumerate(child_ids):
                message = AddRequest(
                    child_id,
                    prompt_ids,
                    child_sampling_params(params, index),
                    arrival_time=now,
                    priority=priority,
                    cache_salt=cache_salt,
                    frontend_id=OFFLINE_FRONTEND,
                    images=image_inputs,
                    lora_request=lora_request,
                    mrope=mrope,
                )
                self.core.add_request(message, now=now)
                self.streams.add(message)
        except Exception:
            self.abort_request(request_id)
            raise

    def image_token(self) -> str | None:
        """The prompt's image token; None for a model that takes text only."""
        return self._image_prompter().image_token if is_vision_model(self.model_dir) else None

    def _image_prompter(self) -> Prompter:
        if self._prompter is None:
            if not is_vision_model(self.model_dir):
                raise InvalidRequestError("this model takes text only, not images")
            self._prompter = make_image_prompter(self.model_dir)
        return self._prompter

    def abort_request(self, request_id: str) -> None:
        child_ids = self.outputs.remove(request_id)
        self.core.abort_requests(child_ids)
        self.streams.forget(child_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or results of steps still to apply."""
        return self.outputs.has_unfinished() or bool(self.core.in_flight)

    # ---- stepping ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan while the core has room, then apply the oldest result; returns the
        requests that changed (finished ones last). If the step raises, every
        unfinished request is failed first (`recover_from_failed_step`): the engine
        stays usable."""
        return self.outputs.apply(self._guarded_step())

    def step_deltas(self) -> list[RequestOutputDelta]:
        """As `step`, but returns the detokenizer's deltas by sample ("<id>#<index>"
        when n > 1): what a served frontend receives (`kvflow run-batch` uses it)."""
        deltas = self._guarded_step()
        self.outputs.apply(deltas)
        return deltas

    def _guarded_step(self) -> list[RequestOutputDelta]:
        try:
            return self._step()
        except BaseException:  # incl. KeyboardInterrupt
            self.recover_from_failed_step()
            raise

    def _step(self) -> list[RequestOutputDelta]:
        failed = self.core.poll_grammars(now=time.time())  # guided requests compiled, or not
        while self.core.can_schedule():
            plan = self.core.schedule(now=time.time())
            if plan is None:
                break
            self.executor.submit(plan)
        if not self.executor.num_in_flight:
            if self.core.waiting_for_grammar and not failed:
                time.sleep(0.001)  # only compiles under way: do not spin on the GIL
            return self._detokenize(failed)
        result = self.executor.result()
        step, deltas = self.core.update(result, now=time.time())
        if step.batch.num_tokens:
            cost = self.roofline.record(step.batch, result.execute_time_s)
            if self.trace is not None:
                self._trace_step(step, result, cost)
        return self._detokenize(failed + deltas)

    def start_trace(self, path: str | Path) -> None:
        """Write the steps from here on as a Chrome/Perfetto trace (step_trace.py);
        with pipeline stages, a track per stage. `stop_trace()` closes the file."""
        self.stop_trace()
        self.trace = StepTrace(path, "kvflow offline engine")

    def stop_trace(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def _trace_step(self, step: StepInFlight, result: StepResult, cost: StepCost) -> None:
        # The step's span: its stages' spans where there are stages, else its execution.
        spans = result.stage_spans
        end = max((e for _, _, e in spans), default=time.time())
        start = min((s for _, s, _ in spans), default=end - result.execute_time_s)
        assert self.trace is not None
        sample = StepSample.of_step(
            self.scheduler, step.plan.step_id, step.batch, cost, (start, end - start), spans,
            result.encoder_tokens,
        )  # fmt: skip
        self.trace.record_step(sample)

    def recover_from_failed_step(self) -> None:
        """A step raised (a bug, an interrupt): the results of the steps in flight will
        never be applied. Drop them and the runner's batch, and fail every unfinished
        request (the caller sees the exception), so the next requests start clean."""
        self.core.drop_worker_state()
        for request_id in self.outputs.request_ids():
            child_ids = self.outputs.remove(request_id)
            self.core.abort_requests(child_ids, finish_reason="error")
            self.streams.forget(child_ids)
        self.executor.drop_all_requests()  # last: a dead worker group raises here

    def _detokenize(self, deltas: list[TokenDelta]) -> list[RequestOutputDelta]:
        if not deltas:
            return []
        routed = self.streams.process(EngineOutputs(deltas, time.time()))
        for abort in routed.aborts:  # stop strings: the core stops those requests
            self.core.abort_requests(abort.req_ids, abort.finish_reason)
        return routed.by_frontend.get(OFFLINE_FRONTEND, [])
