"""`kvflow bench kv-transfer`: the zmq KV connector's throughput against a plain copy.

A producer and a consumer worker connector (kvflow/kv_transfer/worker/zmq_connector.py)
run in this process over loopback TCP, on KV caches shaped like the model's (random
contents; no weights are loaded). One round moves a prompt of --prompt-tokens:

    save   gather the prompt's blocks out of the producer's paged cache into its buffer
    pull   consumer asks, producer sends the raw frames, consumer scatters them into
           its own paged cache (what a decode instance waits for)

and the reference is one `copy_` of the same number of bytes between two host tensors
(this machine's copy bandwidth). Reported: GB/s of each (1 GB = 1e9 bytes), median of
--rounds.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Any

from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.runtime.cluster_args import ensure_local_secret


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model whose KV shape to use (embedded)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="the cache's storage (auto = --dtype; the 8-bit formats add a scale per row)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvflow.gpu_worker.kv_cache import KVCacheSpec, allocate_kv_cache, kv_storage_dtype
    from kvflow.gpu_worker.model_files import resolve_model_dir
    from kvflow.gpu_worker.model_loader import load_hf_config
    from kvflow.proto.kv_transfer import KVBlockTransfer, KVConnectorMeta

    ensure_local_secret()  # the two connectors talk CURVE over loopback tcp
    model_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    dtype = kv_storage_dtype(args.kv_cache_dtype, model_dtype)
    spec = KVCacheSpec.from_hf_config(
        load_hf_config(resolve_model_dir(args.model)), args.block_size, dtype
    )
    num_blocks = -(-args.prompt_tokens // args.block_size)
    caches = [allocate_kv_cache(spec, num_blocks, torch.device("cpu")) for _ in range(2)]
    for cache in caches[0]:  # any bytes: the transfer never reads them as numbers
        cache.view(torch.uint8).random_()
    producer, consumer, address = _connectors(caches)
    keys = [f"{i:064x}" for i in range(num_blocks)]
    block_ids = list(range(num_blocks))
    total = num_blocks * spec.bytes_per_block
    save_s, pull_s, copy_s = [], [], []
    source = torch.empty(total, dtype=torch.uint8).random_()  # the memcpy baseline
    target = torch.empty_like(source)
    for round_index in range(args.rounds):
        round_keys = [f"{round_index}{k[1:]}" for k in keys]
        meta = KVConnectorMeta(saves=[KVBlockTransfer("r", block_ids, round_keys)])
        start = time.perf_counter()
        producer.wait_for_save(meta)
        save_s.append(time.perf_counter() - start)
        load = KVBlockTransfer("r", block_ids, round_keys, address)
        start = time.perf_counter()
        consumer.start_load_kv(KVConnectorMeta(loads=[load]))
        stats = _await_load(consumer)
        pull_s.append(time.perf_counter() - start)
        assert stats.finished_loading == ["r"], stats
        start = time.perf_counter()
        target.copy_(source)
        copy_s.append(time.perf_counter() - start)
    same = (torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*caches))
    assert all(same), "KV differs"
    producer.close()
    consumer.close()
    mb = total / 1e6
    print(f"KV of {args.prompt_tokens} tokens: {num_blocks} blocks, {mb:.1f} MB ({dtype})")
    for name, times in (("save", save_s), ("pull", pull_s), ("memcpy", copy_s)):
        median = statistics.median(times)
        print(f"{name:>7}: {median * 1e3:8.1f} ms  {total / median / 1e9:6.2f} GB/s")
    return 0


def _connectors(caches: list[Any]) -> tuple[Any, Any, str]:
    """A producer serving on a free loopback port, a consumer, and the producer's address."""
    from kvflow.kv_transfer.worker.zmq_connector import ZmqWorker

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    extra = {"kv_port": port, "kv_buffer_bytes": 1 << 34}
    producer = ZmqWorker(KVTransferConfig("kv_producer", "zmq", extra), caches[0], 30.0)
    consumer = ZmqWorker(KVTransferConfig("kv_consumer", "zmq"), caches[1], 30.0)
    return producer, consumer, f"tcp://127.0.0.1:{port}"


def _await_load(consumer: Any) -> Any:
    while True:
        consumer.wait_for_loads(0.001)
        stats = consumer.take_stats()
        if stats.finished_loading or stats.failed_loading:
            return stats
