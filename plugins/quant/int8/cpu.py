"""int8 weight-only matmul on the CPU, paths chosen by the number of rows M:

- few rows (decode): ``torch.compile`` (inductor) turns a multiply-and-sum into one loop
  nest that reads each int8 weight once, converts it in registers and accumulates, with no
  float copy of the weight. Decode is memory-bound, so reading 1 byte a weight instead of 4
  is the win. Compiled once per layout, with M dynamic.
  Alternatively torch's own ``_weight_int8pack_mm`` (per-channel scales only). Which of the
  two is faster depends on the CPU (AVX-512 or AVX2 only): ``fastest`` measures them at load.
- many rows (prefill): the weight is dequantized one tile of ``TILE_ROWS`` output channels
  at a time into a small float buffer that stays in cache, and multiplied by the BLAS: the
  conversion is paid once per tile for all M rows, and no full float copy ever exists.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from tessellm.core.model.compiled import median_seconds


def _per_channel(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x [M, K], q [N, K] int8, scale [N]: sum_k x[m, k] * q[n, k], scaled per output channel
    acc = (x.unsqueeze(1) * q.unsqueeze(0).to(x.dtype)).sum(dim=-1)
    return acc * scale.to(x.dtype)


def _grouped(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # scale [N, G]: each group of K // G input channels has its own scale
    m, k = x.shape
    n, groups = scale.shape
    xg = x.view(m, 1, groups, k // groups)
    acc = (xg * q.view(1, n, groups, k // groups).to(x.dtype)).sum(dim=-1)  # [M, N, G]
    return (acc * scale.to(x.dtype).unsqueeze(0)).sum(dim=-1)


@functools.lru_cache(maxsize=None)
def _compiled(grouped: bool):
    return torch.compile(_grouped if grouped else _per_channel, dynamic=True, fullgraph=True)


TILE_ROWS = 256
"""Output channels dequantized at once on the many-rows path."""


def tiled_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q * scale).T, dequantizing ``TILE_ROWS`` output channels at a time."""
    n, k = q.shape
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grouped = scale.dim() == 2
    for start in range(0, n, TILE_ROWS):
        rows = slice(start, min(start + TILE_ROWS, n))
        tile = q[rows].to(x.dtype)
        if grouped:
            groups = scale.shape[1]
            tile = (tile.view(-1, groups, k // groups) * scale[rows].to(x.dtype)[..., None]).view(-1, k)
            torch.mm(x, tile.T, out=out[:, rows])
        else:
            torch.mm(x, tile.T, out=out[:, rows])
            out[:, rows] *= scale[rows].to(x.dtype)
    return out


def int8_weight_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """x [M, K] (float) @ (q [N, K] int8 * scale).T -> [M, N] in x's dtype. ``compiled``
    False runs the same expression eagerly (a test reference; it materialises [M, N, K])."""
    fn = _compiled(scale.dim() == 2) if compiled else (_grouped if scale.dim() == 2 else _per_channel)
    return fn(x, q, scale)


def int8pack_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q * scale).T through torch's ``_weight_int8pack_mm`` (per-channel scales)."""
    return torch._weight_int8pack_mm(x, q, scale.to(x.dtype))


def fastest(candidates: dict[str, Callable[[], torch.Tensor]], reps: int = 9) -> str:
    """The name of the candidate with the lowest median time over ``reps`` calls, after two
    untimed calls (a compiled kernel builds in the first)."""
    return min(candidates, key=lambda name: median_seconds(candidates[name], calls=reps, warmup=2))
