"""Scheduler -> worker: the KV connector's part of one step's plan.

The scheduler side of a KV connector decides which blocks move and under which keys;
the worker side only moves bytes. A key names one block's KV everywhere: the hex of
its block hash (the chained hash of the prefix cache, kvflow/block_hash.py), so the
same tokens under the same model always map to the same key.
"""

from __future__ import annotations

import msgspec


class KVBlockTransfer(msgspec.Struct, array_like=True, gc=False):
    """Blocks of one request to load into (or save from) the paged cache."""

    req_id: str
    block_ids: list[int]  # local block ids, position order
    keys: list[str]  # one per block id


class KVConnectorMeta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    # Loaded before the forward pass: the step computes on top of them.
    loads: list[KVBlockTransfer] = []
    # Saved after the forward pass: prompts that this step completed.
    saves: list[KVBlockTransfer] = []
