"""The in-process engine: the served pipeline's cores, wired by direct calls.

    add_request ─▶ AddRequest per sample ─▶ EngineCore.add_request, DetokenizerStreams.add
    step: EngineCore.schedule ─▶ ModelRunner.execute ─▶ EngineCore.update
          ─▶ DetokenizerStreams.process ─▶ stop-string aborts back to the core
                                        └▶ RequestOutputDelta ─▶ RequestOutputs

The same `EngineCore` runs in the scheduler process and the same `DetokenizerStreams`
in the detokenizer process, so the offline and served paths share every rule: only the
transport differs. With async scheduling the core plans step N+1 before step N's
result is applied, exactly as over ZeroMQ: results wait in a queue, in order. Worker
processes (tensor/pipeline parallelism) take each plan as it is made (`submit`) and
return results in order, so P pipeline stages hold P micro-batches at once.
`kvflow.LLM` drives this; tests use it to check that served and offline outputs agree.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from kvflow.config import EngineConfig
from kvflow.kv_transfer.scheduler.connector import make_connector_scheduler
from kvflow.kv_transfer_config import engine_kv_namespace
from kvflow.metrics.roofline import ModelShape, RooflineMeter, StepCost
from kvflow.model_limits import read_model_limits
from kvflow.offline.request_outputs import RequestOutputs
from kvflow.outputs import RequestOutput
from kvflow.proto.engine import AddRequest, EngineOutputs, TokenDelta
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.step import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams, child_request_ids, child_sampling_params
from kvflow.services.detokenizer.streams import DetokenizerStreams
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore, StepInFlight
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.grammar_compiler import grammar_compiler
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.services.scheduler.spec_decode.speculator import make_speculator
from kvflow.services.scheduler.step_trace import StepSample, StepTrace
from kvflow.structured_outputs import check_grammar
from kvflow.tokenizer import load_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

OFFLINE_FRONTEND = "offline"  # the detokenizer's routing id of every offline request


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from kvflow.gpu_worker.model_files import resolve_model_dir
        from kvflow.services.launch.worker_group import check_layer_partition, check_parallelism

        check_parallelism(config)  # never run on one process what asked for more
        self.config = config
        self.model_dir: Path = resolve_model_dir(config.model.model)
        check_layer_partition(config.parallel, self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = load_eos_token_ids(self.model_dir, self.tokenizer)
        model_limits = read_model_limits(self.model_dir, config.model.max_model_len)
        self.max_model_len = model_limits.max_model_len
        self.runner = self._start_runner()
        self.vocab_size = self.runner.vocab_size
        num_blocks = self.runner.num_blocks
        kv_cache = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        limits = EngineLimits(
            self.vocab_size,
            self.max_model_len,
            config.cache.block_size,
            num_blocks,
            self.eos_token_ids,
        )
        self.core = EngineCore(
            Scheduler(
                config.scheduler,
                kv_cache,
                self.max_model_len,
                self.vocab_size,
                make_step_features(
                    config.scheduler,
                    kv_cache,
                    self.max_model_len,
                    speculator=make_speculator(config.speculative.speculative_config),
                    kv_connector=make_connector_scheduler(
                        config.kv_transfer.kv_transfer_config,
                        config.cache.block_size,
                        engine_kv_namespace(config),
                        config.kv_transfer.kv_load_failure_policy,
                    ),
                    pipeline_depth=config.parallel.pipeline_parallel_size,
                ),
            ),
            limits,
            config.max_steps_in_flight,
            grammar_compiler(limits, lambda: self.tokenizer),
            config.scheduler.grammar_compile_timeout,
        )
        self.streams = DetokenizerStreams(self.tokenizer)
        self.outputs = RequestOutputs()
        self._results: deque[StepResult] = deque()  # executed, not yet applied
        self.trace: StepTrace | None = None  # start_trace()
        # Step time and estimated work per phase, for `kvflow bench`'s roofline report.
        self.roofline = RooflineMeter(
            ModelShape.try_from_model_dir(self.model_dir, config.model.dtype)
        )
        logger.info("engine ready: %d KV blocks of %d tokens", num_blocks, config.cache.block_size)

    def _start_runner(self) -> Any:
        config = self.config
        if config.parallel.world_size > 1:  # one process per rank, driven over ZeroMQ
            from kvflow.services.launch.worker_group_runner import WorkerGroupRunner

            return WorkerGroupRunner(config, self.model_dir)
        from kvflow.gpu_worker.model_runner import ModelRunner, RunnerConfig

        runner = ModelRunner(
            RunnerConfig(
                model_dir=self.model_dir,
                model=config.model,
                cache=config.cache,
                device=config.device,
                eos_token_ids=self.eos_token_ids,
                max_num_seqs=config.scheduler.max_num_seqs,
                max_model_len=self.max_model_len,
                kv_transfer=config.kv_transfer.kv_transfer_config,
                kv_namespace=engine_kv_namespace(config),
                kv_load_timeout=config.kv_transfer.kv_load_timeout,
                speculative=config.speculative.speculative_config,
            )
        )
        runner.initialize_kv_cache(runner.determine_num_blocks())
        runner.capture_decode_graphs(config.scheduler.max_num_seqs, self.max_model_len)
        return runner

    def close(self) -> None:
        """Stop the worker processes of a multi-rank engine (a no-op in process)."""
        self.stop_trace()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

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
    ) -> None:
        """Admit a request (one engine request per sample when n > 1); raises
        InvalidRequestError with the engine's reason when it cannot run."""
        prompt_text = prompt if isinstance(prompt, str) else None
        prompt_ids = list(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
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
                )
                self.core.add_request(message, now=now)
                self.streams.add(message)
        except Exception:
            self.abort_request(request_id)
            raise

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
        requests that changed (finished ones last)."""
        failed = self.core.poll_grammars(now=time.time())  # guided requests compiled, or not
        while self.core.can_schedule():
            plan = self.core.schedule(now=time.time())
            if plan is None:
                break
            self._run(plan)
        result = self._next_result()
        if result is None:
            if self.core.waiting_for_grammar and not failed:
                time.sleep(0.001)  # only compiles under way: do not spin on the GIL
            return self.outputs.apply(self._detokenize(failed))
        step, deltas = self.core.update(result, now=time.time())
        if step.batch.num_tokens:
            cost = self.roofline.record(step.batch, result.execute_time_s)
            if self.trace is not None:
                self._trace_step(step, result, cost)
        return self.outputs.apply(self._detokenize(failed + deltas))

    def _run(self, plan: StepPlan) -> None:
        """Worker processes: send the plan (its result comes later); in process: run it."""
        submit = getattr(self.runner, "submit", None)
        if submit is not None:
            submit(plan)
        else:
            self._results.append(self.runner.execute(plan))

    def _next_result(self) -> StepResult | None:
        """The oldest step's result (None when no step is in flight)."""
        if self._results:
            return self._results.popleft()
        if getattr(self.runner, "num_submitted", 0):
            return self.runner.result()  # type: ignore[no-any-return]
        return None

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
            self.scheduler, step.plan.step_id, step.batch, cost, (start, end - start), spans
        )
        self.trace.record_step(sample)

    def recover_from_failed_step(self) -> None:
        """A step raised (a bug, an interrupt): the results of the steps in flight will
        never be applied. Drop them and the runner's batch; every request goes back to
        waiting and recomputes from its tokens, so the engine can step again."""
        self._results.clear()
        self.core.drop_worker_state()
        self.runner.drop_all_requests()

    def _detokenize(self, deltas: list[TokenDelta]) -> list[RequestOutputDelta]:
        if not deltas:
            return []
        routed = self.streams.process(EngineOutputs(deltas, time.time()))
        for abort in routed.aborts:  # stop strings: the core stops those requests
            self.core.abort_requests(abort.req_ids, abort.finish_reason)
        return routed.by_frontend.get(OFFLINE_FRONTEND, [])
