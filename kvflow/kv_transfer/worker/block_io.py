"""One KV block as bytes: gathered from, and scattered into, the per-layer caches.

The paged cache is one view per layer, `[2, num_blocks, block_size, kv_heads, width]`
(kv_cache.py; width = head_dim, or head_dim + 4 for the 8-bit rows of a quantized
cache; an MLA latent cache has 1 plane where K/V have 2). A block travels as
`[num_layers, planes, block_size, kv_heads, width]`
with a msgspec header naming dtype and shape, so the receiver checks the layout
before it writes a byte (a mismatch is an error, never a silent reinterpretation)::

    | u32 header length | msgpack BlockHeader | raw tensor bytes (C order) |
"""

from __future__ import annotations

import struct

import msgspec
import torch

from kvflow.kernels import kv_codec

_LEN = struct.Struct("<I")


class BlockHeader(msgspec.Struct, array_like=True):
    dtype: str  # e.g. "bfloat16"
    shape: list[int]  # [num_layers, 2, block_size, kv_heads, head_dim]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BlockHeader)


def gather_block(caches: list[torch.Tensor], block_id: int) -> torch.Tensor:
    """The block's K and V of every layer, on the host, contiguous."""
    return torch.stack([cache[:, block_id] for cache in caches]).cpu()


def gather_blocks(caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """`[n, num_layers, 2, block_size, kv_heads, head_dim]` on the host: one indexed
    copy per layer (not one per block and layer), each block contiguous."""
    index = torch.tensor(block_ids, device=caches[0].device)
    layers = [cache.index_select(1, index).transpose(0, 1) for cache in caches]
    return torch.stack(layers, dim=1).cpu()


def scatter_blocks(caches: list[torch.Tensor], block_ids: list[int], blocks: torch.Tensor) -> None:
    """The inverse of gather_blocks: `blocks` [n, num_layers, 2, ...] into the cache."""
    index = torch.tensor(block_ids, device=caches[0].device)
    for layer, cache in enumerate(caches):
        source = blocks[:, layer].transpose(0, 1).to(cache.device, non_blocking=True)
        if kv_codec.is_quantized(cache.dtype):  # as bytes: no CPU index_copy_ for fp8
            cache, source = cache.view(torch.uint8), source.view(torch.uint8)
        cache.index_copy_(1, index, source)


def scatter_block(caches: list[torch.Tensor], block_id: int, block: torch.Tensor) -> None:
    for layer, cache in enumerate(caches):
        cache[:, block_id].copy_(block[layer], non_blocking=True)


def encode_block(block: torch.Tensor) -> bytes:
    header = _encoder.encode(
        BlockHeader(str(block.dtype).removeprefix("torch."), list(block.shape))
    )
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    return _LEN.pack(len(header)) + header + payload


def layout_mismatch(
    shape: list[int], dtype: str, expected_shape: list[int], expected_dtype: str
) -> str:
    """Why blocks of another layout cannot be written here, in the user's terms."""
    message = (
        f"KV blocks of shape {shape} {dtype}, this cache holds {expected_shape} {expected_dtype}"
    )
    if dtype != expected_dtype:
        message += (
            f": the sender's KV cache stores {dtype} and this one {expected_dtype}; "
            "run both instances with the same --kv-cache-dtype"
        )
    return message


def decode_block(
    data: bytes, expected_shape: list[int], expected_dtype: torch.dtype
) -> torch.Tensor:
    """The block in `data`; ValueError if it is cut short or of another layout."""
    (header_len,) = _LEN.unpack_from(data)
    header = _decoder.decode(data[_LEN.size : _LEN.size + header_len])
    want_dtype = str(expected_dtype).removeprefix("torch.")
    if header.shape != expected_shape or header.dtype != want_dtype:
        raise ValueError(layout_mismatch(header.shape, header.dtype, expected_shape, want_dtype))
    payload = memoryview(data)[_LEN.size + header_len :]
    elem = torch.empty((), dtype=expected_dtype).element_size()
    expected_bytes = elem
    for dim in expected_shape:
        expected_bytes *= dim
    if len(payload) != expected_bytes:
        raise ValueError(f"KV block of {len(payload)} bytes, expected {expected_bytes}")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(expected_dtype).reshape(expected_shape)
