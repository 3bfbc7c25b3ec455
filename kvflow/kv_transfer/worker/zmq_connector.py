"""The zmq connector, worker side: KV blocks as raw multipart frames between instances.

Producer: during the forward that completes a prompt, its blocks are copied out of the
paged cache layer by layer (layer_save.py), then kept in a buffer (keyed by block key)
from which a server thread answers pulls::

    consumer DEALER ──KVPull(req_id, keys)──▶ producer ROUTER (tcp://kv_host:kv_port)
                    ◀── KVBlocksHeader(req_id, keys, dtype, shape), block 0, block 1 …

Both ends use the cluster's CURVE keys (kvflow/runtime/cluster_auth.py): only a process
holding the cluster secret may pull, and a frame larger than one block is refused.

Each block frame is `[num_layers, 2, block_size, kv_heads, head_dim]` raw bytes (the
header names dtype and shape; msgpack for the header, never pickle). The copy out of
the cache is what lets the producer free its blocks when the request ends, whether or
not a consumer ever comes; it is one memcpy per block (a device-to-host copy on GPU,
which sending from host memory needs anyway).

Consumer: a pull thread takes the loads of each plan, asks the named producer, and
writes each frame straight into the blocks the scheduler allocated (no extra copy:
the tensor views the received frame). It waits `kv_load_timeout` seconds for the
answer; a producer that is gone, answers late or lacks a block makes the load fail.
Either way the request id is reported in the next StepResult, and only then does the
scheduler free or reuse the blocks, so the thread never writes into a reused block.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any

import msgspec
import torch
import zmq

from kvflow.errors import ConfigError
from kvflow.kv_transfer.worker.block_io import layout_mismatch, scatter_blocks
from kvflow.kv_transfer.worker.connector import KVConnectorWorker
from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.proto.kv_transfer import (
    KVBlocksHeader,
    KVBlockTransfer,
    KVConnectorMeta,
    KVPull,
    KVTransferStepStats,
)
from kvflow.runtime.cluster_auth import cluster_settings, secure_socket

logger = logging.getLogger(__name__)

_POLL_MS = 100
# A KVBlocksHeader or KVPull names every block of a prompt (~70 bytes a key): 16 MiB is
# over 200,000 blocks, more than any prompt has.
_MAX_HEADER_BYTES = 16 << 20
_encoder = msgspec.msgpack.Encoder()
_pull_decoder = msgspec.msgpack.Decoder(KVPull)
_header_decoder = msgspec.msgpack.Decoder(KVBlocksHeader)


class ZmqWorker(KVConnectorWorker):
    def __init__(
        self, config: KVTransferConfig, caches: list[torch.Tensor], load_timeout_s: float
    ) -> None:
        super().__init__(caches)
        refusal = cluster_settings().tcp_refusal("the zmq KV connector")
        if refusal is not None:  # here, not in the server thread or at the first pull
            raise ConfigError(refusal)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.load_timeout_s = load_timeout_s
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._outcomes = KVTransferStepStats()  # filled by the pull thread
        self._outcome_ready = threading.Event()
        self._buffer = _BlockBuffer(config.kv_buffer_bytes)
        self._threads: list[threading.Thread] = []
        if config.is_producer:
            address = f"tcp://{config.kv_host}:{config.kv_port}"
            self._start(self._serve, address)
        self._jobs: queue.Queue[KVBlockTransfer] = queue.Queue()
        if config.is_consumer:
            self._start(self._pull_loop)

    def _start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="kv-zmq", daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        super().close()

    # ---- the step's side -------------------------------------------------------------

    def start_load_kv(self, meta: KVConnectorMeta) -> None:
        for transfer in meta.loads:  # in the background: the step does not wait
            self._jobs.put(transfer)

    def wait_for_loads(self, timeout_s: float) -> None:
        if self._outcome_ready.wait(timeout_s):
            self._outcome_ready.clear()

    def take_stats(self) -> KVTransferStepStats:
        stats = super().take_stats()
        with self._lock:
            outcomes, self._outcomes = self._outcomes, KVTransferStepStats()
        stats.bytes_loaded += outcomes.bytes_loaded
        stats.load_s += outcomes.load_s
        stats.finished_loading = outcomes.finished_loading
        stats.failed_loading = outcomes.failed_loading
        return stats

    def _load(self, meta: KVConnectorMeta) -> int:
        raise AssertionError("zmq loads run in the pull thread")

    def _store(self, transfers: list[KVBlockTransfer], blocks: torch.Tensor) -> int:
        num_bytes = 0
        keys = [key for transfer in transfers for key in transfer.keys]
        for index, key in enumerate(keys):
            payload = blocks[index].view(torch.uint8).numpy()  # sent as is: zero-copy
            self._buffer.put(key, payload)
            num_bytes += payload.nbytes
        return num_bytes

    # ---- producer: the server thread ------------------------------------------------

    @property
    def max_frame_bytes(self) -> int:
        """The largest legitimate frame: one block, or a header naming many blocks."""
        block = self.dtype.itemsize
        for size in self.block_shape:
            block *= size
        return max(block, _MAX_HEADER_BYTES)

    def _serve(self, address: str) -> None:
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        address = secure_socket(socket, address, bind=True, max_message_bytes=self.max_frame_bytes)
        socket.bind(address)
        logger.info("KV producer serving blocks at %s", address)
        try:
            while not self._stop.is_set():
                if not socket.poll(_POLL_MS):
                    continue
                identity, payload = socket.recv_multipart()
                pull = _pull_decoder.decode(payload)
                keys, frames = self._buffer.take_run(pull.keys)
                header = KVBlocksHeader(pull.req_id, keys, self.dtype_name, self.block_shape)
                socket.send_multipart([identity, _encoder.encode(header), *frames], copy=False)
        finally:
            socket.close()

    # ---- consumer: the pull thread --------------------------------------------------

    def _pull_loop(self) -> None:
        while not self._stop.is_set():
            try:
                transfer = self._jobs.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            start = time.perf_counter()
            try:
                num_bytes = self._pull(transfer)
            except Exception as exc:  # one failed load must not end the worker
                logger.warning("KV pull for request %s failed: %s", transfer.req_id, exc)
                self._record(transfer.req_id, None, 0.0)
            else:
                self._record(transfer.req_id, num_bytes, time.perf_counter() - start)

    def _pull(self, transfer: KVBlockTransfer) -> int:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)  # a late answer dies with the socket
        try:
            socket.connect(
                secure_socket(
                    socket, transfer.remote, bind=False, max_message_bytes=self.max_frame_bytes
                )
            )
            socket.send(_encoder.encode(KVPull(transfer.req_id, transfer.keys)))
            if not socket.poll(int(self.load_timeout_s * 1000)):
                raise TimeoutError(f"no answer from {transfer.remote} in {self.load_timeout_s} s")
            header_frame, *frames = socket.recv_multipart(copy=False)
        finally:
            socket.close()
        header = _header_decoder.decode(header_frame.buffer)
        if header.keys != transfer.keys:
            raise LookupError(
                f"{transfer.remote} holds {len(header.keys)} of {len(transfer.keys)} blocks"
            )
        if header.dtype != self.dtype_name or header.shape != self.block_shape:
            raise ValueError(
                layout_mismatch(header.shape, header.dtype, self.block_shape, self.dtype_name)
            )
        # One staging copy joins the frames, then one indexed copy per layer writes
        # them (per-block, per-layer copies cost more in call overhead than in bytes).
        staging = torch.empty([len(frames), *self.block_shape], dtype=self.dtype)
        flat = staging.view(len(frames), -1).view(torch.uint8)
        for index, frame in enumerate(frames):
            with warnings.catch_warnings():  # read-only frame: only ever copied from
                warnings.simplefilter("ignore", UserWarning)
                flat[index].copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))
        scatter_blocks(self.caches, transfer.block_ids, staging)
        return staging.numel() * staging.element_size()

    def _record(self, req_id: str, num_bytes: int | None, seconds: float) -> None:
        with self._lock:
            if num_bytes is None:
                self._outcomes.failed_loading.append(req_id)
            else:
                self._outcomes.finished_loading.append(req_id)
                self._outcomes.bytes_loaded += num_bytes
                self._outcomes.load_s += seconds
        self._outcome_ready.set()


class _BlockBuffer:
    """Blocks a producer keeps for consumers to pull, oldest dropped past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[str, Any] = OrderedDict()  # key -> uint8 numpy array
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, payload: Any) -> None:
        with self._lock:
            old = self._blocks.pop(key, None)
            self._bytes -= old.nbytes if old is not None else 0
            self._blocks[key] = payload
            self._bytes += payload.nbytes
            while self._bytes > self.max_bytes and len(self._blocks) > 1:
                _, dropped = self._blocks.popitem(last=False)
                self._bytes -= dropped.nbytes

    def take_run(self, keys: list[str]) -> tuple[list[str], list[Any]]:
        """The leading run of `keys` held here, and their payloads (kept: another
        request with the same prefix may pull them too)."""
        found, frames = [], []
        with self._lock:
            for key in keys:
                payload = self._blocks.get(key)
                if payload is None:
                    break
                self._blocks.move_to_end(key)
                found.append(key)
                frames.append(payload)
        return found, frames
