"""Qwen2.5-VL's vision tower, plain torch: no KV cache, no paging.

An image arrives as flat patch rows [P, C*tp*p*p] with its grid (t, h, w) in patches
(kvflow/qwen_vl_images.py), rows in merge-block order: each m x m block of patches that
becomes one language-model token is m^2 consecutive rows. Then::

    rows -> patch embed (the Conv3d's kernel is the whole patch: one matmul) -> [P, D]
      -> blocks: pre-RMSNorm attention with 2-D RoPE (half the rotary frequencies turn
         with the patch's row, half with its column), SwiGLU MLP
         window attention: a patch sees the patches of its window, a square of
         `window_size` pixels (window_size / (p*m) merged blocks a side, cut from the
         top left); the layers of `fullatt_block_indexes` see the whole image
      -> merger: RMSNorm, each block's m^2 rows concatenated, MLP -> [P / m^2, out]

Windows are a boolean mask over the image's own patch order (the order needs no
permutation: a window is a union of merge blocks). The images of one call share a grid
(the encoder feature batches by shape and grid), so they run as one batch. HF's names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.gpu_worker.layers.norm import RMSNorm
from kvflow.gpu_worker.models.clip_vision import activation


def patch_coordinates(grid_thw: list[int], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) [t*h*w] of each patch row, in merge-block order."""
    t, h, w = grid_thw
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    # [h/m, m, w/m, m] -> block-major [h/m, w/m, m, m]
    rows, cols = rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()
    return rows.repeat(t), cols.repeat(t)


def window_mask(grid_thw: list[int], merge: int, window_blocks: int) -> torch.Tensor:
    """[P, P] bool: patches i and j share a window (and a frame)."""
    t, h, w = grid_thw
    rows, cols = patch_coordinates(grid_thw, merge)
    frame = torch.arange(t).repeat_interleave(h * w)
    side = window_blocks * merge  # patches per window side
    windows_a_row = -(-w // side)
    window = (frame * -(-h // side) + rows // side) * windows_a_row + cols // side
    return window[:, None] == window[None, :]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        n, length, dim = x.shape
        qkv = self.qkv(x).view(n, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [N, heads, L, head_dim]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(n, length, dim))  # type: ignore[no-any-return]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation in fp32 over the whole head; cos/sin [L, head_dim]."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1, self.norm2 = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = VisionMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class PatchEmbed(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        p, tp = config.patch_size, config.temporal_patch_size
        kernel = (tp, p, p)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, kernel, bias=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., C*tp*p*p] -> [..., D]: the convolution at its only position."""
        weight = self.proj.weight
        return rows.to(weight.dtype) @ weight.flatten(1).T


class PatchMerger(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.unit = config.spatial_merge_size**2  # patches per merged token
        dim = config.hidden_size * self.unit
        self.ln_q = RMSNorm(config.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, config.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        merged = self.ln_q(x).reshape(n, length // self.unit, -1)  # a block's rows side by side
        return self.mlp(merged)  # type: ignore[no-any-return]


class QwenVisionTower(nn.Module):
    """`visual.`: patch_embed, blocks, merger."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window_blocks = config.window_size // config.patch_size // self.merge
        self.full_attention = set(config.fullatt_block_indexes)
        head_dim = config.hidden_size // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / theta**quarter, persistent=False)  # [hd/4]
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def rope(self, grid_thw: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [P, head_dim] fp32: [rows | columns] angles, twice (neox halves)."""
        rows, cols = patch_coordinates(grid_thw, self.merge)
        inv = self.inv_freq.cpu()
        half = torch.cat((rows[:, None] * inv, cols[:, None] * inv), dim=-1)  # [P, hd/2]
        angles = torch.cat((half, half), dim=-1).to(self.inv_freq.device)
        return angles.cos(), angles.sin()

    def forward(self, rows: torch.Tensor, grid_thw: list[int]) -> torch.Tensor:
        """rows [N, P, C*tp*p*p] of N images of one grid -> [N, P / m^2, out]."""
        x = self.patch_embed(rows)
        cos, sin = self.rope(grid_thw)
        windows = window_mask(grid_thw, self.merge, self.window_blocks).to(x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if i in self.full_attention else windows)
        return self.merger(x)  # type: ignore[no-any-return]
