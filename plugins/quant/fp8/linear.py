"""``Fp8Linear``: ``nn.Linear``'s interface over float8 e4m3 weights and their scales.

The weight is ``weight_fp8 * scale`` with one scale for the whole tensor ([1, 1]), one per
output channel ([N, 1]) or one per block of ``block`` = (rows, columns) ([ceil(N / rows),
ceil(K / columns)]; DeepSeek-V3's 128 x 128). Matmuls (``KERNELS``):

- ``dequantize`` (anywhere): ``TILE_ROWS`` output channels at a time into the activations'
  dtype, then the BLAS (cuBLAS on a GPU): the activations stay in the model dtype;
- ``scaled_mm`` (FP8 tensor cores, compute capability 8.9+): the activations are quantized
  to e4m3 per row (token) on the fly, and ``torch._scaled_mm`` multiplies the two FP8
  operands with the row scales and the weight's per-channel scales applied to its float32
  accumulator (FP8_DYNAMIC's arithmetic). Tensor or channel scales only, N and K multiples
  of 16 (``scaled_mm_unfit``);
- ``triton``: `int8-weight`'s Triton kernel, which converts any 8-bit weight tile to the
  activations' dtype inside its K loop (e4m3 is exact in bfloat16, float16 and float32) and
  splits K for few rows; tensor or channel scales;
- ``compiled``: a ``torch.compile``d dequantize-in-the-reduction (the weights read once as
  bytes, converted in registers): the fused GEMV of few rows; tensor or channel scales.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tessellm.plugins.quant.kernel_table import KernelChoice, RowDispatch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE_ROWS = 256
"""Output channels dequantized at once (a multiple of every block height used: 128, 64, 32)."""
SCALED_MM_ALIGN = 16
"""torch._scaled_mm's operands: K and N multiples of this."""


def scaled_mm_unfit(n: int, k: int, block: tuple[int, int] | None) -> str | None:
    """Why ``torch._scaled_mm`` cannot multiply by an [n, k] weight scaled per ``block``
    (None: it can)."""
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    if block is not None:
        return f"its {block[0]}x{block[1]} block scales (torch._scaled_mm takes one scale per tensor or output channel)"
    if n % SCALED_MM_ALIGN or k % SCALED_MM_ALIGN:
        return f"its shape {n} x {k} (torch._scaled_mm needs multiples of {SCALED_MM_ALIGN})"
    return None


