"""The transfer keys of a prompt's blocks: its prefix-cache hashes, plus one for the tail.

    prompt   | t0 .. t15 | t16 .. t31 | t32 .. t36 |
    keys       hex(h0)     hex(h1)      hex(H(h1, t32..t36, ("partial",)))

Full blocks use the prefix cache's own chained hashes, so a saved block is found again
by any request sharing that prefix (the shared-storage connector doubles as a disk
prefix cache). The partial last block gets a key of its own, marked so that it can
never equal a full block's: a decode instance then loads the whole prompt's KV and
computes only the prompt's last token, whose logits it needs to sample.

With a cluster secret every key is an HMAC of that hash under the secret: the hashes are
a function of the token ids alone, so unsalted keys would let anyone who guesses a
prompt confirm that it was sent (and name its blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.block_hash import (
    BlockHash,
    ImageSpan,
    extend_block_hashes,
    first_block_extra_keys,
    hash_block_tokens,
    image_keys,
)
from kvflow.cluster_secret import ClusterSecret


def prompt_block_keys(
    prompt_token_ids: list[int],
    block_size: int,
    cache_salt: str | None,
    secret: ClusterSecret | None = None,
    image_spans: Sequence[ImageSpan] = (),
    lora_id: int = 0,
) -> list[str]:
    """One key per block the prompt touches (the last one partial unless aligned);
    blocks over an image's placeholders carry its hash, and the LoRA adapter keys them,
    as in the prefix cache (an adapter's KV is its own)."""
    hashes: list[BlockHash] = extend_block_hashes(
        [], prompt_token_ids, block_size, cache_salt, image_spans, lora_id
    )
    keys = [h.hex() for h in hashes]
    num_full = len(hashes)
    tail = prompt_token_ids[num_full * block_size :]
    if tail:
        parent = hashes[-1] if hashes else None
        extra = first_block_extra_keys(cache_salt, lora_id) if num_full == 0 else ()
        start = num_full * block_size
        extra = (*extra, *image_keys(image_spans, start, len(prompt_token_ids)))
        keys.append(hash_block_tokens(parent, tail, (*extra, "partial")).hex())
    return keys if secret is None else [secret.salt_block_key(key) for key in keys]
