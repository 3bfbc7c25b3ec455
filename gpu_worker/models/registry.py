"""HF `architectures` name -> kvflow model class (one module per family)."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvflow.gpu_worker.models.gemma2 import Gemma2ForCausalLM
from kvflow.gpu_worker.models.gemma3 import Gemma3ForCausalLM
from kvflow.gpu_worker.models.gpt_oss import GptOssForCausalLM
from kvflow.gpu_worker.models.granite import GraniteForCausalLM
from kvflow.gpu_worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvflow.gpu_worker.models.llava import LlavaForConditionalGeneration
from kvflow.gpu_worker.models.mixtral import MixtralForCausalLM
from kvflow.gpu_worker.models.olmo2 import Olmo2ForCausalLM
from kvflow.gpu_worker.models.phi3 import Phi3ForCausalLM
from kvflow.gpu_worker.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from kvflow.gpu_worker.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from kvflow.gpu_worker.models.qwen2_moe import Qwen2MoeForCausalLM
from kvflow.gpu_worker.models.qwen3_moe import Qwen3MoeForCausalLM
from kvflow.gpu_worker.models.smollm3 import SmolLM3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}


def get_model_class(architectures: Sequence[str] | None) -> type[LlamaForCausalLM]:
    """The class of the first supported entry of config.architectures."""
    for name in architectures or ():
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise UnsupportedModelError(
        f"unsupported model architecture {list(architectures or [])}; "
        f"kvflow supports {sorted(MODEL_CLASSES)}"
    )
