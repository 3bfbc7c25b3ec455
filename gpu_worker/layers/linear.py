"""Tensor-parallel linear layers (Megatron split) with per-parameter weight loaders.

    ColumnParallelLinear   W [out, in] split by rows:    rank r holds out/tp rows,
                           its output is the rank's slice of the features (no collective).
    RowParallelLinear      W [out, in] split by columns: rank r holds in/tp columns and
                           consumes the column-parallel output slice; partial sums are
                           all-reduced, then the bias (not split) is added once.

A column-parallel layer may pack several checkpoint matrices along the output dim
(`MergedColumnParallelLinear`: gate|up, `QKVParallelLinear`: q|k|v); its loader takes a
`shard_id` naming which one it receives and writes that rank's slice of it at the
packed offset. Every parameter carries `weight_loader(param, loaded_weight, shard_id)`
and `shard_ids` (the shards a checkpoint must provide), read by `weights.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvflow.gpu_worker.parallel_state import divide, get_tp_group
from kvflow.kernels.cpu.block_linear import BlockWeights
from kvflow.kernels.cpu.int8_linear import QuantWeights
from kvflow.kernels.cpu.linear import PackedWeight, linear, linear_silu_and_mul

if TYPE_CHECKING:
    from kvflow.gpu_worker.lora.slots import LoraSlots


def new_parameter(
    shape: tuple[int, ...], loader: Callable[..., None], shard_ids: Sequence[Any] = (None,)
) -> nn.Parameter:
    """An uninitialised inference parameter (default dtype/device) with its loader."""
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = tuple(shard_ids)  # type: ignore[attr-defined]
    return param


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across tensor-parallel ranks."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        shard_ids: Sequence[Any] | None = None,
    ) -> None:
        super().__init__()
        self.tp = get_tp_group()
        # Local size of each packed shard; their sum is this rank's output width.
        self.local_sizes = [divide(size, self.tp.size) for size in output_sizes]
        self.input_size = input_size  # `weight` may be emptied once packed (weight_packing.py)
        if shard_ids is None:
            shard_ids = range(len(output_sizes)) if len(output_sizes) > 1 else (None,)
        out = sum(self.local_sizes)
        self.weight = new_parameter((out, input_size), self.weight_loader, shard_ids)
        self.bias = new_parameter((out,), self.weight_loader, shard_ids) if bias else None
        self.blocks: BlockWeights | None = None  # GGUF blocks of `weight` (block_weights.py)
        self.quant: QuantWeights | None = None  # `--quantization` (gpu_worker/quantization.py)
        self.packed_weight: PackedWeight | None = None  # gpu_worker/weight_packing.py
        self.lora: LoraSlots | None = None  # --enable-lora (gpu_worker/lora/slots.py)

    def shard_range(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in the packed local param, local size, start row in the checkpoint)."""
        index = 0 if shard_id is None else int(shard_id)
        offset = sum(self.local_sizes[:index])
        size = self.local_sizes[index]
        return offset, size, self.tp.rank * size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        offset, size, start = self.shard_range(shard_id)
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(
            x, self.weight, self.bias, self.blocks, self.quant, self.packed_weight
        )  # fastest CPU route
        if self.lora is not None and self.lora.batch.active:
            return self.lora.add_to(x, y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel matrices of one input stacked by rows (gate_proj|up_proj).

    The checkpoint provides them separately with shard_id 0, 1, ...; each rank holds
    [gate_r | up_r], so SiluAndMul splits the local output in halves without a collective.
    `glu`: the two halves are a GLU's gate and up, and `silu_and_mul` may fuse the
    activation into the matmul (weight_packing.py packs the halves for it).
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool, glu: bool = False
    ) -> None:
        super().__init__(input_size, output_sizes, bias, shard_ids=range(len(output_sizes)))
        if glu and (len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]):
            raise ValueError(f"a GLU's gate|up has two equal halves, not {list(output_sizes)}")
        self.glu = glu

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up in one pass where the CPU route allows it, else None."""
        if self.lora is not None and self.lora.batch.active:
            return None  # the LoRA terms join gate|up before the activation
        return linear_silu_and_mul(x, self.bias, self.blocks, self.quant, self.packed_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v projections packed by output rows; shard_id "q", "k" or "v".

    With fewer KV heads than ranks, each KV head is replicated on tp/num_kv_heads ranks.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = get_tp_group()
        self.num_heads = divide(num_heads, tp.size)
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size)
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            replicas = divide(tp.size, num_kv_heads)
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // replicas
        self.head_dim = head_dim
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # Sizes summed over ranks (replicated KV heads counted once per rank).
        sizes = [q_size * tp.size, kv_size * tp.size, kv_size * tp.size]
        super().__init__(hidden_size, sizes, bias, shard_ids=("q", "k", "v"))

    def shard_range(self, shard_id: Any) -> tuple[int, int, int]:
        q_size, kv_size = self.local_sizes[0], self.local_sizes[1]
        if shard_id == "q":
            return 0, q_size, self.tp.rank * q_size
        start = self.kv_head_start * self.head_dim
        if shard_id == "k":
            return q_size, kv_size, start
        assert shard_id == "v", shard_id
        return q_size + kv_size, kv_size, start


class ReplicatedLinear(ColumnParallelLinear):
    """y = x W^T + b with the whole W on every rank: a small projection whose whole output
    every rank needs (DeepSeek's low-rank q_a_proj and kv_a_proj_with_mqa). A column-
    parallel layer of one shard that each rank holds in full, so that it loads, packs
    and quantizes as the others do."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        # Sized as tp "shards" of output_size: each rank's local width is the whole.
        super().__init__(input_size, [output_size * get_tp_group().size], bias)

    def shard_range(self, shard_id: Any) -> tuple[int, int, int]:
        return 0, self.local_sizes[0], 0


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b with W's columns (input features) split across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.local_input = divide(input_size, self.tp.size)
        self.output_size = output_size
        self.weight = new_parameter((output_size, self.local_input), self.weight_loader)
        self.bias = new_parameter((output_size,), copy_checked_loader) if bias else None
        self.blocks: BlockWeights | None = None  # GGUF blocks of `weight` (block_weights.py)
        self.quant: QuantWeights | None = None  # `--quantization` (gpu_worker/quantization.py)
        self.packed_weight: PackedWeight | None = None  # gpu_worker/weight_packing.py
        self.lora: LoraSlots | None = None  # --enable-lora (gpu_worker/lora/slots.py)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        start = self.tp.rank * self.local_input
        copy_checked(param.data, loaded_weight.narrow(1, start, self.local_input))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora if self.lora is not None and self.lora.batch.active else None
        if self.tp.size == 1:
            y = linear(x, self.weight, self.bias, self.blocks, self.quant, self.packed_weight)
            return y if lora is None else lora.add_to(x, y)
        partial = linear(x, self.weight, None, self.blocks, self.quant, self.packed_weight)
        if lora is not None:  # joins the partial sums: sum_r x_r A_r^T B^T = x A^T B^T
            partial = lora.add_to(x, partial)
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias


def copy_checked_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
) -> None:
    """Loader of an unsplit parameter: the checkpoint tensor is copied whole."""
    copy_checked(param.data, loaded_weight)
