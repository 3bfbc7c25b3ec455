"""Saving a step's KV layer by layer, so that the copy out overlaps the forward.

A producer saves the blocks of every prompt its step completes. Copying them after the
whole forward adds the copy to the step; copying layer i while layers i+1.. compute
hides it. Each attention layer calls the step's `LayerSave` with its cache view once
it has stored the step's K/V (gpu_worker/attn_metadata.py `after_layer`); that layer's
blocks go to one background copier thread (torch's copies release the GIL)::

    main thread     | layer 0 | layer 1 | layer 2 | ... | layer L-1 | sample | wait()
    copier thread             | copy 0  | copy 1  | ... |           copy L-1 |
                                                                    ▲ all copied here

A layer is known by its cache view (the `caches` list the runner binds to its attention
layers; a pipeline stage lists only its own), never by a global layer number. A cache
the step does not know (a draft model's) is ignored, and a layer that never called
(a CUDA-graph replay runs no Python per layer) is copied in `wait()`: the hook makes
the save earlier, never incomplete.

On CUDA the layer's blocks are gathered on the device in the compute stream's order
(an asynchronous kernel launch, nothing to hide on the host), and `wait()` makes one
device-to-host copy; the thread is for the CPU, where the copy is host work.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class LayerCopier:
    """The connector's copier: one thread, for the worker's lifetime."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches  # one view per layer: [2, num_blocks, block_size, heads, dim]
        self._layer_of = {id(cache): layer for layer, cache in enumerate(caches)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-layer-copy")

    def begin(self, block_ids: list[int]) -> LayerSave:
        """A step's save of `block_ids` (every saving request's, concatenated)."""
        return LayerSave(self, block_ids)

    def layer_of(self, cache: torch.Tensor) -> int | None:
        return self._layer_of.get(id(cache))

    def submit(self, save: LayerSave, layer: int) -> Future[None]:
        return self._pool.submit(save.copy_layer, layer)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class LayerSave:
    """One step's blocks, copied out layer by layer into `blocks`
    `[n, num_layers, planes, block_size, kv_heads, head_dim]` (each block contiguous: the
    layout block_io.py sends and stores)."""

    def __init__(self, copier: LayerCopier, block_ids: list[int]) -> None:
        self.copier = copier
        first = copier.caches[0]
        self.on_device = first.device.type != "cpu"
        shape = [len(block_ids), len(copier.caches), first.shape[0], *first.shape[2:]]
        self.blocks = torch.empty(shape, dtype=first.dtype, device=first.device)
        self._index = torch.tensor(block_ids, device=first.device)
        self._copies: dict[int, Future[None] | None] = {}  # layer -> its copy (None: done)

    def __call__(self, cache: torch.Tensor) -> None:
        """`after_layer`: `cache`'s layer has stored this step's K/V."""
        layer = self.copier.layer_of(cache)
        if layer is None or layer in self._copies:
            return
        if self.on_device:  # queued behind the layer's own kernels on the same stream
            self.copy_layer(layer)
            self._copies[layer] = None
        else:
            self._copies[layer] = self.copier.submit(self, layer)

    @torch.inference_mode()  # thread-local: the copier thread needs it too (no autograd)
    def copy_layer(self, layer: int) -> None:
        cache = self.copier.caches[layer]
        self.blocks[:, layer].copy_(cache.index_select(1, self._index).transpose(0, 1))

    def wait(self) -> torch.Tensor:
        """Every layer's blocks on the host, once the copies are done; raises what a
        copy raised. Layers that did not call are copied now."""
        for copy in self._copies.values():
            if copy is not None:
                copy.result()
        for layer in range(len(self.copier.caches)):
            if layer not in self._copies:
                self.copy_layer(layer)
        self._copies = {}
        return self.blocks.cpu()
