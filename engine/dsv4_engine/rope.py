"""Interleaved RoPE with a cos/sin cache (the seed's `Dsv4NpuRoPE` design).

DSV4 rotates the trailing `qk_rope_head_dim` channels of each head, pairing channels
(2i, 2i+1) (GPT-J style). Sliding-window layers use plain RoPE at `rope_theta`; compressed
layers use `compress_rope_theta` with YaRN frequency interpolation and no mscale.

One `RopeTable` exists per frequency table (the `RopeRegistry` hands out the same instance
for equal parameters). Its cos/sin tables, `[max_positions, rope_dim]` in the interleaved
layout `[c0, c0, c1, c1, ...]`, are built once and registered as buffers, so `model.to()`
moves and casts them, and a captured graph sees stable tensors. The hot path only indexes
(`index_select` by position); asking for tables that were never built on that path raises.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv4_engine.config import RopeParams


def inv_freq(params: RopeParams, rope_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies `[rope_dim // 2]` in fp32 (YaRN ramp when asked)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = params.theta**exponents
    extrapolated = 1.0 / pos_freqs
    if params.rope_type == "default":
        return extrapolated
    interpolated = 1.0 / (params.factor * pos_freqs)
    orig = params.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(params.theta))

    low = max(math.floor(correction_dim(params.beta_fast)), 0)
    high = min(math.ceil(correction_dim(params.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    return interpolated * (1 - keep) + extrapolated * keep


class RopeTable(nn.Module):
    """cos/sin for one frequency table; buffers `cos` and `sin` once built."""

    def __init__(self, params: RopeParams, rope_dim: int, max_positions: int) -> None:
        super().__init__()
        self.params = params
        self.rope_dim = rope_dim
        self.max_positions = max_positions
        self.register_buffer("inv_freq", inv_freq(params, rope_dim), persistent=False)
        self.num_builds = 0  # observable: tests check tables are built once

    def build(self) -> None:
        """Build the tables in fp32 (cast later by `.to(dtype)`, as HF casts its cos/sin)."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq.float()[None, :]
        scale = self.params.attention_factor
        self.register_buffer(
            "cos", (freqs.cos() * scale).repeat_interleave(2, -1).contiguous(), persistent=False
        )
        self.register_buffer(
            "sin", (freqs.sin() * scale).repeat_interleave(2, -1).contiguous(), persistent=False
        )
        self.num_builds += 1

    def tables(self, *, allow_build: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = getattr(self, "cos", None), getattr(self, "sin", None)
        if cos is None or sin is None:
            if not allow_build:
                raise RuntimeError(
                    f"RoPE cos/sin tables (theta={self.params.theta}, type={self.params.rope_type}) are "
                    "missing on a no-build path; build them before the forward (RopeRegistry.build)"
                )
            self.build()
            cos, sin = self.cos, self.sin
        return cos, sin

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows `[len(positions), rope_dim]` for int64 positions; never builds."""
        cos, sin = self.tables(allow_build=False)
        return cos.index_select(0, positions), sin.index_select(0, positions)


class RopeRegistry(nn.Module):
    """The model's RoPE tables, one per distinct frequency table, keyed by its parameters."""

    def __init__(self, rope_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.max_positions = max_positions
        self.tables = nn.ModuleDict()
        self._keys: dict[RopeParams, str] = {}

    def get(self, params: RopeParams) -> RopeTable:
        key = self._keys.get(params)
        if key is None:
            key = f"table{len(self._keys)}"
            self._keys[params] = key
            self.tables[key] = RopeTable(params, self.rope_dim, self.max_positions)
        return self.tables[key]  # type: ignore[return-value]

    def build(self) -> None:
        for table in self.tables.values():
            if getattr(table, "cos", None) is None:
                table.build()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing `cos.shape[-1]` channels of `x` (interleaved pairs) in fp32.

    `cos`/`sin` broadcast against `x[..., -rope_dim:]`; pass `-sin` for the inverse rotation.
    """
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = rope.unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + swapped.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate` in place (the same values), for a tensor nothing else reads; `cos`/`sin` must not
    broadcast `x` to a larger shape. Fewer temporaries: no copy of the other channels, and the
    pair swap's sign goes on `sin` (a row per position) rather than on `x` (one per head)."""
    rope = x[..., -cos.shape[-1] :]
    pairs = rope.unflatten(-1, (-1, 2))
    swapped = torch.stack((pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2).float()  # (x1, x0)
    s = sin.unflatten(-1, (-1, 2))
    signed = torch.stack((-s[..., 0], s[..., 1]), dim=-1).flatten(-2)  # (-x1 * s == x1 * -s)
    rope.copy_((rope.float() * cos).add_(swapped.mul_(signed)))
    return x


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`rotate` of x `[B, ..., D]` with one cos/sin row `[B, R]` per batch row; inverse undoes it."""
    shape = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
    return rotate(x, cos.view(shape), (-sin if inverse else sin).view(shape))
