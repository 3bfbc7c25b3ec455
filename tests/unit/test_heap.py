"""Start-up objects leave the garbage collector's scans once a process serves
(kvflow/heap.py): a role's ready ack freezes them. Run in a child process, since a
freeze is for the life of the process."""

import subprocess
import sys

_CHILD = """
import gc, weakref
from kvflow.proto.lifecycle import LauncherLink

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
