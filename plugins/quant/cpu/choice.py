"""Choosing a quantized layer's CPU kernel at load, by measurement: which of several
few-rows kernels is fastest depends on the CPU (its instruction sets, caches and memory)
and on the number of token rows, so each candidate is timed on one real layer at a few row
counts and the fastest kept for each range of rows."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from tessellm.plugins.quant.int8.cpu import fastest

logger = logging.getLogger(__name__)

ROW_SIZES = (1, 4, 16, 64)
"""Row counts timed at load (with the layer's ``small_batch_rows`` itself)."""


def rows_table(run: Callable[[str, torch.Tensor], torch.Tensor], kernels: list[str], in_features: int,
               max_rows: int, dtype: torch.dtype, label: str) -> tuple[tuple[int, str], ...]:
    """Ascending ``(max_rows, kernel)`` ranges: for each timed row count up to ``max_rows``,
    the fastest of ``kernels`` (``run(kernel, rows)`` computes one layer's product) covers
    the rows above the previous count up to it; neighbours with one winner merge. One
    kernel needs no timing. The choice is logged, prefixed with ``label``."""
    if max_rows < 1 or not kernels:
        return ()
    if len(kernels) == 1:
        return ((max_rows, kernels[0]),)
    sizes = sorted({s for s in ROW_SIZES if s < max_rows} | {max_rows})
    g = torch.Generator().manual_seed(0)
    table: list[tuple[int, str]] = []
    with torch.inference_mode():
        for size in sizes:
            x = torch.randn(size, in_features, generator=g).to(dtype)
            best = fastest({k: (lambda k=k: run(k, x)) for k in kernels})
            if table and table[-1][1] == best:
                table[-1] = (size, best)
            else:
                table.append((size, best))
    logger.info("%s: fastest few-rows kernel on this CPU %s (of %s)", label,
                ", ".join(f"up to {rows} rows {kernel}" for rows, kernel in table), ", ".join(kernels))
    return tuple(table)
