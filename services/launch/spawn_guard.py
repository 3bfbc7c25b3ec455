"""A script that starts worker processes without an `if __name__ == "__main__":` guard.

Children are spawned: each fresh interpreter imports the parent's main script again
(as `__mp_main__`) before it runs its target. A script that builds a multi-rank engine
at import time builds it again in every child, which then tries to start processes of
its own while still bootstrapping. multiprocessing refuses that with a RuntimeError the
parent never sees: it would only learn that the rank "exited with code 1".

So the child checks first (`exit_if_bootstrapping`, called before any process starts)
and exits with `UNGUARDED_MAIN_EXIT`; the parent turns that code into the fix
(`unguarded_main_message`).
"""

from __future__ import annotations

import multiprocessing
import sys

UNGUARDED_MAIN_EXIT = 78  # sysexits' EX_CONFIG: the child's own configuration is wrong


def exit_if_bootstrapping() -> None:
    """In a spawned child still importing the parent's main script: exit at once."""
    # multiprocessing sets `_inheriting` while a spawned child unpickles its parent's
    # state (the main script's import included); its own bootstrapping check reads it.
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(UNGUARDED_MAIN_EXIT)


def unguarded_main_message() -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return (
        f"the worker processes run {main} again as they start (multiprocessing's spawn "
        f"method), and it started an engine again: put the code that builds the LLM "
        f'under `if __name__ == "__main__":` in {main}'
    )
