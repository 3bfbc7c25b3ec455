"""Chained hashes of full KV blocks: the keys of the prefix cache.

A block's KV depends on every token before it, so its key chains through its parent::

    tokens:  | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial: never hashed)
    hashes:  h0 = H(None, t0..t15, extra)   h1 = H(h0, t16..t31, ())
    H(parent, tokens, extra) = sha256(msgpack([parent, tokens, extra]))   (32 bytes)

Choices, and why:
- sha256, not Python's `hash()`: the builtin tuple hash is 64 bits and invertible, so a
  client could craft a prompt whose block collides with another tenant's and read or
  poison its KV. A collision-resistant hash makes "same key" mean "same tokens", which
  is why a cache hit needs no token-by-token check.
- The full 32-byte digest, not 8 bytes: a 64-bit truncation is open to a birthday
  attack (~2^32 work). `bytes` keys cost the same in a dict as ints (CPython caches a
  bytes object's hash), so the only price is 24 bytes of memory per block.
- msgpack via msgspec (C speed, ~2 us per 16-token block with the digest): the
  encoding is deterministic and self-delimiting, so the (parent, tokens, extra)
  boundaries cannot be confused; a list and a tuple of the same ids encode alike. No
  pickle anywhere.
- `extra_keys` of the first block carry the per-request `cache_salt` and the LoRA
  adapter's id (an adapter changes every layer's K/V); every later hash chains through
  h0, so the salt separates tenants, and the adapter its requests, for the whole
  sequence. The base model adds no key, so its hashes are what they were without LoRA.
- A block that covers any placeholder token of an image carries that image's hash in
  its extra keys (`image_spans`): the placeholder ids are the same for every image, so
  without it two prompts with the same text and different images would share KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import msgspec

BlockHash = NewType("BlockHash", bytes)  # 32-byte sha256 digest

_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str | int, ...] = (),
) -> BlockHash:
    """Hash one FULL block given its parent's hash (None for the first block).

    `token_ids` must be a list or tuple (what msgpack encodes as an array).
    """
    payload = _encoder.encode((parent, token_ids, extra_keys))
    return BlockHash(hashlib.sha256(payload).digest())


def first_block_extra_keys(cache_salt: str | None, lora_id: int = 0) -> tuple[str | int, ...]:
    """Extra keys of block 0; an empty salt counts as no salt, adapter 0 is the base."""
    salt: tuple[str | int, ...] = (cache_salt,) if cache_salt else ()
    return (*salt, "lora", lora_id) if lora_id else salt


ImageSpan = tuple[int, int, str]  # (offset, length, image hash) of a placeholder run


def image_keys(spans: Sequence[ImageSpan], start: int, end: int) -> tuple[str, ...]:
    """The hashes of the images whose placeholder runs overlap tokens [start, end)."""
    return tuple(h for offset, length, h in spans if offset < end and start < offset + length)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: list[int],
    block_size: int,
    cache_salt: str | None,
    image_spans: Sequence[ImageSpan] = (),
    lora_id: int = 0,
) -> list[BlockHash]:
    """Append, in place, the hashes of the full blocks of `token_ids` not yet hashed.

    `block_hashes` must hold the hashes of the first blocks of these same tokens (tokens
    are only ever appended to a request), so the work is per new full block.
    Returns `block_hashes` for convenience.
    """
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for index in range(len(block_hashes), num_full_blocks):
        start = index * block_size
        extra = first_block_extra_keys(cache_salt, lora_id) if index == 0 else ()
        if image_spans:
            extra = (*extra, *image_keys(image_spans, start, start + block_size))
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        block_hashes.append(parent)
    return block_hashes
