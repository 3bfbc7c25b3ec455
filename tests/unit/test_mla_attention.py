"""Multi-head latent attention's cache and maths: the latent layout's size against full
K/V (the numbers docs/models.md states), the absorbed and the decompressed attention
giving one result, latent blocks travelling as K/V blocks do, DeepSeek's routing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from kvflow.errors import ConfigError
from kvflow.gpu_worker.attention.mla_torch import (
    absorb_query,
    attend_absorbed,
    attend_decompressed,
)
from kvflow.gpu_worker.kv_cache import KVCacheSpec, allocate_kv_cache
from kvflow.kernels.fused_moe_reference import GroupedTopK, route_grouped
from kvflow.kv_transfer.worker.block_io import decode_block, encode_block, gather_blocks
from kvflow.kv_transfer.worker.shared_storage import SharedStorageWorker

V2_LITE = dict(
    num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
)  # fmt: skip


def full_kv_bytes_per_token(config: object, elem: int) -> int:
    """What a cache of decompressed K (N + R) and V (V) per head would hold."""
    c = config
    per_head = c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim  # type: ignore[attr-defined]
    return c.num_hidden_layers * c.num_attention_heads * per_head * elem  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("config", "latent_bytes", "full_bytes"),
    [
        # V3 (and V2, 60 layers): 576 values a layer against 128 heads x (192 + 128)
        (DeepseekV3Config(), 61 * 576 * 2, 61 * 128 * 320 * 2),  # 70,272 vs 4,997,120 B
        (
            DeepseekV2Config(num_hidden_layers=60, num_attention_heads=128),
            60 * 576 * 2,
            60 * 128 * 320 * 2,
        ),
        (DeepseekV2Config(**V2_LITE), 27 * 576 * 2, 27 * 16 * 320 * 2),  # 31,104 vs 276,480 B
    ],
)
def test_the_latent_cache_holds_one_row_a_token_and_layer(
    config: object, latent_bytes: int, full_bytes: int
) -> None:
    spec = KVCacheSpec.from_hf_config(config, block_size=16, dtype=torch.bfloat16)
    assert (spec.planes, spec.num_kv_heads, spec.head_dim) == (1, 1, 576)
    assert spec.bytes_per_token == latent_bytes
    assert spec.bytes_per_block == 16 * latent_bytes
    assert full_kv_bytes_per_token(config, 2) == full_bytes
    caches = allocate_kv_cache(
        KVCacheSpec(2, 4, 1, 40, torch.float32, planes=1), 3, torch.device("cpu")
    )
    assert len(caches) == 2 and caches[0].shape == (1, 3, 4, 1, 40)


def test_an_8bit_latent_cache_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match=r"latent attention.*--kv-cache-dtype auto"):
        KVCacheSpec.from_hf_config(DeepseekV3Config(), 16, torch.int8)


def test_absorbed_and_decompressed_attention_agree() -> None:
    """The last query of a chunk, attended both ways over the same latent context."""
    generator = torch.Generator().manual_seed(0)
    heads, nope, rope, v_dim, rank, length = 4, 16, 8, 12, 32, 11

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    kv_b, context = rand(heads, nope + v_dim, rank), rand(length, rank + rope)
    q_nope, q_pe = rand(3, heads, nope), rand(3, heads, rope)
    query = torch.cat((q_nope, q_pe), dim=-1)
    visible = torch.ones(3, length, dtype=torch.bool).tril_(diagonal=length - 3)
    expected = attend_decompressed(query, context, visible, kv_b, nope, scale=0.2)
    absorbed = absorb_query(q_nope[-1:], q_pe[-1:], kv_b)  # [1, H, r + R]
    actual = attend_absorbed(absorbed, context[None], None, kv_b, nope, scale=0.2)
    assert actual.shape == (1, heads, v_dim)
    torch.testing.assert_close(actual[0], expected[-1])
    # The additive mask of decodes: hiding the last position = a context without it.
    mask = torch.zeros(1, 1, 1, length, dtype=torch.float64)
    mask[..., -1] = -torch.inf
    hidden = attend_absorbed(absorbed, context[None], mask, kv_b, nope, scale=0.2)
    all_but_last = torch.ones(1, length - 1, dtype=torch.bool)
    shorter = attend_decompressed(query[-1:], context[:-1], all_but_last, kv_b, nope, scale=0.2)
    torch.testing.assert_close(hidden[0], shorter[0])


def test_latent_blocks_travel_with_their_one_plane(tmp_path: Path) -> None:
    spec = KVCacheSpec(3, 4, 1, 40, torch.float32, planes=1)
    caches = allocate_kv_cache(spec, 5, torch.device("cpu"))
    for cache in caches:
        cache.copy_(torch.randn(cache.shape))
    worker = SharedStorageWorker(str(tmp_path), "ns", caches)
    assert worker.block_shape == [3, 1, 4, 1, 40]
    blocks = gather_blocks(caches, [2, 0])
    assert blocks.shape == (2, 3, 1, 4, 1, 40)
    received = decode_block(encode_block(blocks[0]), worker.block_shape, torch.float32)
    assert torch.equal(received[1], caches[1][:, 2])


def test_grouped_routing_picks_within_the_best_groups() -> None:
    # 8 experts in 4 groups; a token's best single expert (7) sits in a weak group.
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 1.5, 1.4, -3.0, 2.5]])
    v2 = GroupedTopK("softmax", "max", num_groups=4, topk_groups=2, scaling=2.0)
    routing = route_grouped(logits, 2, False, v2)
    assert sorted(routing.ids[0].tolist()) == [0, 7]  # groups by best expert: 0|1 and 6|7
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(routing.weights.sum(), 2.0 * (probs[0, 0] + probs[0, 7]))
    v3 = GroupedTopK("sigmoid", "top2", num_groups=4, topk_groups=2, scaling=1.0)
    routing = route_grouped(logits, 2, True, v3)
    assert sorted(routing.ids[0].tolist()) == [0, 1]  # by the sum of two: 0|1 and 4|5
    torch.testing.assert_close(routing.weights.sum(), torch.tensor(1.0))
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0])  # the choice only
    routing = route_grouped(logits, 2, False, v3, bias)
    assert sorted(routing.ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(routing.weights[0].sort().values, logits[0, 6:].sigmoid())
    empty = route_grouped(logits[:0], 2, True, v3, bias)  # a step with no rows here
    assert empty.ids.shape == (0, 2)
