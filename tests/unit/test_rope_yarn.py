"""YaRN frequencies and attention factor against transformers' own rope init, on
gpt-oss's settings (`truncate: false`, beta_fast 32 / beta_slow 1, factor 32 over 4096
positions, theta 150000) and with the correction range truncated (the default)."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvflow.gpu_worker.layers.rope_scaling import compute_inv_freq, rope_parameters

GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@pytest.mark.parametrize(
    "overrides",
    [{}, {"truncate": True}, {"beta_fast": 16.0, "beta_slow": 2.0, "factor": 8.0}],
    ids=["gpt-oss", "truncated", "other-betas"],
)
def test_yarn_matches_transformers(overrides: dict[str, float]) -> None:
    config = GptOssConfig(
        head_dim=64, num_attention_heads=64, hidden_size=2880, max_position_embeddings=131072,
        rope_parameters={**GPT_OSS_YARN, **overrides},
    )  # fmt: skip
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    inv_freq, factor = compute_inv_freq(64, rope_parameters(config), 131072)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_truncation_changes_the_ramp() -> None:
    """gpt-oss's `truncate: false` is read, not defaulted: its ramp differs."""
    config = GptOssConfig(head_dim=64, rope_parameters=GPT_OSS_YARN)
    params = rope_parameters(config)
    untruncated, _ = compute_inv_freq(64, params, 131072)
    truncated, _ = compute_inv_freq(64, {**params, "truncate": True}, 131072)
    assert not torch.allclose(untruncated, truncated)
