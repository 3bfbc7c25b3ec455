"""One typed ZeroMQ socket wrapper: msgspec MessagePack in, msgspec MessagePack out.

No pickle, no reflective fallback: a frame that does not decode as the declared type
raises `msgspec.ValidationError`/`DecodeError`, which the receiving service logs and
drops (a malformed frame never kills a loop).

Every socket gets the limits and, on tcp://, the CURVE keys of kvflow/runtime/cluster_auth.py.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from kvflow.runtime.cluster_auth import MAX_MESSAGE_BYTES, secure_socket

RecvT = TypeVar("RecvT")


class TypedSocket(Generic[RecvT]):
    """A zmq socket that sends msgspec Structs and decodes frames as `recv_type`."""

    def __init__(
        self, socket: zmq.Socket, recv_type: Any = None, monitor: zmq.Socket | None = None
    ) -> None:
        self.socket = socket
        self.monitor = monitor  # PAIR socket of the events `open(monitor_events=)` asked for
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(recv_type) if recv_type is not None else None

    @classmethod
    def open(
        cls,
        context: zmq.Context,
        kind: int,
        address: str,
        *,
        bind: bool,
        recv_type: Any = None,
        identity: bytes | None = None,
        subscribe: bytes | None = None,
        monitor_events: int = 0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> TypedSocket[Any]:
        socket = context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        address = secure_socket(socket, address, bind=bind, max_message_bytes=max_message_bytes)
        if identity is not None:
            socket.setsockopt(zmq.IDENTITY, identity)
        if subscribe is not None:
            socket.setsockopt(zmq.SUBSCRIBE, subscribe)
        # Attached before connecting: the first connection's events are not missed.
        monitor = socket.get_monitor_socket(monitor_events) if monitor_events else None
        if bind:
            socket.bind(address)
        else:
            socket.connect(address)
        return cls(socket, recv_type, monitor)

    def send(self, message: msgspec.Struct, *, to: bytes | None = None) -> None:
        """Send one message; `to` is the peer identity on a ROUTER socket."""
        payload = self._encoder.encode(message)
        if to is None:
            self.socket.send(payload, copy=False)
        else:
            self.socket.send_multipart([to, payload], copy=False)

    def recv(self, timeout_ms: int | None = None) -> RecvT | None:
        """Next message, or None if nothing arrived within `timeout_ms` (None = wait)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        frames = self.socket.recv_multipart(copy=False)
        return self.decode(frames[-1].buffer)

    async def arecv(self) -> RecvT:
        """For sockets made from a `zmq.asyncio.Context`."""
        assert isinstance(self.socket, zmq.asyncio.Socket), "arecv needs an asyncio socket"
        frames = await self.socket.recv_multipart(copy=False)
        return self.decode(frames[-1].buffer)

    def decode(self, payload: Any) -> RecvT:
        assert self._decoder is not None, "this socket only sends"
        return self._decoder.decode(payload)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        self.socket.close(linger=0)
