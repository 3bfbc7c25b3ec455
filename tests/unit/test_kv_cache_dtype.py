"""--kv-cache-dtype: names, resolution against the model dtype, and what it sizes."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import CacheConfig, EngineConfig, resolve_kv_cache_dtype
from kvflow.errors import ConfigError
from kvflow.gpu_worker.kv_cache import KVCacheSpec, allocate_kv_cache, kv_storage_dtype
from kvflow.kernels import kv_codec
from kvflow.kv_transfer.worker.block_io import (
    decode_block,
    encode_block,
    gather_blocks,
    scatter_blocks,
)
from kvflow.kv_transfer_config import engine_kv_namespace


@pytest.mark.parametrize(
    ("name", "model", "resolved"),
    [
        ("auto", "bfloat16", "bfloat16"),
        ("auto", "float32", "float32"),
        ("float32", "float32", "float32"),
        ("fp8", "bfloat16", "fp8_e4m3"),
        ("fp8_e4m3", "float32", "fp8_e4m3"),
        ("fp8_e5m2", "float16", "fp8_e5m2"),
        ("int8", "bfloat16", "int8"),
    ],
)
def test_resolution(name: str, model: str, resolved: str) -> None:
    assert resolve_kv_cache_dtype(name, model) == resolved


def test_a_float_cache_of_another_dtype_is_refused() -> None:
    with pytest.raises(
        ConfigError, match="kv_cache_dtype float16 differs from the model dtype bfloat16"
    ):
        resolve_kv_cache_dtype("float16", "bfloat16")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]


def test_engine_config_resolves_before_the_workers_see_it() -> None:
    config = EngineConfig.create(device="cpu", dtype="float32", kv_cache_dtype="fp8")
    assert config.cache.kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig.create(device="cpu", dtype="bfloat16").cache.kv_cache_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="differs from the model dtype float32"):
        EngineConfig.create(device="cpu", dtype="float32", kv_cache_dtype="bfloat16")
    # Every backend serves a quantized cache (the Triton kernels read the rows too).
    triton = EngineConfig.create(device="cuda", kv_cache_dtype="int8", attention_backend="triton")
    assert triton.cache.kv_cache_dtype == "int8"


def test_disaggregated_namespaces_keep_cache_layouts_apart() -> None:
    """Float caches keep their namespace; a quantized one never shares it."""
    float_cache = EngineConfig.create(device="cpu", dtype="float32")
    int8 = EngineConfig.create(device="cpu", dtype="float32", kv_cache_dtype="int8")
    fp8 = EngineConfig.create(device="cpu", dtype="float32", kv_cache_dtype="fp8")
    names = {engine_kv_namespace(c) for c in (float_cache, int8, fp8)}
    assert len(names) == 3
    auto = EngineConfig.create(device="cpu", dtype="float32", kv_cache_dtype="float32")
    assert engine_kv_namespace(auto) == engine_kv_namespace(float_cache)


def test_storage_dtype_and_sizes() -> None:
    """SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64): an 8-bit row is 68
    bytes against 128 of bf16, so a fixed budget holds 128/68 = 1.88x the blocks."""
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert kv_storage_dtype("int8", torch.bfloat16) == torch.int8
    bf16 = KVCacheSpec(30, 16, 3, 64, torch.bfloat16)
    int8 = KVCacheSpec(30, 16, 3, 64, torch.int8)
    assert bf16.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 2
    assert int8.bytes_per_block == 2 * 30 * 16 * 3 * 68
    budget = 1 << 30
    assert budget // int8.bytes_per_block == 5482 and budget // bf16.bytes_per_block == 2912
    caches = allocate_kv_cache(int8, 3, torch.device("cpu"))
    assert len(caches) == 30 and caches[0].shape == (2, 3, 16, 3, 68)
    assert caches[0].dtype == torch.int8 and kv_codec.head_dim_of(caches[0]) == 64


@pytest.mark.parametrize("codec", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantized_blocks_travel_and_a_dtype_mismatch_is_named(codec: torch.dtype) -> None:
    spec = KVCacheSpec(2, 4, 2, 8, codec)
    caches = allocate_kv_cache(spec, 5, torch.device("cpu"))
    for cache in caches:
        cache.copy_(kv_codec.quantize_rows(torch.randn(2, 5, 4, 2, 8), codec))
    blocks = gather_blocks(caches, [3, 1])
    shape = [2, 2, 4, 2, 12]
    received = decode_block(encode_block(blocks[0]), shape, codec)
    targets = allocate_kv_cache(spec, 5, torch.device("cpu"))
    for cache in targets:
        cache.view(torch.uint8).zero_()
    scatter_blocks(targets, [0, 4], torch.stack([received, blocks[1]]))
    for source, target in zip(caches, targets):
        assert torch.equal(target[:, 0].view(torch.uint8), source[:, 3].view(torch.uint8))
        assert torch.equal(target[:, 4].view(torch.uint8), source[:, 1].view(torch.uint8))
        assert not target[:, 1:4].view(torch.uint8).any()
    other = torch.int8 if codec != torch.int8 else torch.float8_e4m3fn
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        decode_block(encode_block(blocks[0]), shape, other)
