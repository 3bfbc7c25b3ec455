"""The model runner: a sans-IO core that turns a `StepPlan` into a `StepResult`.

It owns the weights, the KV cache tensors and the persistent batch. The worker
process shell (and the offline engine) only feed it plans.

As a pipeline stage (built inside `pipeline_parallel`) it holds its stage's layers and
their KV cache, and its forward starts from the previous stage's activations and ends
by handing them on (stage_link.py); only the last stage samples and returns tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvflow.config import CacheConfig, DeviceConfig, ModelConfig
from kvflow.errors import ConfigError
from kvflow.gpu_worker.attn_metadata import forward_context
from kvflow.gpu_worker.cpu_graphs import CpuDecodeGraphs, make_cpu_decode_graphs
from kvflow.gpu_worker.denormals import flush_denormals_on_cpu
from kvflow.gpu_worker.drafter import Drafter, make_drafter
from kvflow.gpu_worker.grammar_bitmask import apply_grammar_bitmask
from kvflow.gpu_worker.input_batch import BatchLimits, InputBatch, ModelInputs
from kvflow.gpu_worker.kv_cache import KVCacheSpec, allocate_kv_cache, kv_storage_dtype
from kvflow.gpu_worker.model_loader import load_hf_config, load_model
from kvflow.gpu_worker.parallel_state import get_pp_group
from kvflow.gpu_worker.rejection_sampler import DraftBatch, RejectionSampler
from kvflow.gpu_worker.sampler import LogprobsTensors, Sampler, compute_prompt_logprobs
from kvflow.gpu_worker.spec_metadata import verification_metadata
from kvflow.gpu_worker.stage_link import StageLink
from kvflow.kernels.cpu.native_build import load_all as load_native_kernels
from kvflow.kv_transfer.worker.connector import KVConnectorWorker, make_connector_worker
from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.proto.step import StepPlan, StepResult, TokenLogprobs
from kvflow.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # imports Triton: only loaded where graphs are captured
    from kvflow.gpu_worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

# An empty step (requests only waiting for KV pulls) waits this long for one to end,
# so that the scheduler's polling for them does not spin a core.
_IDLE_LOAD_WAIT_S = 0.005
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: Path
    model: ModelConfig
    cache: CacheConfig
    device: DeviceConfig
    eos_token_ids: frozenset[int]
    max_num_seqs: int  # slots of the persistent batch
    max_model_len: int  # tokens per slot
    # Disaggregated prefill/decode: the KV connector and its layout namespace.
    kv_transfer: KVTransferConfig | None = None
    kv_namespace: str = ""
    kv_load_timeout: float = 30.0
    speculative: SpeculativeConfig | None = None  # a draft model runs here (draft_model)


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        if self.device.type == "cpu":
            if config.device.num_threads is not None:
                torch.set_num_threads(config.device.num_threads)
            load_native_kernels()  # compiled on the first start, not in the first step
        self.dtype = _DTYPES[config.model.dtype]
        self.hf_config = load_hf_config(config.model_dir)
        self.model = load_model(
            config.model_dir,
            self.dtype,
            self.device,
            config.device.attention_backend,
            config.model.quantization,
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        kv_dtype = kv_storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        spec = KVCacheSpec.from_hf_config(self.hf_config, config.cache.block_size, kv_dtype)
        # This rank's KV heads (a shard, or one replica when heads are fewer than ranks),
        # of this pipeline stage's layers.
        layers = self.model.attention_layers()
        self.kv_spec = dataclasses.replace(
            spec, num_kv_heads=layers[0].num_kv_heads, num_layers=len(layers)
        )
        stage = get_pp_group()
        self.stage_link: StageLink | None = None
        if stage.size > 1:
            hidden_size = int(self.hf_config.hidden_size)
            self.stage_link = StageLink(stage, hidden_size, self.dtype, self.device)
        limits = BatchLimits(config.max_num_seqs, config.max_model_len, config.cache.block_size)
        self.batch = InputBatch(limits, self.vocab_size, set(config.eos_token_ids), self.device)
        # Unseeded requests share one generator, seeded from the engine's seed.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.model.seed))
        # Verifies draft tokens; shares the unseeded requests' generator.
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self.num_blocks = 0
        self.kv_connector: KVConnectorWorker | None = None
        self.decode_graphs: DecodeGraphs | CpuDecodeGraphs | None = None
        # The draft model of `draft_model` speculation: its KV cache has our block ids.
        self.drafter: Drafter | None = make_drafter(
            config.speculative,
            config.device,
            config.cache.block_size,
            self.dtype,
            kv_dtype,
            self.vocab_size,
            config.model.seed,
        )

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the configured memory (GiB on CPU, a fraction on CUDA)."""
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type == "cuda":
            models = [self.model] + ([self.drafter.model] if self.drafter else [])
            budget = _cuda_kv_budget(self.device, cache.gpu_memory_utilization, models)
            option = "--gpu-memory-utilization"
        else:
            budget = cache.kv_cache_memory * (1 << 30)
            option = "--kv-cache-memory"
        bytes_per_block = self.kv_spec.bytes_per_block
        if self.drafter is not None:  # one block id holds the target's and the draft's K/V
            bytes_per_block += self.drafter.kv_spec.bytes_per_block
        num_blocks = int(budget // bytes_per_block)
        if num_blocks < 1:
            raise ConfigError(f"KV cache memory too small for one block; raise {option}")
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        for layer, cache in zip(self.model.attention_layers(), caches):
            layer.kv_cache = cache
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)
        spec = self.kv_spec
        logger.info(
            "KV cache: %d blocks of %d tokens, %s, %.2f GiB",
            num_blocks, spec.block_size, str(spec.dtype).removeprefix("torch."),
            num_blocks * spec.bytes_per_block / (1 << 30),
        )  # fmt: skip
        self.num_blocks = num_blocks
        config = self.config
        self.kv_connector = make_connector_worker(
            config.kv_transfer, config.kv_namespace, caches, config.kv_load_timeout
        )

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> float:
        """Set up decode graphs after the KV caches are bound; returns the seconds the
        capture took. CUDA: every size captured now, the model's and the draft model's
        (cuda_graphs.py; the Triton backend only). CPU: each size is recorded by the
        first decode step of that size (cpu_graphs.py). None with `enforce_eager`."""
        if self.config.device.enforce_eager:
            return 0.0
        if self.device.type == "cpu":  # one rank: gpu_worker/main.py makes ranks eager
            block_size = self.config.cache.block_size
            self.decode_graphs = make_cpu_decode_graphs(
                self.model, max_num_seqs, max_model_len, block_size
            )
            return 0.0
        return self._capture_cuda_graphs(max_num_seqs, max_model_len)

    def _capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> float:
        # Imported here: CPU images ship without Triton.
        from kvflow.gpu_worker.cuda_graphs import capture_decode_graphs, capture_sizes

        start = time.perf_counter()
        sizes = capture_sizes(max_num_seqs)
        block_size = self.config.cache.block_size
        self.decode_graphs = capture_decode_graphs(
            self.model, sizes, max_model_len, block_size, self.device
        )
        if self.decode_graphs is None:
            return 0.0
        if self.drafter is not None:
            self.drafter.graphs = capture_decode_graphs(
                self.drafter.model, sizes, max_model_len, block_size, self.device
            )
        took = time.perf_counter() - start
        drafts = " (and the draft model's)" if self.drafter is not None else ""
        logger.info("captured %d decode CUDA graphs%s in %.1f s", len(sizes), drafts, took)
        return took

    def drop_all_requests(self) -> None:
        """Forget every request: a new scheduler knows none of them (its KV cache
        manager starts empty, so the cached K/V is simply overwritten)."""
        self.batch.clear()
        if self.drafter is not None:
            self.drafter.clear()

    @torch.inference_mode()
    @flush_denormals_on_cpu
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        if self.stage_link is not None and plan.scheduled_req_ids:
            self.stage_link.begin(plan.total_num_scheduled_tokens)  # the input lands meanwhile
        self.batch.apply_plan(plan)
        connector = self.kv_connector
        if connector is not None and plan.kv_connector is not None:
            connector.start_load_kv(plan.kv_connector)
        if not plan.scheduled_req_ids:
            result = StepResult(step_id=plan.step_id, req_ids=[], sampled_token_ids=[])
            if connector is not None:  # a step that only waits for background loads
                connector.wait_for_loads(_IDLE_LOAD_WAIT_S)
                result.kv_transfer = connector.take_stats()
            return result
        draft_probs = self._draft(plan)
        inputs = self.batch.prepare_inputs(plan)
        graphs = self.decode_graphs
        after_layer = None  # a producer's saves: copied out layer by layer, during the forward
        if connector is not None and plan.kv_connector is not None:
            after_layer = connector.start_save_kv(plan.kv_connector)
        with forward_context(inputs.metadata, after_layer):
            if self.stage_link is not None:
                hidden = self._stage_forward(inputs)
                if hidden is None:  # handed on to the next stage
                    return StepResult(step_id=plan.step_id, req_ids=[], sampled_token_ids=[])
                hidden = hidden[inputs.metadata.logits_indices]
            elif graphs is not None and after_layer is None and graphs.can_run(inputs.metadata):
                # [num_reqs, hidden], one token each
                hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
                hidden = hidden[inputs.metadata.logits_indices]
            else:  # [num_logits, hidden]: the last layer runs its MLP for these rows only
                rows = inputs.metadata.logits_indices
                hidden = self.model(inputs.input_ids, inputs.positions, output_rows=rows)
            logits = self.model.compute_logits(hidden)
        num_sampled = inputs.num_sample_rows
        if plan.grammar_bitmask is not None:  # guided requests never carry drafts
            row_req_ids = inputs.sample_row_req_ids()
            apply_grammar_bitmask(logits[:num_sampled], row_req_ids, plan.grammar_bitmask)
        if inputs.sample_num_drafts.any():
            result = self._verify(inputs, logits[:num_sampled], draft_probs)
        else:
            result = self._sample(inputs, logits[:num_sampled])
        self._add_prompt_logprobs(inputs, logits[num_sampled:], result)
        if connector is not None:
            if plan.kv_connector is not None:
                connector.wait_for_save(plan.kv_connector)
            result.kv_transfer = connector.take_stats()
        result.step_id = plan.step_id
        result.execute_time_s = time.perf_counter() - start
        if self.stage_link is not None:
            result.stage_spans = self.stage_link.spans().tolist()
        return result

    def _stage_forward(self, inputs: ModelInputs) -> torch.Tensor | None:
        """This pipeline stage's part of the forward: the last stage's normed hidden
        [T, hidden], or None once the activations are on their way to the next stage."""
        link = self.stage_link
        assert link is not None
        out = self.model(inputs.input_ids, inputs.positions, link.activations())
        if link.group.is_last:
            return out  # type: ignore[no-any-return]
        link.send(out)
        return None

    def _sample(self, inputs: ModelInputs, logits: torch.Tensor) -> StepResult:
        """Sample the rows of `logits` [Rs, V] fp32 (one per sampled request); a step
        that edits the logits before sampling (a grammar bitmask) goes before `sampler`."""
        req_ids = inputs.sample_req_ids
        if not req_ids:
            return StepResult(step_id=0, req_ids=[], sampled_token_ids=[])
        metadata = self.batch.sampling_metadata(inputs)
        output = self.sampler(logits, metadata)
        self.batch.append_sampled(inputs.sample_slots, output.sampled_token_ids, metadata)
        logprobs: list[list[TokenLogprobs]] = []
        if output.logprobs is not None:
            logprobs = self._token_logprobs(output.logprobs, inputs.sample_slots.tolist())
        return StepResult(
            step_id=0,
            req_ids=req_ids,
            sampled_token_ids=[[t] for t in output.sampled_token_ids.tolist()],
            logprobs=logprobs,
        )

    def _draft(self, plan: StepPlan) -> dict[int, torch.Tensor] | None:
        """The draft model's turn (draft_model speculation): forget what the plan
        forgets, fill in the plan's draft placeholders; slot -> q [k, V]."""
        if self.drafter is None:
            return None
        self.drafter.forget(plan.finished_req_ids)
        self.drafter.forget([new.req_id for new in plan.new_requests])  # resumed: from 0
        if not plan.spec_token_ids:
            return {}
        return self.drafter.propose(self.batch, list(plan.spec_token_ids))

    def _verify(
        self,
        inputs: ModelInputs,
        logits: torch.Tensor,
        draft_probs: dict[int, torch.Tensor] | None,
    ) -> StepResult:
        """A step with draft tokens: `logits` [sum(k_r + 1), V], each sampled request's
        k_r + 1 positions in order (k_r = 0 for a plain decode in the same batch).
        `draft_probs`: the draft model's q per slot (None: one-hot drafts)."""
        slots = inputs.sample_slots
        drafts = [self.batch.draft_token_ids(slot) for slot in slots.tolist()]
        verification = verification_metadata(self.batch.sampling, self.batch.rows, slots, drafts)
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=self.device)
        q = None
        if draft_probs and not verification.metadata.all_greedy:  # greedy: q is not needed
            q = torch.cat([draft_probs[s] for s, d in zip(slots.tolist(), drafts) if d])
        batch = DraftBatch([len(d) for d in drafts], flat, q)
        output = self.rejection_sampler(
            logits, verification.metadata, batch, verification.requests.generators
        )
        self.batch.append_accepted(slots, output.token_ids)
        if self.drafter is not None:
            self.drafter.on_verified(inputs.sample_req_ids, output.num_accepted)
        logprobs: list[list[TokenLogprobs]] = []
        if output.logprobs is not None:
            rows = [int(s) for s, ts in zip(slots.tolist(), output.token_ids) for _ in ts]
            flat_entries = self._token_logprobs(output.logprobs, rows)
            start = 0
            for tokens in output.token_ids:
                entries = flat_entries[start : start + len(tokens)]
                logprobs.append([e for entry in entries for e in entry])
                start += len(tokens)
        return StepResult(
            step_id=0,
            req_ids=inputs.sample_req_ids,
            sampled_token_ids=output.token_ids,
            logprobs=logprobs,
        )

    def _token_logprobs(
        self, tensors: LogprobsTensors, slots: list[int]
    ) -> list[list[TokenLogprobs]]:
        """Per sampled row: [] if that request asked for no logprobs, else its own top-N."""
        token_ids = tensors.token_ids.tolist()
        logprobs = tensors.logprobs.tolist()
        ranks = tensors.ranks.tolist()
        entries: list[list[TokenLogprobs]] = []
        for i, slot in enumerate(slots):
            num = int(self.batch.sampling.num_logprobs[slot])
            if num < 0:
                entries.append([])
                continue
            k = num + 1
            entries.append([TokenLogprobs(token_ids[i][:k], logprobs[i][:k], int(ranks[i]))])
        return entries

    def _add_prompt_logprobs(
        self, inputs: ModelInputs, logits: torch.Tensor, result: StepResult
    ) -> None:
        row = 0
        for prompt_range in inputs.prompt_ranges:
            params = self.batch.sampling.params[prompt_range.slot]
            assert params is not None
            k = params.prompt_logprobs or 0
            num_rows = prompt_range.end - prompt_range.start
            next_ids = self.batch.prompt_token_ids(
                prompt_range.slot, prompt_range.start + 1, prompt_range.end + 1
            )
            tensors = compute_prompt_logprobs(logits[row : row + num_rows], next_ids, k)
            result.prompt_logprobs[prompt_range.req_id] = _rows_to_token_logprobs(
                tensors, num_rows, k
            )
            result.prompt_logprobs_start[prompt_range.req_id] = prompt_range.start
            row += num_rows


def _rows_to_token_logprobs(tensors: LogprobsTensors, num_rows: int, k: int) -> list[TokenLogprobs]:
    token_ids = tensors.token_ids.tolist()
    logprobs = tensors.logprobs.tolist()
    ranks = tensors.ranks.tolist()
    return [
        TokenLogprobs(token_ids[i][: k + 1], logprobs[i][: k + 1], int(ranks[i]))
        for i in range(num_rows)
    ]


def _cuda_kv_budget(
    device: torch.device, utilization: float, models: list[torch.nn.Module]
) -> float:
    """Bytes for this engine's KV cache: `utilization` of the device is its share for
    weights (the model's, and a draft model's) + KV (so engines can share a device, as vLLM's instances do), within what is
    free less a reserve for the step's activations."""
    # An engine dropped earlier in this process (an LLM in a script or a test) may still
    # hold its cache until the garbage collector runs; its memory counts as free here.
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    return min(utilization * total - weights, free - _CUDA_ACTIVATION_RESERVE)


_CUDA_ACTIVATION_RESERVE = 1 << 30  # a 2048-token step of a 1B-class model needs well under 1 GiB
