"""Which matmul kernel a quantized layer runs on CUDA, by its shape and the step's row count.

Each quantizer has several kernels for one product (its own Triton kernel, torch's built-in
ones, a ``torch.compile``d dequantize-matmul, dequantize-then-cuBLAS), and which is fastest
depends on the layer's shape and on how many rows the step has: a decode step reads the
weights once for one row, a prefill multiplies thousands. ``kernel: auto`` looks the choice
up in a table that ``bench/quant_kernels.py --table`` writes from timings on the GPU:

    {"device": ..., "measured": true, "kernels": {"int8-weight": {"2048x8192": [[1, "compiled"],
     [16, "triton"], [1024, "tiled"]], ...}, ...}}

Each shape key is ``out_features x in_features``; its list holds (rows, kernel) pairs by
rising rows: a step of r rows takes the kernel of the first pair with rows >= r (past the
last, the last). A layer whose shape the table lacks takes the nearest measured shape (in
log2 of both sizes). Without a table of its own, the quantizer reads the default
(kernel_tables/sm_90.json: Hopper, chosen from what was known before it was measured, and
marked so). A table's kernel that a layer cannot run (a group size, a shape, a dtype) falls
back to the quantizer's own Triton kernel.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tessellm.core.errors import ConfigError

TABLE_DIR = Path(__file__).with_name("kernel_tables")
DEFAULT_TABLE = TABLE_DIR / "sm_90.json"
"""The table ``auto`` reads on CUDA unless a quantizer's ``kernel_table`` names another."""


@dataclass(frozen=True)
class RowDispatch:
    """A layer's kernel per row count: ``steps`` (max rows, kernel) by rising rows; rows past
    the last step take its kernel."""

    steps: tuple[tuple[int, str], ...]

    def pick(self, rows: int) -> str:
        for max_rows, kernel in self.steps:
            if rows <= max_rows:
                return kernel
        return self.steps[-1][1]

    def kernels(self) -> set[str]:
        return {kernel for _, kernel in self.steps}


def read_table(path: str | Path | None = None) -> dict[str, Any]:
    """The kernel table at ``path`` (None: the default), checked for its shape; a ConfigError
    naming the file and what is wrong otherwise."""
    path = Path(path) if path is not None else DEFAULT_TABLE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"quant kernel table {str(path)!r} cannot be read as JSON: {exc}") from None
    kernels = table.get("kernels") if isinstance(table, dict) else None
    if not isinstance(kernels, dict):
        raise ConfigError(f"quant kernel table {str(path)!r} has no 'kernels' object (bench/quant_kernels.py "
                          f"--table writes one)")
    for quantizer, shapes in kernels.items():
        for shape, steps in (shapes.items() if isinstance(shapes, dict) else [(None, None)]):
            if not (_shape(shape) and isinstance(steps, list) and steps and
                    all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], int) and isinstance(s[1], str)
                        for s in steps)):
                raise ConfigError(f"quant kernel table {str(path)!r}: {quantizer!r} entry {shape!r} must map "
                                  f"'NxK' shapes to [[rows, kernel], ...] lists")
    return table


def _shape(key: Any) -> tuple[int, int] | None:
    """(N, K) of a table key ``"NxK"``; None if it is not one."""
    try:
        n, k = str(key).split("x")
        return int(n), int(k)
    except ValueError:
        return None


def nearest_shape(shapes: Sequence[str], n: int, k: int) -> str:
    """The key of ``shapes`` nearest an [n, k] layer in log2 of both sizes (ties: the first)."""
    def distance(key: str) -> float:
        sn, sk = _shape(key)
        return abs(math.log2(sn / n)) + abs(math.log2(sk / k))
    return min(shapes, key=distance)


@dataclass(frozen=True)
class KernelChoice:
    """How a quantized layer of ``quantizer`` picks its kernel: ``named`` (one kernel for every
    step, on every device that can run it) or None (``auto``: on CUDA, per row count from
    ``table``; on the CPU, the layer's own CPU choice)."""

    quantizer: str
    named: str | None
    table: dict[str, Any] | None = field(default=None, compare=False)  # one per quantizer: not compared

    def cuda_dispatch(self, n: int, k: int, unfit: Callable[[str], str | None], fallback: str) -> RowDispatch:
        """The per-row-count kernels of an [n, k] layer on CUDA: the named kernel, or the
        table's entry for the nearest shape, each kernel the layer cannot run (``unfit``
        gives a reason) replaced by ``fallback``."""
        if self.named is not None:
            return RowDispatch(((1 << 62, self.named),))
        shapes = (self.table or {}).get("kernels", {}).get(self.quantizer) or {}
        if not shapes:
            return RowDispatch(((1 << 62, fallback),))
        steps = shapes[nearest_shape(list(shapes), n, k)]
        return RowDispatch(tuple((rows, kernel if unfit(kernel) is None else fallback) for rows, kernel in steps))


def check_named(kernel: str | None, layer: str, unfit: Callable[[str], str | None], allowed: Sequence[str],
                option: str = "kernel") -> None:
    """A ConfigError if the named ``kernel`` (quant.options.``option``) cannot run ``layer``
    (``unfit`` says why)."""
    if kernel is None:
        return
    why = unfit(kernel)
    if why is not None:
        raise ConfigError(f"quant.options.{option} {kernel!r} cannot run {layer}: {why}; allowed: auto (which "
                          f"falls back where a kernel does not fit) or one of {', '.join(allowed)}")


def choose(quantizer: str, kernel: str, table: str | None, device: Any, triton_kernels: Sequence[str] = (),
           cuda_kernels: Sequence[str] = (), option: str = "kernel") -> KernelChoice:
    """The ``KernelChoice`` of a quantizer's ``kernel`` and ``kernel_table`` options on
    ``device``: a named kernel must be able to run there (``triton_kernels`` on CUDA or under
    TRITON_INTERPRET=1, ``cuda_kernels`` on CUDA only); auto reads the table (checked even
    off CUDA, so a wrong path fails at load everywhere)."""
    import os

    read = read_table(table) if table is not None or device.type == "cuda" else None
    if kernel == "auto":
        return KernelChoice(quantizer, None, read)
    on_cuda = device.type == "cuda"
    if kernel in cuda_kernels and not on_cuda:
        raise ConfigError(f"quant.options.{option} {kernel!r} runs on CUDA only, not on {device.type}; use auto")
    if kernel in triton_kernels and not on_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ConfigError(f"quant.options.{option} {kernel!r} is a Triton kernel: it needs CUDA (or "
                          f"TRITON_INTERPRET=1 for tests), not {device.type}; use auto")
    return KernelChoice(quantizer, kernel, read)
