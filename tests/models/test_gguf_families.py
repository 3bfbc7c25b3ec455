"""Every llama.cpp architecture of gpu_worker/gguf_archs.py beyond llama/qwen2/qwen3
(test_gguf_convert.py), loaded from a quantized GGUF written the way llama.cpp writes one.

Per row of FAMILIES a tiny random HF model is saved and written to a GGUF by
tests/gguf_writer.py (llama.cpp's tensor names and conventions, matrices in Q8_0 or
Q4_0), which kvflow converts and loads. The reference is the model's safetensors twin:
the same checkpoint with every matrix replaced by the values the GGUF encodes, run by
transformers and by kvflow. Where transformers' own GGUF loader reads the architecture,
transformers reading the GGUF file itself (its renaming, un-permuting, norm shift and
expert stacking, never kvflow's) is a second reference. Float32: greedy tokens must be
identical. A family added to gguf_archs.py gets these tests from one row here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf_writer import encoded, llama3_rope_freqs, write_gguf
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from kvflow.gpu_worker import gguf_convert
from kvflow.gpu_worker.model_loader import load_model
from kvflow.kernels.cpu import block_linear

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True)
class Family:
    arch: str  # llama.cpp's general.architecture
    config: Callable[[], PretrainedConfig]
    hf_reads_gguf: bool  # transformers' GGUF loader knows the architecture
    fmt: str = "Q8_0"
    split_kv_b: bool = False  # DeepSeek: newer llama.cpp's attn_k_b + attn_v_b
    holds: tuple[tuple[str, str], ...] = ()  # (GGUF tensor, its type) the file must have


def _config(name: str, **kwargs: Any) -> Callable[[], PretrainedConfig]:
    return lambda: getattr(transformers, name)(**{**SMALL, **kwargs})


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip

# DeepSeek's latent attention (a 24-wide latent + 8 rope dims) and routing (4 experts in
# 2 groups, a shared one, a dense first layer), as tests/conftest.py's tiny configs.
MLA = dict(
    num_key_value_heads=4, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
    tie_word_embeddings=False,
)  # fmt: skip
DEEPSEEK_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
    "mscale_all_dim": 0.8, "original_max_position_embeddings": 128,
}  # fmt: skip

FAMILIES = {
    "llama3": Family(
        "llama",
        _config("LlamaConfig", max_position_embeddings=256, rope_parameters=LLAMA3_ROPE),
        True,
    ),
    "qwen3moe": Family(
        "qwen3moe", _config("Qwen3MoeConfig", **MOE, head_dim=16, norm_topk_prob=True), True
    ),
    "qwen2moe": Family(
        "qwen2moe",
        _config("Qwen2MoeConfig", **MOE, shared_expert_intermediate_size=64),
        True,
        fmt="Q4_0",
    ),
    "mixtral": Family("llama", _config("MixtralConfig", num_local_experts=4), False),
    "gemma2": Family(
        "gemma2",
        _config(
            "Gemma2Config",
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=30.0,
        ),
        True,
    ),
    "gemma3": Family(
        "gemma3",
        _config(
            "Gemma3TextConfig",
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            num_hidden_layers=6,
            tie_word_embeddings=False,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        True,
        fmt="Q4_0",
    ),
    "phi3": Family(
        "phi3",
        _config(
            "Phi3Config",
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [2.0, 2.5, 3.0, 4.0],
                "original_max_position_embeddings": 32,
            },
        ),
        True,
    ),
    "olmo2": Family("olmo2", _config("Olmo2Config"), False),
    "granite": Family(
        "granite",
        _config(
            "GraniteConfig",
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=0.5,
        ),
        False,
    ),
    "smollm3": Family("smollm3", _config("SmolLM3Config", num_hidden_layers=4), False),
    "deepseekv2": Family(  # no q bottleneck, group-limited softmax routing, kv_b whole
        "deepseek2",
        _config(
            "DeepseekV2Config",
            q_lora_rank=None,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            **MLA,
        ),
        False,
    ),
    "deepseekv3": Family(  # q bottleneck, sigmoid routing, YaRN, kv_b split in two
        "deepseek2",
        _config(
            "DeepseekV3Config",
            q_lora_rank=16,
            routed_scaling_factor=2.5,
            rope_parameters=DEEPSEEK_YARN,
            **{**MLA, "max_position_embeddings": 512},
        ),
        False,
        fmt="Q4_0",
        split_kv_b=True,
        holds=(("blk.1.attn_k_b.weight", "F32"), ("blk.1.exp_probs_b.bias", "F32")),
    ),
    "gptoss": Family(  # alternating window (shorter than the prompts), YaRN, MXFP4 experts
        "gpt-oss",
        _config(
            "GptOssConfig",
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            tie_word_embeddings=False,
            intermediate_size=32,
        ),
        False,
        holds=(
            ("blk.1.ffn_gate_exps.weight", "MXFP4"),
            ("blk.1.ffn_down_exps.weight", "MXFP4"),
            ("blk.1.ffn_up_exps.bias", "F32"),
            ("blk.0.attn_sinks.weight", "F32"),
        ),
    ),
}


def _randomize(model: torch.nn.Module) -> None:
    """A large spread, routers larger still: decisive routing, every weight matters."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight", "router.weight")
            ):
                param.copy_(0.6 * noise)
            else:
                param.copy_(0.15 * noise)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Built:
    family: Family
    gguf_path: Path
    twin: Any  # transformers on the twin checkpoint
    kv_gguf: torch.nn.Module  # kvflow, from the converted GGUF
    kv_twin: torch.nn.Module  # kvflow, from the twin checkpoint


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    family = FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(f"gguf-{request.param}")
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(family.config(), attn_implementation="eager")
    _randomize(hf_model)
    hf_model.save_pretrained(tmp / "hf")
    tensors = load_file(tmp / "hf" / "model.safetensors")
    write_gguf(
        tmp / "m.gguf",
        family.arch,
        hf_model.config,
        tensors,
        family.fmt,
        split_kv_b=family.split_kv_b,
    )
    twin = {name: encoded(family.arch, name, array, family.fmt) for name, array in tensors.items()}
    (tmp / "twin").mkdir()
    save_file(twin, tmp / "twin" / "model.safetensors", {"format": "pt"})
    (tmp / "twin" / "config.json").write_text((tmp / "hf" / "config.json").read_text())
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf_convert, "save_tokenizer", lambda gguf_path, out: None)
    converted = gguf_convert.convert_gguf(tmp / "m.gguf", tmp / "converted")
    mp.undo()
    cpu, f32 = torch.device("cpu"), torch.float32
    return Built(
        family,
        tmp / "m.gguf",
        AutoModelForCausalLM.from_pretrained(tmp / "twin", attn_implementation="eager").eval(),
        load_model(converted, f32, cpu, "torch"),
        load_model(tmp / "twin", f32, cpu, "torch"),
    )


