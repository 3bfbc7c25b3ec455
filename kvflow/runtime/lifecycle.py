"""Process life cycle shared by the service shells: stop on signals, die with the
launcher, and tell the launcher when a role is ready or has failed.

Every role (`scheduler`, `worker`, `detokenizer`) runs as::

    run_role(role, rank, launcher_address, body)   # body(context, link, stop) -> code

`body` polls `stop` between bounded waits (never a blocking wait without a timeout), so
SIGTERM/SIGINT end it cleanly once it is ready (`link.ready()`); before that they end
the process at once. An exception escaping `body` is reported to the launcher as
`ProcessFailed` and becomes exit code 1. At exit, only sockets closed with
`close_flushing` get time to deliver their last messages. Run standalone (compose),
there is no launcher and the link sends nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

import zmq

from kvflow.errors import KvflowError
from kvflow.heap import freeze_startup_heap
from kvflow.proto.control import ProcessFailed, ProcessReady
from kvflow.runtime.sockets import TypedSocket

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
# Final messages (acks, failures, dead-engine notices) get this long to leave on close.
FLUSH_LINGER_MS = 1000


class StopFlag:
    """Set by SIGTERM/SIGINT (or by code); loops check it between bounded waits."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self) -> StopFlag:
        """Handle SIGTERM and SIGINT in this (main) thread by setting the flag.

        A signal ignored on entry stays ignored (the launcher's children ignore SIGINT).
        """
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        logger.info("received %s: stopping", signal.Signals(signum).name)
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


class LauncherLink:
    """PUSH to the launcher's ack socket (sends nothing when `address` is None)."""

    def __init__(
        self, context: zmq.Context, address: str | None, role: str, rank: int, stop: StopFlag
    ) -> None:
        self.role, self.rank = role, rank
        self._stop = stop
        self._socket = TypedSocket.open(context, zmq.PUSH, address, bind=False) if address else None

    def ready(self, **info: float) -> None:
        """Ack; from now on SIGTERM/SIGINT stop the loop cleanly. Before, they end the
        process at once: a role still loading has nothing to clean up. What start-up
        allocated leaves the garbage collector's scans (kvflow/heap.py)."""
        freeze_startup_heap()
        self._stop.install()
        if self._socket is not None:
            self._socket.send(ProcessReady(self.role, self.rank, os.getpid(), dict(info)))

    def failed(self, error: str) -> None:
        if self._socket is not None:
            self._socket.send(ProcessFailed(self.role, self.rank, error))

    def close(self) -> None:
        if self._socket is not None:
            close_flushing(self._socket)


def close_flushing(socket: TypedSocket, linger_ms: int = FLUSH_LINGER_MS) -> None:
    """Close after giving queued messages up to `linger_ms` to reach a connected peer."""
    socket.socket.close(linger=linger_ms)


def run_role(
    role: str,
    rank: int,
    launcher_address: str | None,
    body: Callable[[zmq.Context, LauncherLink, StopFlag], int],
) -> int:
    """Run one service body with signal handling and failure reporting; the exit code."""
    stop = StopFlag()
    context = zmq.Context()
    link = LauncherLink(context, launcher_address, role, rank, stop)
    try:
        return body(context, link, stop)
    except KeyboardInterrupt:  # Ctrl-C of a standalone role that was still starting
        return 130
    except KvflowError as exc:  # an expected failure: its message says it all
        logger.error("%s rank %d failed: %s", role, rank, exc)
        link.failed(str(exc))
        return 1
    except Exception as exc:
        logger.exception("%s rank %d failed", role, rank)
        link.failed(f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        link.close()
        # Sockets closed with close_flushing() still get their linger; the rest none
        # (a peer that is gone would otherwise hold every exit for the linger).
        context.destroy(linger=0)


def set_process_name(name: str) -> None:
    """The name `ps` and /proc/<pid>/comm show (Linux; at most 15 bytes)."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def die_with_parent(parent_pid: int) -> None:
    """Get SIGTERM when the launcher dies, so no child outlives it (Linux prctl).

    Checked once more after arming: a parent that died before `prctl` took effect would
    never send the signal.
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        logger.error("the launcher (pid %d) is gone; exiting", parent_pid)
        os._exit(1)


def _prctl(option: int, arg: object) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        logger.warning("prctl(%d) failed: errno %d", option, ctypes.get_errno())
