"""Soft-capped layers (Gemma 2) on the Triton backend: the paged kernel has no cap, so
the backend hands them to the torch backend, and the cap reaches the result."""

from __future__ import annotations

from test_triton_backend import _metadata, _step

from kvflow.gpu_worker.attention.torch_backend import TorchAttentionBackend
from kvflow.gpu_worker.attention.triton_backend import TritonAttentionBackend


def test_soft_capped_step_matches_the_torch_backend(make_batch, assert_close) -> None:
    batch, key, value = _step(make_batch, [(21, 1), (37, 37), (50, 17)])
    metadata = _metadata(batch)
    caches = [batch.kv_cache.clone() for _ in range(3)]
    expected = TorchAttentionBackend().forward(
        batch.query, key, value, caches[0], metadata, 0.5, 6, softcap=1.5
    )
    out = TritonAttentionBackend().forward(
        batch.query, key, value, caches[1], metadata, 0.5, 6, softcap=1.5
    )
    uncapped = TritonAttentionBackend().forward(
        batch.query, key, value, caches[2], metadata, 0.5, 6
    )
    assert_close(out, expected)
    assert (out - uncapped).abs().max() > 1e-2  # the cap changed the result
