"""The native bf16 GEMM in the offline engine: on a CPU with AVX512_BF16 and no AMX, bf16
models' linear layers (the LM head included) are packed for it and every call runs it,
and greedy tokens are those of the oneDNN route it replaces. With AMX, oneDNN keeps them."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.gpu_worker import weight_packing
from kvflow.kernels.cpu import bf16_gemm, packed_linear

pytestmark = [
    pytest.mark.native(bf16_gemm._library() is not None),
    pytest.mark.skipif(not bf16_gemm.available(), reason="this CPU has no AVX512_BF16"),
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def _greedy_ids(path: str, monkeypatch: pytest.MonkeyPatch, native: bool) -> list[list[int]]:
    monkeypatch.setattr(weight_packing, "NATIVE_BF16", native)
    llm = LLM(path, dtype="bfloat16", num_threads=1, kv_cache_memory=0.1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q|k|v with a bias
def test_native_gemm_serves_bf16_layers_with_onednn_tokens(
    tiny_model_dir: Any, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tiny_model_dir(arch))
    calls: list[tuple[int, int]] = []
    run = bf16_gemm.bf16_gemm

    def spy(x, packed, bias=None):
        calls.append((x.shape[0], packed.out_features))
        return run(x, packed, bias)

    fused_run = bf16_gemm.bf16_gemm_silu_and_mul
    fused: list[int] = []

    def fused_spy(x, packed, bias=None):
        fused.append(x.shape[0])
        return fused_run(x, packed, bias)

    monkeypatch.setattr(bf16_gemm, "bf16_gemm", spy)
    monkeypatch.setattr(bf16_gemm, "bf16_gemm_silu_and_mul", fused_spy)
    onednn = _greedy_ids(path, monkeypatch, native=False)
    assert calls == [] and fused == []  # switched off: every layer packed for oneDNN
    native = _greedy_ids(path, monkeypatch, native=True)
    assert native == onednn
    vocab = max(n for _, n in calls)
    assert {rows for rows, n in calls if n == vocab} >= {3}  # LM head at a decode step
    assert len({n for _, n in calls}) >= 3  # q|k|v, o and down, LM head
    assert {3} < set(fused)  # gate|up with SiLU*up: the prefill and the decode steps


def test_fused_silu_and_mul_leaves_logprobs_bit_for_bit(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    monkeypatch.setattr(weight_packing, "NATIVE_BF16", True)  # an AMX CPU defaults to oneDNN
    results = []
    for fused in (False, True):
        monkeypatch.setattr(weight_packing, "FUSED_SILU", fused)
        llm = LLM(path, dtype="bfloat16", num_threads=1, kv_cache_memory=0.1)
        mlp = llm.engine.runner.model.model.layers[0].mlp
        assert mlp.gate_up_proj.packed_weight.glu is fused
        outputs = llm.generate(PROMPTS, params)
        results.append([(o.token_ids, o.logprobs) for o in outputs])
    assert results[0] == results[1]


@pytest.mark.parametrize("amx", [False, True])
def test_the_default_route_follows_amx(
    tiny_model_dir: Any, amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # AMX tiles outrun AVX512_BF16 from a few rows up: there oneDNN keeps the layers.
    monkeypatch.setattr(packed_linear, "amx_bf16", lambda: amx)
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", num_threads=1, kv_cache_memory=0.1)
    layer = llm.engine.runner.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.packed_weight, bf16_gemm.PanelWeight) is not amx
