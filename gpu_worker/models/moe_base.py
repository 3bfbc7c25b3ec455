"""What the mixture-of-experts families share: the Llama decoder with a family's MoE
block in place of some or all MLPs (DecoderSpec.mlp), and the checkpoint names of the
stacked experts.

Each expert's tensors arrive separately (`...experts.<e>.gate_proj.weight`, ...) and
land in one stacked parameter per layer (gpu_worker/layers/moe.py), whose shard ids are
those names; `checkpoint_target` maps each name there. Under expert parallelism the
other ranks' experts are skipped (`skips_weight`), as a pipeline stage skips the other
stages' layers.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvflow.gpu_worker.attention.backend import AttentionBackend
from kvflow.gpu_worker.layers.moe import FusedExperts
from kvflow.gpu_worker.models.llama import LlamaForCausalLM, LlamaMLP
from kvflow.gpu_worker.models.spec import DecoderSpec
from kvflow.gpu_worker.weights import packed_target


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Qwen's rule: every `decoder_sparse_step`-th layer is MoE, except `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer + 1) % step == 0
    )


def dense_mlp(config: Any, spec: DecoderSpec, intermediate_size: int) -> LlamaMLP:
    """The Llama MLP at another width (a Qwen dense layer, Qwen2-MoE's shared expert)."""
    sized = SimpleNamespace(hidden_size=config.hidden_size, intermediate_size=intermediate_size)
    return LlamaMLP(sized, spec)


def experts_prefix(layer: int, block: str = "mlp") -> str:
    """Checkpoint prefix of layer `layer`'s experts (`block`: the MoE module's name)."""
    return f"model.layers.{layer}.{block}.experts"


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-shaped decoder whose MLPs are (some of them) mixtures of experts.
    `moe_block`: the checkpoint's name of a layer's MoE module (ours is always `mlp`)."""

    moe_block = "mlp"

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.expert_targets: dict[str, str] = {}  # checkpoint name -> stacked parameter
        self.other_experts: set[str] = set()  # held by another expert-parallel rank
        for module_name, module in self.named_modules():
            if isinstance(module, FusedExperts):
                for name, (_, part) in module.shards.items():
                    param = "w2_weight" if part == 2 else "w13_weight"
                    self.expert_targets[name] = f"{module_name}.{param}"
                for name, (_, part) in module.bias_shards.items():
                    param = "w2_bias" if part == 2 else "w13_bias"
                    self.expert_targets[name] = f"{module_name}.{param}"
                mine = module.shards.keys() | module.bias_shards.keys()
                self.other_experts |= module.all_names - mine

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        """(parameter name, shard id) of checkpoint tensor `name` (weights.load_weights)."""
        if name in self.expert_targets:
            return self.expert_targets[name], name
        name = name.replace(f".{self.moe_block}.", ".mlp.")
        return packed_target(name, self.packed_modules_mapping)

    def skips_weight(self, name: str) -> bool:
        return super().skips_weight(name) or name in self.other_experts
