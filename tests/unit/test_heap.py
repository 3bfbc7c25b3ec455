"""Start-up objects leave the garbage collector's scans once a process serves
(kvflow/heap.py): a role's ready ack freezes them. Run in a child process, since a
freeze is for the life of the process."""

import resource
import subprocess
import sys

import pytest

_CHILD = """
import gc, weakref
from kvflow.runtime.lifecycle import LauncherLink

class Stop:
    def install(self): pass

class Node:
    pass

node = Node()
node.self = node  # a cycle: start-up garbage that only a collection frees
dead = weakref.ref(node)
del node
gc.disable()  # no collection but the one under test
before = gc.get_freeze_count()
LauncherLink(None, None, "worker", 0, Stop()).ready()
print(before, gc.get_freeze_count(), int(dead() is None))
"""


def test_ready_freezes_the_startup_heap_after_collecting_it() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    before, frozen, cycle_freed = map(int, out)
    assert before == 0 and frozen > 1000  # the imported modules' objects, at least
    assert cycle_freed  # collected before the freeze, not kept frozen forever


_MALLOC_CHILD = """
import ctypes, resource, sys
from kvflow.heap import keep_freed_memory

kept = keep_freed_memory() if sys.argv[1] == "1" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 20 << 20  # one step's activation buffer, several times over
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)  # a kernel writes it: every page is touched
    libc.free(p)
print(int(kept), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _MALLOC_CHILD, "1" if keep else "0"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()  # fmt: skip
    return int(out[0]), int(out[1])


def test_freed_buffers_are_reused_without_faulting_pages_in_again() -> None:
    kept, faults = _faults(keep=True)
    if not kept:
        pytest.skip("this C library has no mallopt (not glibc)")
    pages = (20 << 20) // resource.getpagesize()
    _, default_faults = _faults(keep=False)
    # Kept: the pages fault in once, for the first buffer. glibc's default maps the
    # first buffer, unmaps it on free, then faults the heap's copy in again.
    assert faults < 1.5 * pages <= default_faults


_LIBRARY_CHILD = """
import gc, weakref
from kvflow.heap import heap_frozen_while

class Node:
    pass

kept = Node()
kept.self = kept  # alive across the call, garbage after: like an LLM the caller drops
dead = weakref.ref(kept)
with heap_frozen_while():
    frozen = gc.get_freeze_count()
del kept
gc.collect()
print(int(frozen > 0), gc.get_freeze_count(), int(dead() is None))
"""


def test_a_library_call_thaws_what_it_froze() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _LIBRARY_CHILD], capture_output=True, text=True, check=True,
        timeout=120,
    ).stdout.split()  # fmt: skip
    froze_during, frozen_after, collected = map(int, out)
    assert froze_during and frozen_after == 0 and collected
