"""The op tape of CPU decode graphs (gpu_worker/op_tape.py): what a replay redoes, what
it skips, and what recording refuses."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvflow.gpu_worker.op_tape import DataDependentOp, OpTape
from kvflow.kernels.cpu import native_calls


def _fill_bytes(address: int, value: int, nbytes: int) -> int:
    """A stand-in for a native kernel: writes memory by address, invisible to torch."""
    ctypes.memset(address, value, nbytes)
    return 0


def test_a_replay_redoes_native_calls_and_fresh_torch_results_from_new_inputs() -> None:
    x = torch.zeros(4, dtype=torch.uint8)  # the "static input"

    def forward() -> torch.Tensor:
        native_calls.run(_fill_bytes, x.data_ptr(), 3, 2)  # x[:2] = 3, in place
        return (x.float() * 2).view(2, 2)  # fresh results, then a view of them

    tape = OpTape()
    out = tape.record(forward)
    assert out.flatten().tolist() == [6, 6, 0, 0]
    x[2:] = 5  # new input data, in place
    tape.replay()
    assert tape.output is out  # the replay rewrote the recorded output
    assert out.flatten().tolist() == [6, 6, 10, 10]
    assert len(tape.calls) == 3  # the native call, the cast, the product; not the view


def test_in_place_ops_are_replayed_as_called_and_views_read_new_data() -> None:
    acc = torch.zeros(3)
    x = torch.ones(3)

    def forward() -> torch.Tensor:
        acc.add_(x[:3])  # a view feeding an in-place op
        return acc

    tape = OpTape()
    tape.record(forward)
    x.fill_(2.0)
    tape.replay()
    assert acc.tolist() == [3.0, 3.0, 3.0]


def test_the_tape_keeps_the_memory_native_calls_address() -> None:
    def forward() -> torch.Tensor:
        scratch = torch.empty(1 << 16, dtype=torch.uint8)  # dropped by the forward
        native_calls.run(_fill_bytes, scratch.data_ptr(), 7, scratch.numel())
        return torch.zeros(1)

    tape = OpTape()
    tape.record(forward)
    assert tape.nbytes >= 1 << 16  # held, so replaying the memset writes live memory
    tape.replay()


@pytest.mark.parametrize(
    "read",
    [
        lambda x: float(x.sum()),  # .item()
        lambda x: x.nonzero(),  # a shape that depends on the data
        lambda x: bool(x.max() > 2),  # a branch on the data
    ],
)
def test_a_forward_that_reads_tensor_data_is_refused(read: object) -> None:
    x = torch.arange(4.0)
    with pytest.raises(DataDependentOp):
        OpTape().record(lambda: read(x))  # type: ignore[operator]


def test_recordings_do_not_nest_and_a_tape_records_once() -> None:
    tape = OpTape()
    with native_calls.recording(lambda f, a: None), pytest.raises(RuntimeError, match="already"):
        tape.record(lambda: torch.zeros(1))
    tape.record(lambda: torch.zeros(1) + 1)
    with pytest.raises(RuntimeError, match="once"):
        tape.record(lambda: torch.zeros(1))


def test_a_failing_native_status_fails_the_replay() -> None:
    status = [0]
    tape = OpTape()
    tape.record(lambda: native_calls.run(lambda: status[0]))
    status[0] = 2
    with pytest.raises(RuntimeError, match="failed in a replay"):
        tape.replay()
