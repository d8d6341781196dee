"""Linear layers holding int8 weights and their scales: the shared ``Int8Linear`` and
`int8-weight`'s ``Int8WeightLinear``."""

from __future__ import annotations

import torch
from torch import nn

from tessellm.plugins.quant.cpu import int8_dot
from tessellm.plugins.quant.int8.cpu import int8_weight_matmul, int8pack_matmul, tiled_matmul
from tessellm.plugins.quant.kernel_table import KernelChoice, RowDispatch
from tessellm.plugins.quant.int8.quantize import quantize_per_channel


class Int8Linear(nn.Module):
    """``nn.Linear``'s interface over int8 weights quantized once from ``weight`` (default: the
    linear's own) with ``group_size``; the float weight is not kept. ``forward`` flattens the
    input to rows, calls the subclass's ``matmul(rows)`` (x @ dequantized weight.T, in x's
    dtype), adds the bias and restores the leading shape."""

    def __init__(self, linear: nn.Linear, group_size: int | None = None, weight: torch.Tensor | None = None):
        super().__init__()
        q, scale = quantize_per_channel(linear.weight if weight is None else weight, group_size)
        self._hold(q.to(linear.weight.device), scale.to(linear.weight.device),
                   None if linear.bias is None else linear.bias.detach().clone())

    def _hold(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = q.shape
        self.group_size = None if scale.dim() == 1 else self.in_features // scale.shape[1]
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        """The layer over int8 weights ``q`` [N, K] and their scales ([N], or [N, groups])
        as a checkpoint stores them (no float weight involved)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._hold(q, scale, bias)
        return module

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, in_features] @ the dequantized weight.T, in rows' dtype: each subclass's
        own kernel choice (the base class has none)."""
        raise NotImplementedError(f"{type(self).__name__} must define matmul(rows)")

    kernel_choice: KernelChoice
    """How the subclass picks its kernel (set at construction)."""
    _cuda_dispatch: RowDispatch | None = None

    def unfit(self, kernel: str) -> str | None:
        """Why this layer cannot run ``kernel`` (None: it can); subclasses name their limits."""
        return None

    def cuda_dispatch(self) -> RowDispatch:
        """The kernel per row count on CUDA (worked out once, from the layer's shape)."""
        if self._cuda_dispatch is None:
            self._cuda_dispatch = self.kernel_choice.cuda_dispatch(self.out_features, self.in_features, self.unfit,
                                                                   "triton")
        return self._cuda_dispatch


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)


class Int8WeightLinear(Int8Linear):
    """``nn.Linear``'s forward over int8 weights: y = x @ (q * scale).T + bias, in x's dtype.
    The weight is quantized once, at construction (symmetric, per output channel or per group
    of ``group_size`` input channels), and the float weight is not kept.

    Kernels (``KERNELS``): ``triton``, a Triton kernel that converts weight tiles inside its K
    loop and splits K for few rows (triton_matmul.py); ``int8pack``, torch's
    ``_weight_int8pack_mm`` (per-channel scales); ``compiled``, a ``torch.compile``d
    dequantize-in-the-reduction (one loop nest reading each int8 weight once); ``tiled``,
    dequantize a tile of output channels at a time into cuBLAS / BLAS (cpu.py). Which runs:
    ``kernel_choice`` names one for every step, or (auto) on CUDA its table picks per row
    count (kernel_table.py); on the CPU up to ``small_batch_rows`` rows run ``small_kernel``
    (the quantizer times the CPU's candidates at load), more rows the tiles.
    """

    SMALL_KERNELS = ("compiled", "int8pack", "int8-dot", "tiled")
    """The CPU's few-rows paths: the compiled reduction, torch's int8pack kernel, int8
    activations times the int8 weights in int32 (plugins/quant/cpu), tiles + BLAS."""
    KERNELS = ("triton", "int8pack", "compiled", "tiled")
    """Every kernel the ``kernel`` option names."""

    def __init__(self, linear: nn.Linear, group_size: int | None, small_batch_rows: int, compile: bool,
                 kernel_choice: KernelChoice | None = None):
        super().__init__(linear, group_size)
        self.small_batch_rows = small_batch_rows
        self.compile = compile
        self.small_kernel = "compiled" if compile else "tiled"
        self.dot_digits = 2
        """The int8 digits a value the int8-dot kernel quantizes activations into (1 or 2)."""
        self.kernel_choice = kernel_choice or KernelChoice("int8-weight", None)
        self._cuda_dispatch: RowDispatch | None = None

    def small_rows(self, kernel: str, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` through ``kernel`` (one of ``KERNELS``)."""
        if kernel == "triton":
            from tessellm.plugins.quant.int8.triton_matmul import triton_int8_weight_matmul

            return triton_int8_weight_matmul(rows, self.weight_int8, self.scale)
        if kernel == "compiled":
            return int8_weight_matmul(rows, self.weight_int8, self.scale)
        if kernel == "int8pack":
            return int8pack_matmul(rows, self.weight_int8, self.scale)
        if kernel == "int8-dot":
            return int8_dot.int8_matmul(rows.float(), self.weight_int8, self.scale, self.dot_digits).to(rows.dtype)
        return tiled_matmul(rows, self.weight_int8, self.scale)

    def unfit(self, kernel: str) -> str | None:
        """Why this layer cannot run ``kernel`` (None: it can)."""
        if kernel == "int8pack" and self.group_size is not None:
            return f"int8pack takes per-channel scales only (group_size {self.group_size})"
        return None

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """``forward(x)`` in float64 by the arithmetic its CPU kernel runs for that many rows,
        where that is not the dequantized weight's product: the int8-dot kernel's
        (cpu/int8_dot.py); None for the other paths."""
        rows = x.reshape(-1, self.in_features)
        if rows.device.type != "cpu" or rows.shape[0] > self.small_batch_rows or self.small_kernel != "int8-dot" \
                or self.kernel_choice.named is not None:
            return None
        out = int8_dot.reference_int8(rows.float(), self.weight_int8, self.scale, self.dot_digits)
        if self.bias is not None:
            out = out + self.bias.double()
        return out.view(*x.shape[:-1], self.out_features)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.kernel_choice.named is not None:
            return self.small_rows(self.kernel_choice.named, rows)
        if rows.device.type == "cuda":  # torch's CUDA int8pack takes float32 activations only
            kernel = self.cuda_dispatch().pick(rows.shape[0])
            return self.small_rows("triton" if kernel == "int8pack" and rows.dtype != torch.float32 else kernel, rows)
        if rows.device.type == "cpu" and rows.shape[0] <= self.small_batch_rows:
            return self.small_rows(self.small_kernel, rows)
        return tiled_matmul(rows, self.weight_int8, self.scale)

    def extra_repr(self) -> str:
        group = "per channel" if self.group_size is None else f"group_size={self.group_size}"
        kernel = f"kernel {self.kernel_choice.named}" if self.kernel_choice.named else f"few rows: {self.small_kernel}"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 {group}, {kernel}"
