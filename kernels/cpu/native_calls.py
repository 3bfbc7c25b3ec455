"""The one door every native kernel call of a forward pass goes through.

`run(function, *args)` calls a compiled kernel (a ctypes function or a CPython
module's fast call; every kernel returns an int status, 0 = done) and returns its
status. While a recorder is installed (`recording`), it first hands the call to the
recorder: a CPU graph (gpu_worker/cpu_graphs.py) keeps the calls of one decode
forward, in order with its torch ops, and replays them without the Python around
them. Arguments are plain numbers and addresses, so a replayed call touches the very
memory the recorded one did; keeping that memory alive is the recorder's business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

NativeFunction = Callable[..., int]
Recorder = Callable[[NativeFunction, tuple[Any, ...]], None]

_recorder: Recorder | None = None


class NotReplayable(RuntimeError):
    """A forward being recorded took a route whose replay would be wrong (host data
    decides its work): the recorder runs that step eagerly instead."""


def is_recording() -> bool:
    return _recorder is not None


def run(function: NativeFunction, *args: Any) -> int:
    """`function(*args)`, recorded first when a recorder is installed."""
    if _recorder is not None:
        _recorder(function, args)
    return function(*args)


@contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """Hand every `run` call to `recorder` inside the block (never nested)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("native calls are already being recorded")
    _recorder = recorder
    try:
        yield
    finally:
        _recorder = None
