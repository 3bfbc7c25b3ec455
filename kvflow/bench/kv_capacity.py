"""`kvflow bench kv-capacity`: what the hybrid KV cache saves on a Gemma-3-shaped model.

Builds a Gemma 3 text model of Gemma-3-1B's shapes (26 layers, every 6th global, one KV
head of 256, a sliding window of `--sliding-window` on the local layers) with random
weights (`--load-format dummy`: config.json + the embedded tokenizer, written once
under the cache directory), starts the engine twice, with the hybrid KV cache and
without it (every layer keeps every block), and reports from each engine's own sizing
(`--kv-cache-memory`, the worker's bytes per block) and its own allocator:

* the KV bytes one `--input-len`-token request holds once its prompt is prefilled (in
  chunks of `--max-num-batched-tokens`, as the scheduler allocates them) and its first
  decode step allocated (a sliding group releases the blocks that left its window at
  an allocation: until then it still holds the last chunk's), and
* how many such requests fit in the cache at once (each prefilled and decoding while
  the earlier ones stay, until the pool refuses the next chunk).

No forward pass runs: the figures are the allocator's, which is what decides admission
and preemption. Measured figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GEMMA3_1B: dict[str, Any] = dict(
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=262144,
    query_pre_attn_scalar=256,
    max_position_embeddings=32768,
)
GLOBAL_EVERY = 6  # layers 5, 11, 17, 23 are global (5 local : 1 global)


@dataclass
class Capacity:
    hybrid: bool
    kv_groups: int
    num_blocks: int
    bytes_per_block: int
    request_kv_bytes: int  # held by one request after its prefill and first decode
    concurrent_requests: int  # such requests that fit at once


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=8192, help="tokens per request")
    parser.add_argument("--sliding-window", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", type=float, default=4.0, help="GiB of KV cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def model_dir(window: int) -> Path:
    """config.json of the Gemma-3-1B shapes with this window + the embedded tokenizer."""
    from transformers import AutoTokenizer, Gemma3TextConfig

    from kvflow.cache_dir import default_cache_dir
    from kvflow.gpu_worker.model_files import resolve_model_dir

    path = default_cache_dir() / "bench" / f"gemma3-1b-shapes-w{window}"
    if not (path / "config.json").exists():
        layers = GEMMA3_1B["num_hidden_layers"]
        types = [
            "full_attention" if i % GLOBAL_EVERY == GLOBAL_EVERY - 1 else "sliding_attention"
            for i in range(layers)
        ]
        config = Gemma3TextConfig(**GEMMA3_1B, sliding_window=window, layer_types=types)
        config.architectures = ["Gemma3ForCausalLM"]
        config.save_pretrained(path)
        AutoTokenizer.from_pretrained(str(resolve_model_dir(None))).save_pretrained(path)
    return path


def prefill(kv_cache: Any, request_id: str, num_tokens: int, chunk: int) -> bool:
    """Allocate a request's prompt chunk by chunk, then its first decode token; False
    when the pool refuses one."""
    request = _Request(request_id, list(range(num_tokens + 1)))
    while request.num_computed_tokens < num_tokens:
        step = min(chunk, num_tokens - request.num_computed_tokens)
        if kv_cache.allocate_slots(request, step) is None:
            return False
        request.num_computed_tokens += step
    return kv_cache.allocate_slots(request, 1) is not None


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None


def measure(path: Path, hybrid: bool, args: argparse.Namespace) -> Capacity:
    from kvflow.offline.llm import LLM
    from kvflow.services.scheduler.kv_cache_manager import KVCacheManager

    llm = LLM(
        model=str(path), load_format="dummy", dtype=args.dtype, device="cpu",
        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, hybrid_kv_cache=hybrid,
        max_model_len=args.input_len + 2, enforce_eager=True,
    )  # fmt: skip
    runner = llm.engine.runner
    num_blocks, bytes_per_block = runner.num_blocks, runner.kv_spec.bytes_per_block
    windows = runner.kv_layout.windows
    llm.close()
    del llm, runner
    gc.collect()
    # A fresh allocator like the engine's (no prefix caching: distinct prompts).
    kv_cache = KVCacheManager(num_blocks, args.block_size, False, group_windows=windows)
    assert prefill(kv_cache, "one", args.input_len, args.max_num_batched_tokens)
    held = num_blocks - kv_cache.num_free_blocks
    kv_cache.free("one")
    fits = 0
    while prefill(kv_cache, f"r{fits}", args.input_len, args.max_num_batched_tokens):
        fits += 1
    kv_cache.check_integrity()
    return Capacity(hybrid, len(windows), num_blocks, bytes_per_block, held * bytes_per_block, fits)


def run(args: argparse.Namespace) -> int:
    path = model_dir(args.sliding_window)
    results = [measure(path, hybrid, args) for hybrid in (True, False)]
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
        return 0
    print(
        f"Gemma-3-1B shapes, window {args.sliding_window}, {args.input_len}-token requests, "
        f"--kv-cache-memory {args.kv_cache_memory} GiB, {args.dtype}, block {args.block_size}"
    )
    print(f"{'KV cache':<22}{'groups':>7}{'blocks':>9}{'MiB/request':>13}{'requests':>10}")
    for r in results:
        name = "hybrid" if r.hybrid else "all layers full"
        mib = r.request_kv_bytes / (1 << 20)
        print(f"{name:<22}{r.kv_groups:>7}{r.num_blocks:>9}{mib:>13.1f}{r.concurrent_requests:>10}")
    hybrid, full = results
    print(
        f"hybrid / full: {hybrid.request_kv_bytes / full.request_kv_bytes:.3f} of the bytes "
        f"per request, {hybrid.concurrent_requests / max(full.concurrent_requests, 1):.2f}x "
        "the requests"
    )
    return 0