def fp8_matmul_unfit(device: torch.device) -> str | None:
    """Why ``device`` has no FP8 tensor-core matmul (None: it has one)."""
    if device.type != "cuda":
        return f"the {device.type} device has no FP8 tensor cores"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} has no FP8 tensor cores (8.9+ has)"
    return None


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, float32 scales [M, 1]) of x [M, K]: each row's largest magnitude maps to
    e4m3's largest value (dynamic per-token activation scales)."""
    rows = x.float()
    scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 ``v`` rounded as IEEE arithmetic rounds to e4m3 (the reference for every
    conversion): 3 mantissa bits, to nearest with ties to even, subnormals in steps of 2^-9,
    magnitudes past 448 saturated to 448 (what the clamp before each cast makes them)."""
    a = v.double().abs()
    _, exponent = torch.frexp(a)  # a = m 2^exponent, m in [0.5, 1)
    step = torch.pow(2.0, ((exponent - 1).clamp(min=-6) - 3).double())
    return torch.where(a == 0, a, (torch.round(a / step) * step).clamp(max=FP8_MAX)) * v.double().sign()


def reference_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (e4m3 values, scales [M, 1]) of ``quantize_rows_fp8(x)`` computed by hand:
    the float32 scale and quotient, as IEEE float32 division gives them, then ``round_e4m3``."""
    rows = x.detach().float().cpu()
    scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return round_e4m3((rows / scale).clamp(-FP8_MAX, FP8_MAX).double()), scale.double()


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes a scale per row of the activations
    and per output channel (torch 2.13's does; 2.11's refuses: "only supports per-tensor
    scaling for CPU backend"). Probed once, on a 16 x 16 product."""
    ones = torch.ones(16, 16).to(FP8)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float) @ (weight [N, K] e4m3 * weight_scale_row [1, N]).T through
    ``torch._scaled_mm``, x quantized per row first; [M, N] in x's dtype (bfloat16 from the
    tensor cores, whose row-scaled products write that). A CPU torch that takes only one
    scale per tensor gets unit scales, and the row and channel scales multiply its float32
    product afterwards: the same arithmetic (scales applied to the float32 accumulator)."""
    q, scale = quantize_rows_fp8(x)
    if x.is_cuda:
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale_row, out_dtype=torch.bfloat16,
                               use_fast_accum=False)
    elif cpu_scaled_mm_takes_row_scales():
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale_row, out_dtype=torch.float32)
    else:
        one = torch.ones((), dtype=torch.float32)
        out = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32) * scale \
            * weight_scale_row
    return out.to(x.dtype)


def _dequantize_reduce(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x [M, K], weight [N, K] e4m3, scale [N]: sum_k x[m, k] * weight[n, k], scaled per channel
    return (x.unsqueeze(1) * weight.unsqueeze(0).to(x.dtype)).sum(dim=-1) * scale.to(x.dtype)


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_dequantize_reduce, dynamic=True, fullgraph=True)


def compiled_fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, compiled: bool = True
                        ) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * scale [N]).T by the ``torch.compile``d reduction
    (``compiled`` False: eagerly, a test reference that materialises [M, N, K])."""
    return (_compiled() if compiled else _dequantize_reduce)(x, weight, scale)


