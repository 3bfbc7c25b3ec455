"""A compact picture of the KV block pool for the web UI (`SchedulerStats.kv_block_map`).

Block ids are cut into at most `MAX_BUCKETS` runs of consecutive ids; each bucket says
what share of its blocks is used (referenced by a request) or cached (free but holding
a reusable prefix). The stats go out every 0.5 s from the scheduler's own thread, so
the cost is bounded whatever the pool size: at most `MAX_SAMPLES` blocks are read
(evenly spaced within each bucket), ~0.3 ms; pools up to that size are exact.

    block ids   0 1 2 3 | 4 5 6 7 | ...        (bucket = 4 blocks here)
    ref_cnt     1 1 0 0 | 0 0 0 0
    hashed      . . h . | . . . .
    -> used      50     |  0
       cached    25     |  0
"""

from __future__ import annotations

from kvflow.proto.stats import KVBlockMap
from kvflow.services.scheduler.block_pool import BlockPool

MAX_BUCKETS = 256
MAX_SAMPLES = 4096


def block_map(
    pool: BlockPool, max_buckets: int = MAX_BUCKETS, max_samples: int = MAX_SAMPLES
) -> KVBlockMap:
    num_blocks = pool.num_blocks
    num_buckets = min(num_blocks, max_buckets)
    per_bucket = max(1, max_samples // num_buckets)
    used: list[int] = []
    cached: list[int] = []
    for bucket in range(num_buckets):
        start = bucket * num_blocks // num_buckets
        end = (bucket + 1) * num_blocks // num_buckets
        stride = max(1, (end - start) // per_bucket)
        sampled = pool.blocks[start:end:stride]
        n_used = sum([block.ref_cnt > 0 for block in sampled])
        n_cached = sum([block.ref_cnt == 0 and block.block_hash is not None for block in sampled])
        used.append(round(100 * n_used / len(sampled)))
        cached.append(round(100 * n_cached / len(sampled)))
    return KVBlockMap(num_blocks, used, cached)
