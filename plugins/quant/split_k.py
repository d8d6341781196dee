"""Splitting a few-row quantized matmul's K among programs (the Triton weight-only kernels).

A decode step multiplies one or a few rows by a weight of N output channels: one program per
64 channels gives 32 programs for a 2048-wide layer, a quarter of a large GPU's SMs, and the
weight streams at a fraction of the memory bandwidth. Splitting K gives each (rows, channels)
tile ``splits`` programs that each reduce a whole number of K tiles into a float32 partial
[splits, M, N]; one sum adds them (in a fixed order: deterministic, unlike atomics).
"""

from __future__ import annotations

import functools

import torch
import triton

PROGRAMS_PER_SM = 2
"""Programs a split aims for, per SM: enough loads in flight to stream the weight."""

INTERPRETER_PROGRAMS = 4
"""Programs aimed for off CUDA (the interpreter runs them one after another): enough that
tests exercise several splits on small shapes."""

MIN_TILES_PER_SPLIT = 2
"""K tiles each split keeps at least, so its partial costs little next to the weights read."""


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """Programs a launch on ``device`` should have to stream its weights."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_splits(tiles: int, k: int, block_k: int, device: torch.device, splits: int | None = None) -> int:
    """How many ways to split K for a launch of ``tiles`` output tiles (``splits`` given: that,
    clamped to the K tiles there are). Only as far as the tiles alone leave the device idle."""
    k_tiles = triton.cdiv(k, block_k)
    if splits is None:
        splits = min(triton.cdiv(target_programs(device), max(tiles, 1)), max(k_tiles // MIN_TILES_PER_SPLIT, 1))
    return max(1, min(splits, k_tiles))


def k_per_split(k: int, block_k: int, splits: int) -> int:
    """K columns each split reduces: whole K tiles, so no tile (nor a group it lies in) straddles two."""
    return triton.cdiv(triton.cdiv(k, block_k), splits) * block_k


def partials(splits: int, m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a launch writes: the output [m, n] itself (``splits`` 1), else float32 partials
    [splits, m, n] that ``finish`` adds."""
    if splits == 1:
        return torch.empty(1, m, n, dtype=dtype, device=device)
    return torch.empty(splits, m, n, dtype=torch.float32, device=device)


def finish(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [m, n] product in ``dtype`` from ``partials``' buffer."""
    if part.shape[0] == 1:
        return part[0]
    return part.sum(dim=0).to(dtype)