# Config fields a family reads, compared where the original config has them (RoPE is
# checked by the logits).
FIELDS = (
    "architectures", "tie_word_embeddings", "sliding_window", "layer_types",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
    "no_rope_layers", "num_experts", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
    "mlp_only_layers", "attention_multiplier", "embedding_multiplier",
    "residual_multiplier", "logits_scaling", "num_key_value_heads",
    "intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group",
    "topk_group", "routed_scaling_factor", "topk_method",
)  # fmt: skip


def test_the_converted_config_is_the_models(built: Built) -> None:
    converted = json.loads((built.gguf_path.parent / "converted" / "config.json").read_text())
    original = built.twin.config.to_dict()
    for field in (f for f in FIELDS if f in original):
        expected = original[field]  # a float went through the GGUF as float32
        if isinstance(expected, float):
            expected = pytest.approx(expected, rel=1e-6)
        assert converted.get(field) == expected, field


def test_the_gguf_is_in_llama_cpps_layout(built: Built) -> None:
    """The tensors a family's hooks read are in the file as llama.cpp writes them."""
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(built.gguf_path).tensors}
    assert all(types.get(name) == kind for name, kind in built.family.holds), types


def test_prefill_logits_match_the_safetensors_twin(built: Built, prefill_logits) -> None:
    tokens = _prompt(13, seed=2)  # longer than the sliding windows
    with torch.inference_mode():
        expected = built.twin(torch.tensor([tokens])).logits[0]
    actual = prefill_logits(built.kv_gguf, tokens)
    assert expected.std() > 0.5
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(actual, prefill_logits(built.kv_twin, tokens), atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(built: Built, paged_runner) -> None:
    prompt = _prompt(7, seed=6)
    expected = list(prompt)
    with torch.inference_mode():  # greedy by hand: no EOS stop, no generation config
        for _ in range(8):
            expected.append(int(built.twin(torch.tensor([expected])).logits[0, -1].argmax()))
    runner = paged_runner(built.kv_gguf, num_blocks=8, block_size=4)
    tokens = [int(runner.step([("r", prompt)])[0][-1].argmax())]
    while len(tokens) < 8:
        tokens.append(int(runner.step([("r", tokens[-1:])])[0][-1].argmax()))
    assert tokens == expected[7:]


def test_transformers_reading_the_gguf_agrees(built: Built, prefill_logits) -> None:
    if not built.family.hf_reads_gguf:
        pytest.skip("transformers' GGUF loader does not read this architecture")
    reference = AutoModelForCausalLM.from_pretrained(
        built.gguf_path.parent, gguf_file=built.gguf_path.name, config=built.twin.config,
        dtype=torch.float32, local_files_only=True,
    ).eval()  # fmt: skip
    tokens = _prompt(11, seed=3)
    with torch.inference_mode():
        expected = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(
        prefill_logits(built.kv_gguf, tokens), expected, atol=1e-4, rtol=1e-4
    )


@pytest.mark.native(block_linear.available())
def test_attention_reads_the_gguf_blocks(built: Built) -> None:
    """The block kernels serve the GGUF's matrices (Phi-3's fused qkv split by rows)."""
    attention = built.kv_gguf.model.layers[0].self_attn
    names = [
        name for name in ("qkv_proj", "kv_a_proj_with_mqa", "o_proj") if hasattr(attention, name)
    ]
    assert "o_proj" in names
    for layer in (getattr(attention, name) for name in names):
        assert layer.blocks is not None and layer.blocks.format == built.family.fmt


@pytest.mark.embedded
@pytest.mark.slow  # ~40 s: the embedded GGUF's 49k-token tokenizer, converted twice
def test_the_tokenizer_converts_where_transformers_reads_no_model(tmp_path) -> None:
    """transformers' GGUF model loader knows no olmo2/granite/smollm3 file; its tokenizer
    reader does, and the converter asks only that (gguf_convert.save_tokenizer). The
    llama branch (no tokenizer class registered) is the embedded model's own test."""
    family = "olmo2"
    from transformers import AutoTokenizer

    from kvflow.gpu_worker.model_files import embedded_gguf_path

    embedded = embedded_gguf_path()
    config = FAMILIES[family].config()
    embedding = {"model.embed_tokens.weight": np.zeros((96, 64), dtype=np.float32)}
    arch = FAMILIES[family].arch
    write_gguf(tmp_path / "m.gguf", arch, config, embedding, tokenizer_from=embedded)
    out = gguf_convert.convert_gguf(tmp_path / "m.gguf", tmp_path / "converted")
    reference = AutoTokenizer.from_pretrained(str(embedded.parent), gguf_file=embedded.name)
    text = "The capital of France is  Paris!"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == reference(text)["input_ids"]


def test_an_architecture_without_a_row_is_refused_naming_the_rows(tmp_path) -> None:
    from kvflow.errors import UnsupportedModelError

    write_gguf(tmp_path / "m.gguf", "falcon", FAMILIES["olmo2"].config(), {})
    with pytest.raises(UnsupportedModelError, match=r"'falcon' is not supported.*'qwen3moe'"):
        gguf_convert.convert_gguf(tmp_path / "m.gguf", tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_rope_freqs_that_are_no_llama3_schedule_are_refused(tmp_path) -> None:
    from kvflow.errors import UnsupportedModelError
    from kvflow.gpu_worker.gguf_rope import llama3_rope

    divisors = llama3_rope_freqs(FAMILIES["llama3"].config()).astype(np.float64)
    params = llama3_rope(divisors, 16, 10000.0)
    assert {k: params[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE  # the schedule, recovered
    divisors[3] *= 1.01  # one ramp point off the line
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        llama3_rope(divisors, 16, 10000.0)
