"""Heap policy of the serving processes: the garbage collector and malloc.

The start-up heap leaves the garbage collector's scans once a process serves. A full
collection walks every tracked object: ~300k once torch, transformers and a model
are loaded, 150-450 ms on a 2-core CPU. Python runs one whenever enough objects have
survived younger collections, which in a serving loop lands inside a step: a stall of
several decode steps in one inter-token gap. Frozen objects are never scanned again; the
ones a loop allocates later still are, so cycles made while serving are still freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect start-up garbage once (so it is not kept forever), then freeze the rest."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug(
        "froze %d start-up objects in %.0f ms",
        gc.get_freeze_count(),
        (time.perf_counter() - start) * 1e3,
    )


@contextlib.contextmanager
def heap_frozen_while() -> Iterator[None]:
    """The objects alive on entry leave the collector's scans until exit: for a library
    call that runs many steps (`LLM.generate`) in a process that is not only serving.
    Freezing for good there would keep whatever becomes cyclic garbage later (an `LLM`
    the caller drops) forever; thawing on exit hands it back to the collector."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit
_TRIM_THRESHOLD = 1 << 30
_TOP_PAD = 256 << 20


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    A model step allocates and frees the same activation buffers (MBs each) every layer.
    By default glibc maps large ones fresh or trims the heap after freeing them, so the
    next step faults every page in again and the kernel zeroes it: ~8% of a 2,048-token
    prefill's CPU time, measured. Buffers up to 32 MB now come from the heap, which grows
    in 256 MB steps and keeps up to 1 GiB free. False where the C library has no
    mallopt (not glibc); nothing changes there.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    ok &= mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    ok &= mallopt(_M_TOP_PAD, _TOP_PAD)
    return bool(ok)
