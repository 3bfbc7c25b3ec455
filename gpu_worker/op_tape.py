"""A recorded CPU forward pass, replayed without the Python that ran it.

`OpTape.record(fn)` runs `fn()` once, eagerly, and keeps every operation that did work,
in order: the native kernel calls (kernels/cpu/native_calls.py) and the torch ops that
computed something (seen by a TorchDispatchMode). `replay()` runs that list again. No
module, launcher, shape check or route decision runs in a replay: at one decode row a
step is ~300 kernel calls of a few microseconds each, and the Python around them cost as
much as the kernels (docs/benchmarks.md, "CPU decode graphs").

What a replay is allowed to assume, and how recording enforces it:
- Memory: every tensor the recording created or touched is kept alive by the tape, so
  the addresses in the native calls stay valid; a replay writes the same memory.
- Inputs: a replay reads what the recorded ops read, so new data reaches it only in
  place, through tensors the caller owns (static input buffers).
- Torch ops: one that wrote an argument in place is replayed as it was called; one that
  returned fresh tensors is called again and its result copied into the recorded
  outputs (which later ops read); views and allocations need no replay.
- No data-dependent decision: an op that hands tensor data to Python (`.item()`,
  `bool(t)`, `nonzero`, ...) raises `DataDependentOp`, since the branch it fed would be
  frozen into the tape. Such work (validation, plans) belongs before recording.
  `.tolist()` and `.numpy()` bypass the dispatcher and go unseen: the graph tests
  compare replays with eager steps (tests/e2e/test_cpu_decode_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvflow.kernels.cpu import native_calls

# Ops that only allocate: their memory is kept, nothing to redo.
_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty_strided.default,
}
# Ops whose result (a value or a shape) depends on tensor data.
_DATA_DEPENDENT = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
}


class DataDependentOp(RuntimeError):
    """A recorded forward read tensor data on the host: it cannot be replayed."""


class _TorchCall:
    """One torch op of the tape: `__call__` redoes it and returns 0 (a native status)."""

    def __init__(self, func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor]):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outputs = outputs  # where a fresh result is copied; empty: in place

    def __call__(self) -> int:
        result = self.func(*self.args, **self.kwargs)
        for recorded, fresh in zip(self.outputs, tree_leaves(result)):
            recorded.copy_(fresh)
        return 0


def _storage(t: Any) -> int | None:
    if isinstance(t, torch.Tensor) and t.layout == torch.strided:
        return t.untyped_storage().data_ptr()
    return None


def _writes_an_argument(func: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


class _TorchOps(TorchDispatchMode):
    """Appends the torch ops that did work to the tape, keeps every tensor alive."""

    def __init__(self, tape: OpTape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT:
            raise DataDependentOp(f"{func} reads tensor data during a recorded forward")
        result = func(*args, **kwargs)
        self.tape.keep.append((args, kwargs, result))
        outputs = tree_leaves(result)
        if func in _ALLOCATIONS:
            self.tape.count_allocation(outputs)
            return result
        if not all(isinstance(t, torch.Tensor) for t in outputs):
            raise DataDependentOp(f"{func} returned host values during a recorded forward")
        if _writes_an_argument(func):
            self.tape.calls.append((_TorchCall(func, args, kwargs, []), ()))
            return result
        inputs = {_storage(t) for t in tree_leaves((args, kwargs))} - {None}
        if all(_storage(t) in inputs for t in outputs):
            return result  # a view (or the input itself): reads through it see new data
        self.tape.count_allocation(outputs)
        self.tape.calls.append((_TorchCall(func, args, kwargs, outputs), ()))
        return result


class OpTape:
    """See the module docstring."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., int], tuple[Any, ...]]] = []
        self.keep: list[Any] = []  # every tensor of the recording, alive while the tape is
        self.output: Any = None  # what the recorded function returned (replays rewrite it)
        self._allocated: dict[int, int] = {}  # storage address -> bytes, made while recording

    def record(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` once, recording its work; returns what it returned."""
        if self.calls:
            raise RuntimeError("a tape records once")

        def native(function: Callable[..., int], args: tuple[Any, ...]) -> None:
            self.calls.append((function, args))

        with native_calls.recording(native), _TorchOps(self):
            self.output = fn()
        return self.output

    @property
    def nbytes(self) -> int:
        """Memory the recording allocated, held by the tape."""
        return sum(self._allocated.values())

    def count_allocation(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.layout == torch.strided:
                storage = t.untyped_storage()
                self._allocated[storage.data_ptr()] = storage.nbytes()

    def replay(self) -> None:
        for function, args in self.calls:
            status = function(*args)
            if status != 0:
                raise RuntimeError(f"native kernel {function} failed in a replay: {status}")