def expand_scale(scale: torch.Tensor, rows: slice, shape: tuple[int, int], block: tuple[int, int] | None
                 ) -> torch.Tensor:
    """The scale of every weight in output channels ``rows`` of an [N, K] weight: [R, K] or a
    broadcastable [R, 1] / [1, 1]."""
    if block is None:
        return scale if scale.shape[0] == 1 else scale[rows]
    bn, bk = block
    start, stop = rows.start, min(rows.stop, shape[0])
    tile = scale[start // bn: (stop + bn - 1) // bn].repeat_interleave(bn, dim=0)
    tile = tile[start - (start // bn) * bn: stop - (start // bn) * bn]
    return tile.repeat_interleave(bk, dim=1)[:, : shape[1]]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in ``dtype`` (the reference)."""
    rows = slice(0, weight.shape[0])
    return (weight.to(dtype) * expand_scale(scale, rows, tuple(weight.shape), block).to(dtype))


def quantize_fp8(weight: torch.Tensor, granularity: str, block: tuple[int, int] = (128, 128)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) of ``weight`` [N, K] per ``granularity``: "tensor",
    "channel" or "block" (scales of ``block``)."""
    w = weight.detach().float()
    n, k = w.shape
    if granularity == "tensor":
        scale = w.abs().amax().reshape(1, 1)
    elif granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True)
    else:
        bn, bk = block
        padded = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
        scale = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))
    scale = (scale / FP8_MAX).clamp(min=1e-12)
    full = expand_scale(scale, slice(0, n), (n, k), block if granularity == "block" else None)
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x @ (weight_fp8 * scale).T + bias in x's dtype; see the module docstring. Which
    kernel runs: ``kernel_choice`` names one, or (auto) on CUDA its table picks per row count;
    without a choice, ``use_scaled_mm`` names scaled_mm or dequantize."""

    KERNELS = ("scaled_mm", "dequantize", "triton", "compiled")
    """Every kernel the ``matmul`` option names."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 block: tuple[int, int] | None, *, use_scaled_mm: bool = False,
                 kernel_choice: KernelChoice | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.register_buffer("weight_fp8", weight)
        self.register_buffer("weight_scale", scale.float())
        self.register_buffer("bias", bias)
        self.kernel_choice = kernel_choice or KernelChoice("fp8", "scaled_mm" if use_scaled_mm else "dequantize")
        # [1, N]: one scale per output channel (tensor scales widened), what scaled_mm, triton
        # and compiled read; None for block scales, which only dequantize takes
        row = self.weight_scale.reshape(1, -1).expand(1, self.out_features).contiguous() if block is None else None
        self.register_buffer("weight_scale_row", row, persistent=False)
        self._cuda_dispatch: RowDispatch | None = None

    def unfit(self, kernel: str) -> str | None:
        """Why this layer cannot run ``kernel`` (None: it can)."""
        if kernel == "scaled_mm":
            return scaled_mm_unfit(self.out_features, self.in_features, self.block)
        if kernel in ("triton", "compiled") and self.block is not None:
            return f"its {self.block[0]}x{self.block[1]} block scales ({kernel} takes tensor or channel scales)"
        return None

    def kernel_for(self, rows: torch.Tensor) -> str:
        """The kernel a step of ``rows`` runs."""
        if self.kernel_choice.named is not None:
            return self.kernel_choice.named
        if not rows.is_cuda:
            return "dequantize"
        if self._cuda_dispatch is None:
            self._cuda_dispatch = self.kernel_choice.cuda_dispatch(self.out_features, self.in_features, self.unfit,
                                                                   "dequantize")
        return self._cuda_dispatch.pick(rows.shape[0])

    @classmethod
    def stack(cls, parts: list["Fp8Linear"]) -> "Fp8Linear | None":
        """One layer computing ``parts`` side by side (``fuse_projections`` on a checkpoint's
        stored q/k/v or gate/up): weights and biases concatenated along the outputs, a scale
        per tensor widened to one per channel; block scales join where every part's outputs
        fill whole blocks. None where the parts differ in block shape, bias or matmul."""
        first = parts[0]
        key = [(p.in_features, p.block, p.bias is None, p.kernel_choice) for p in parts]
        if len(set(key)) > 1 or (first.block is not None and any(p.out_features % first.block[0] for p in parts)):
            return None
        if first.block is None:
            scale = torch.cat([p.weight_scale.expand(p.out_features, 1) for p in parts])
        else:
            scale = torch.cat([p.weight_scale for p in parts])
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        return cls(torch.cat([p.weight_fp8 for p in parts]), scale, bias, first.block,
                   kernel_choice=first.kernel_choice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        kernel = self.kernel_for(rows)
        if kernel == "scaled_mm":
            out = scaled_mm(rows, self.weight_fp8, self.weight_scale_row)
        elif kernel == "triton":
            from tessellm.plugins.quant.int8.triton_matmul import triton_int8_weight_matmul  # reads any 8-bit weight

            out = triton_int8_weight_matmul(rows, self.weight_fp8, self.weight_scale_row.view(-1))
        elif kernel == "compiled":
            out = compiled_fp8_matmul(rows, self.weight_fp8, self.weight_scale_row.view(-1))
        else:
            out = self._dequantized_matmul(rows)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def _dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype, device=rows.device)
        shape = (self.out_features, self.in_features)
        for start in range(0, self.out_features, TILE_ROWS):
            part = slice(start, min(start + TILE_ROWS, self.out_features))
            scale = expand_scale(self.weight_scale, part, shape, self.block).to(rows.dtype)
            torch.mm(rows, (self.weight_fp8[part].to(rows.dtype) * scale).T, out=out[:, part])
        return out

    def extra_repr(self) -> str:
        kind = "tensor" if self.weight_scale.numel() == 1 and self.block is None else \
            "channel" if self.block is None else f"block {self.block[0]}x{self.block[1]}"
        matmul = {"scaled_mm": "torch._scaled_mm, activations e4m3 per token",
                  "dequantize": "dequantized into the activations' dtype"}.get(self.kernel_choice.named,
                                                                              self.kernel_choice.named or "auto")
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, {kind} scales, {matmul}"
