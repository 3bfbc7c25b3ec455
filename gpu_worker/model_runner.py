"""The model runner: a sans-IO core that turns a `StepPlan` into a `StepResult`.

It owns the weights, the KV cache tensors and the persistent batch. The worker
process shell (and the offline engine) only feed it plans. A step::

    features.on_plan             (a pipeline stage posts its receive)
    batch.apply_plan
    features.before_forward      (KV loads, draft-model proposals)
    batch.prepare_inputs
    features.on_inputs           (M-RoPE positions that one row serves)
    forward_path                 eager, a decode graph, or a pipeline stage's part
    compute_logits               (or features.pool: the pooling runner's vectors, pooler.py)
    features.on_logits           (grammar bitmask)
    sample or verify             (sample_step.py)
    features.after_step          (prompt logprobs, KV saves and stats, stage spans)

The optional parts are `StepFeature`s (step_features.py), registered as the runner
is built; one that is not configured is not registered and costs nothing.

As a pipeline stage (built inside `pipeline_parallel`) it holds its stage's layers and
their KV cache, and its forward starts from the previous stage's activations and ends
by handing them on (stage_feature.py); only the last stage samples and returns tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvflow.config import CacheConfig, DeviceConfig, ModelConfig
from kvflow.errors import ConfigError
from kvflow.gpu_worker.attn_metadata import forward_context
from kvflow.gpu_worker.block_copy import BlockCopyFeature
from kvflow.gpu_worker.cpu_graphs import CpuDecodeGraphs, make_cpu_decode_graphs
from kvflow.gpu_worker.denormals import flush_denormals_on_cpu
from kvflow.gpu_worker.draft_feature import DraftModelFeature
from kvflow.gpu_worker.drafter import Drafter, make_drafter
from kvflow.gpu_worker.forward_paths import ForwardPath, GraphForward, eager_forward
from kvflow.gpu_worker.grammar_feature import GrammarFeature
from kvflow.gpu_worker.image_feature import ImageFeature, make_image_feature
from kvflow.gpu_worker.input_batch import BatchLimits, InputBatch, ModelInputs
from kvflow.gpu_worker.kv_cache import KVCacheSpec, allocate_kv_cache, kv_storage_dtype
from kvflow.gpu_worker.kv_layout import kv_layout_of, stage_slots
from kvflow.gpu_worker.lora.feature import LoraFeature
from kvflow.gpu_worker.lora.manager import LoraManager
from kvflow.gpu_worker.model_loader import load_hf_config, load_model, text_config_of
from kvflow.gpu_worker.mrope_feature import MRopeFeature, make_mrope_feature
from kvflow.gpu_worker.pooler import PoolingFeature
from kvflow.gpu_worker.prompt_logprobs import PromptLogprobsFeature
from kvflow.gpu_worker.sample_step import Verifier, sample_step
from kvflow.gpu_worker.sampler import Sampler
from kvflow.gpu_worker.stage_feature import PipelineStage, make_pipeline_stage
from kvflow.gpu_worker.step_features import StepFeature, StepFeatures
from kvflow.kernels.cpu.native_build import load_all as load_native_kernels
from kvflow.kv_transfer.worker.connector import KVConnectorWorker, make_connector_worker
from kvflow.kv_transfer.worker.runner_feature import KVConnectorFeature
from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.lora_config import LoRAConfig
from kvflow.pooling import engine_pooling
from kvflow.proto.step import StepPlan, StepResult
from kvflow.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # imports Triton: only loaded where graphs are captured
    from kvflow.gpu_worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

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
    lora: LoRAConfig | None = None  # --enable-lora: adapter slots on the projections


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        if self.device.type == "cpu":
            if config.device.num_threads is not None:
                torch.set_num_threads(config.device.num_threads)
            load_native_kernels()  # compiled on the first start, not in the first step
        self.dtype = _DTYPES[config.model.dtype]
        # A vision-language model's text config sizes the KV cache and the vocabulary.
        self.hf_config = text_config_of(load_hf_config(config.model_dir))
        self.model = load_model(
            config.model_dir,
            self.dtype,
            self.device,
            config.device.attention_backend,
            config.model.quantization,
            config.model.load_format,
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        kv_dtype = kv_storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        spec = KVCacheSpec.from_hf_config(self.hf_config, config.cache.block_size, kv_dtype)
        self.kv_layout, self._layer_ids = kv_layout_of(self.model, _hybrid_allowed(config))
        # This rank's KV heads (a shard, or one replica when heads are fewer than ranks),
        # in the cache tensors of this pipeline stage's layers (one per layer of a group).
        layers = self.model.attention_layers()
        self._slots = stage_slots(self.kv_layout, self._layer_ids)
        self.kv_spec = dataclasses.replace(
            spec, num_kv_heads=layers[0].num_kv_heads, num_layers=len(self._slots)
        )
        limits = BatchLimits(
            config.max_num_seqs,
            config.max_model_len,
            config.cache.block_size,
            self.kv_layout.num_groups,
        )
        self.batch = InputBatch(limits, self.vocab_size, set(config.eos_token_ids), self.device)
        # Unseeded requests share one generator, seeded from the engine's seed.
        generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self.verifier = Verifier(self.batch, generator)
        self.num_blocks = 0
        self.decode_graphs: DecodeGraphs | CpuDecodeGraphs | None = None
        self._build_features(kv_dtype)

    def _build_features(self, kv_dtype: torch.dtype) -> None:
        """The optional parts of a step, each a feature when configured."""
        config = self.config
        self.stage: PipelineStage | None = make_pipeline_stage(
            int(self.hf_config.hidden_size), self.dtype, self.device
        )
        self.forward_path: ForwardPath = eager_forward
        if self.stage is not None:
            self.forward_path = self.stage.forward
        # The draft model of `draft_model` speculation: its KV cache has our block ids.
        self.drafter: Drafter | None = make_drafter(
            config.speculative, config.device, config.cache.block_size,
            self.dtype, kv_dtype, self.vocab_size, config.model.seed, config.model.load_format,
        )  # fmt: skip
        draft = None if self.drafter is None else DraftModelFeature(self.drafter, self.batch)
        self.verifier.draft_model = draft
        self._draft = draft
        self._kv: KVConnectorFeature | None = None  # bound with the KV cache
        self._per_request = (
            GrammarFeature(),
            PromptLogprobsFeature(self.batch),
            BlockCopyFeature(self._kv_caches, self.device),  # beam search's forks
        )
        # The pooling runner (config.py keeps stages, drafts and KV transfer away).
        pooling = engine_pooling(config.model.runner, config.model_dir, config.model.pooler_config)
        self.pooler = None if pooling is None else PoolingFeature(pooling)
        if self.pooler is not None:
            self.forward_path = self.pooler.forward
        self.images: ImageFeature | None = make_image_feature(self.model, self.device)
        self.mrope: MRopeFeature | None = make_mrope_feature(self.model, self.device)
        self.lora: LoraFeature | None = None
        if config.lora is not None:
            manager = LoraManager(
                self.model, config.lora, config.model_dir, self.dtype, self.device
            )
            self.lora = LoraFeature(manager)
            self.forward_path = self.lora.forward_path(self.forward_path)
        self._register()

    def _register(self) -> None:
        # Hooks run in this order: prompt logprobs while a KV save's copies still run,
        # KV loads before the drafts, the stage's spans last.
        optional = (
            self.images, self.mrope, self.lora, *self._per_request, self._kv, self._draft, self.stage,
            self.pooler,
        )  # fmt: skip
        features: list[StepFeature] = [f for f in optional if f is not None]
        self.features = StepFeatures(features)

    def _kv_caches(self) -> list[torch.Tensor]:
        """Every KV cache tensor a block id indexes: the model's and the draft model's."""
        models = [self.model] + ([self.drafter.model] if self.drafter is not None else [])
        return [layer.kv_cache for model in models for layer in model.attention_layers()]

    @property
    def kv_connector(self) -> KVConnectorWorker | None:
        return None if self._kv is None else self._kv.connector

    @kv_connector.setter
    def kv_connector(self, connector: KVConnectorWorker | None) -> None:
        """Bind (or, None, drop) the KV connector; the kv-save bench switches it."""
        self._kv = None if connector is None else KVConnectorFeature(connector)
        self._register()

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
        layout = self.kv_layout
        for layer, index in zip(self.model.attention_layers(), self._layer_ids):
            layer.kv_cache = caches[self._slots[layout.layer_slots[index]]]
            layer.kv_group = layout.layer_groups[index]
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)
        spec = self.kv_spec
        logger.info(
            "KV cache: %d blocks of %d tokens, %s, %.2f GiB, %d group(s) of windows %s",
            num_blocks, spec.block_size, str(spec.dtype).removeprefix("torch."),
            num_blocks * spec.bytes_per_block / (1 << 30), layout.num_groups, layout.windows,
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
        if self.config.device.enforce_eager or self.pooler is not None:
            return 0.0  # (a pooling runner never decodes)
        num_groups = self.kv_layout.num_groups
        if self.device.type == "cpu":  # one rank: gpu_worker/main.py makes ranks eager
            block_size = self.config.cache.block_size
            spec = self.config.speculative  # its verification steps replay graphs too
            query_len = 1 + (spec.num_speculative_tokens if spec is not None else 0)
            self.decode_graphs = make_cpu_decode_graphs(
                self.model, max_num_seqs, max_model_len, block_size, num_groups, query_len
            )
            took = 0.0
        else:
            took = self._capture_cuda_graphs(max_num_seqs, max_model_len, num_groups)
        if self.decode_graphs is not None and self.stage is None:  # a stage runs its own
            self.forward_path = GraphForward(self.decode_graphs)
            if self.lora is not None:
                self.forward_path = self._lora_graphs(self.lora, self.decode_graphs)
        return took

    def _lora_graphs(
        self, lora: LoraFeature, graphs: CpuDecodeGraphs | DecodeGraphs
    ) -> ForwardPath:
        """CPU graphs record adapted decode forwards too (a tape per size and variant;
        the native LoRA kernel reads the step's slots from a fixed buffer); CUDA graphs
        hold the base model's forward only, so steps with adapters run eagerly there."""
        if not isinstance(graphs, CpuDecodeGraphs):
            return lora.forward_path(self.forward_path)
        lora.batch.reserve(graphs.static.input_ids.shape[0])  # verify steps: a row per query
        graphs.variant = lora.batch.graph_variant
        return lora.forward_path(self.forward_path, replay_lora=True)

    def _capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, num_groups: int) -> float:
        # Imported here: CPU images ship without Triton.
        from kvflow.gpu_worker.cuda_graphs import capture_decode_graphs, capture_sizes

        start = time.perf_counter()
        sizes = capture_sizes(max_num_seqs)
        block_size = self.config.cache.block_size
        self.decode_graphs = capture_decode_graphs(
            self.model, sizes, max_model_len, block_size, self.device, num_groups
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
        self.features.clear()

    @torch.inference_mode()
    @flush_denormals_on_cpu
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        features = self.features
        for on_plan in features.on_plan:
            on_plan(plan)
        self.batch.apply_plan(plan)
        for before_forward in features.before_forward:
            before_forward(plan)
        if not plan.scheduled_req_ids:
            return self._idle_step(plan)
        inputs = self.batch.prepare_inputs(plan)
        for on_inputs in features.on_inputs:
            on_inputs(plan, inputs)
        after_layer = features.layer_hook(plan)
        with forward_context(inputs.metadata, after_layer):
            hidden = self.forward_path(self.model, inputs, after_layer)
            if hidden is None:  # a pipeline stage handed its activations on
                return StepResult(step_id=plan.step_id, req_ids=[], sampled_token_ids=[])
            if features.pool:  # the pooling runner: vectors, no logits, nothing sampled
                result = features.pool[0](plan, inputs, hidden)
            else:
                result = self._sample(plan, inputs, self.model.compute_logits(hidden))
        result.step_id = plan.step_id
        result.execute_time_s = time.perf_counter() - start
        if self.images is not None:
            counts = self.images.take_counts()
            result.encoder_cache_queries, result.encoder_cache_hits, result.encoder_tokens = counts
        return result

    def _sample(self, plan: StepPlan, inputs: ModelInputs, logits: torch.Tensor) -> StepResult:
        """Sample (or verify drafts) from `logits` [num_logits, V] fp32."""
        features = self.features
        sampled = logits[: inputs.num_sample_rows]  # then the prompt-logprob rows
        for on_logits in features.on_logits:
            on_logits(plan, inputs, sampled)
        if inputs.sample_num_drafts.any():
            result = self.verifier(inputs, sampled)
        else:
            result = sample_step(self.sampler, self.batch, inputs, sampled)
        for after_step in features.after_step:
            after_step(plan, inputs, logits, result)
        return result

    def _idle_step(self, plan: StepPlan) -> StepResult:
        """Nothing scheduled: requests only wait (for KV loads, say)."""
        result = StepResult(step_id=plan.step_id, req_ids=[], sampled_token_ids=[])
        for on_idle in self.features.on_idle:
            on_idle(plan, result)
        return result


def _hybrid_allowed(config: RunnerConfig) -> bool:
    """A hybrid KV cache unless asked off, or a part that addresses every layer's KV by
    group 0's block ids is on: a draft model's cache, KV transfer (docs/design.md)."""
    draft = config.speculative is not None and config.speculative.method == "draft_model"
    return config.cache.hybrid_kv_cache and not draft and config.kv_transfer is None


def _cuda_kv_budget(
    device: torch.device, utilization: float, models: Sequence[torch.nn.Module]
) -> float:
    """Bytes for this engine's KV cache: `utilization` of the device is its share for
    weights (the model's, and a draft model's) + KV (so engines can share a device, as
    vLLM's instances do), within what is free less a reserve for the step's activations."""
    # An engine dropped earlier in this process (an LLM in a script or a test) may still
    # hold its cache until the garbage collector runs; its memory counts as free here.
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    return min(utilization * total - weights, free - _CUDA_ACTIVATION_RESERVE)


_CUDA_ACTIVATION_RESERVE = 1 << 30  # a 2048-token step of a 1B-class model needs well under 1 GiB
