"""Which step features a scheduler gets, from the engine configuration's pieces.

Prompt logprobs and beam search are always on (a request asks for them); jump-forward
when the scheduler config enables it; speculative decoding, KV transfer, pipeline
micro-batches and pooling when the deployment has them. The order is the order of the hooks:
micro-batches first (a busy request is held before a speculator counts a decode).
Images always travel with their requests (image_inputs.py) and their encoding is
budgeted per step (encoder_budget.py); a text request costs one check per scheduled
request in each.
"""

from __future__ import annotations

from kvflow.config import SchedulerConfig
from kvflow.kv_transfer.scheduler.connector import KVConnectorScheduler
from kvflow.kv_transfer.scheduler.step_feature import KVTransferFeature
from kvflow.pooling import PoolingSpec
from kvflow.services.scheduler.admission_hold import AdmissionHoldFeature
from kvflow.services.scheduler.beam_feature import BeamSearchFeature
from kvflow.services.scheduler.encoder_budget import EncoderBudgetFeature
from kvflow.services.scheduler.image_inputs import ImageInputsFeature
from kvflow.services.scheduler.jump_forward import JumpForwardFeature
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.lora_feature import LoraFeature
from kvflow.services.scheduler.micro_batches import MicroBatchFeature
from kvflow.services.scheduler.pooling import PoolingFeature
from kvflow.services.scheduler.prompt_logprobs import PromptLogprobsFeature
from kvflow.services.scheduler.spec_decode.speculator import Speculator
from kvflow.services.scheduler.spec_decode.step_feature import SpecDecodeFeature
from kvflow.services.scheduler.step_features import StepFeature


def make_step_features(
    config: SchedulerConfig,
    kv_cache: KVCacheManager,
    max_model_len: int,
    *,
    speculator: Speculator | None = None,
    kv_connector: KVConnectorScheduler | None = None,
    pipeline_depth: int = 1,  # pipeline stages: micro_batches.py's rules when > 1
    pooling: PoolingSpec | None = None,  # the pooling runner's pooler
    max_loras: int = 0,  # LoRA adapters per step (0: LoRA off)
) -> list[StepFeature]:
    features: list[StepFeature] = []
    if max_loras:
        features.append(LoraFeature(max_loras))
    if pipeline_depth > 1:
        features.append(MicroBatchFeature(pipeline_depth))
    if speculator is not None:
        features.append(SpecDecodeFeature(speculator, kv_cache, max_model_len))
    if kv_connector is not None:
        features.append(KVTransferFeature(kv_connector, kv_cache))
    if config.grammar_jump_forward:
        features.append(JumpForwardFeature(max_model_len))
    features.append(BeamSearchFeature(kv_cache, config.max_num_seqs))
    features.append(PromptLogprobsFeature())
    if pooling is not None:
        features.append(PoolingFeature(pooling))
    tokens = config.max_num_batched_tokens
    encoder_tokens = config.max_num_encoder_input_tokens or tokens
    features.append(EncoderBudgetFeature(encoder_tokens, config.encoder_cache_size or tokens))
    features.append(ImageInputsFeature())
    if config.admission_hold > 0:  # last: it sees the plan the others shaped
        features.append(AdmissionHoldFeature(config.admission_hold))
    return features
