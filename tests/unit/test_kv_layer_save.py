"""Layer-by-layer saving (kvflow/kv_transfer/worker/layer_save.py): each attention layer's
hook hands its blocks to the copier thread; wait() returns exactly what one gather after
the forward would, whichever layers called, and raises what a copy raised."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvflow.kv_transfer.worker.block_io import decode_block, gather_blocks
from kvflow.kv_transfer.worker.layer_save import LayerCopier
from kvflow.kv_transfer.worker.shared_storage import SharedStorageWorker
from kvflow.kv_transfer_config import block_file_path
from kvflow.proto.kv_transfer import KVBlockTransfer, KVConnectorMeta

NUM_LAYERS, NUM_BLOCKS, BLOCK = 3, 6, 4


def _caches() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, NUM_BLOCKS, BLOCK, 2, 5) for _ in range(NUM_LAYERS)]


def test_every_layer_copied_by_the_copier_thread_equals_one_gather() -> None:
    caches = _caches()
    copier = LayerCopier(caches)
    threads: list[str] = []
    save = copier.begin([4, 1, 2])
    copy_layer = save.copy_layer

    def spy(layer: int) -> None:
        threads.append(threading.current_thread().name)
        copy_layer(layer)

    save.copy_layer = spy  # type: ignore[method-assign]
    save(torch.zeros(2, 1, BLOCK, 2, 5))  # another model's cache (a drafter's): ignored
    for cache in caches:
        save(cache)
        save(cache)  # a second call for the same layer copies nothing more
    blocks = save.wait()
    assert torch.equal(blocks, gather_blocks(caches, [4, 1, 2]))
    assert len(threads) == NUM_LAYERS
    assert all(name.startswith("kv-layer-copy") for name in threads)
    copier.close()


def test_layers_that_never_called_are_copied_in_wait() -> None:
    caches = _caches()
    copier = LayerCopier(caches)
    save = copier.begin([5, 0])
    save(caches[1])  # a CUDA-graph replay or another stage's layout calls for none/some
    assert torch.equal(save.wait(), gather_blocks(caches, [5, 0]))
    copier.close()


def test_a_failed_copy_raises_in_wait() -> None:
    copier = LayerCopier(_caches())
    save = copier.begin([NUM_BLOCKS + 3])  # no such block
    with pytest.raises((IndexError, RuntimeError)):
        save(copier.caches[0])
        save.wait()
    copier.close()


@pytest.mark.parametrize("layer_by_layer", [True, False])
def test_shared_storage_saves_the_same_files_either_way(
    tmp_path: Path, layer_by_layer: bool
) -> None:
    caches = _caches()
    worker = SharedStorageWorker(str(tmp_path), "ns", caches)
    worker.layer_by_layer = layer_by_layer
    keys = [f"{i:064x}" for i in (1, 2, 3)]
    existing = Path(block_file_path(str(tmp_path), "ns", keys[1]))
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"saved before by another instance")
    meta = KVConnectorMeta(
        saves=[KVBlockTransfer("a", [3, 0], keys[:2]), KVBlockTransfer("b", [2], keys[2:])]
    )
    hook = worker.start_save_kv(meta)
    assert (hook is not None) == layer_by_layer
    if hook is not None:
        for cache in caches:
            hook(cache)
    worker.wait_for_save(meta)
    shape = [NUM_LAYERS, 2, BLOCK, 2, 5]
    for key, block_id in ((keys[0], 3), (keys[2], 2)):
        data = Path(block_file_path(str(tmp_path), "ns", key)).read_bytes()
        assert torch.equal(
            decode_block(data, shape, torch.float32), gather_blocks(caches, [block_id])[0]
        )
    assert existing.read_bytes() == b"saved before by another instance"  # not rewritten
    stats = worker.take_stats()
    assert stats.bytes_saved > 2 * NUM_LAYERS * 2 * BLOCK * 2 * 5 * 4  # two blocks + headers
    assert stats.save_s > 0
    worker.close()
