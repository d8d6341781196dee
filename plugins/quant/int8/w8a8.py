"""Quant `w8a8`: int8 weights and int8 activations, an int8 x int8 -> int32 matmul.

Weights are int8 with one scale per output channel, quantized once at load. Each forward
quantizes its input per token (row): scale = the row's largest magnitude over 127. The
product of the two int8 operands accumulates exactly in int32 (``torch._int_mm``) and is
scaled back by the token's and the channel's scales. Embeddings stay in the model dtype, and
so does ``lm_head`` unless ``quantize_lm_head`` is set.

With ``smoothquant_alpha`` set, ``calibrate`` first runs a calibration text (smooth.py's
default: the opening of Julius Caesar) through the float model, recording each linear's
largest input per channel, and ``apply`` smooths every linear with SmoothQuant's scales
before quantizing it (smooth.py).

Which path runs, by measurement (bench/int8_linear.py, docs/benchmarks.md): on the CPU
``torch._int_mm`` above ``small_batch_rows`` rows; up to it, with ``cpu_kernel: auto``,
``torch._int_mm`` too where torch's kernels run AVX-512 and the CPU has VNNI (int8 dot
products), and elsewhere (an AVX2-only CPU, where ``_int_mm`` at a few rows is slower than
float32) the fastest of `int8-weight`'s few-rows paths (activations in the model dtype),
timed on the largest layer at load. The choice follows the CPU's features, so every rank of
a tensor-parallel run on one machine makes the same one. On CUDA the ``kernel`` option
chooses among ``int_mm`` (``torch._int_mm``; both feature counts multiples of 8, steps of
16 rows or fewer padded to 17, as it needs more than 16), ``int_mm_compiled`` (the same,
``torch.compile``d so the quantization and the scaling fuse around it), ``triton`` (the
int8 x int8 Triton kernel, any shape; triton_w8a8.py) and ``triton_weight_only``
(`int8-weight`'s Triton kernel on activations in the model dtype, what decode-sized steps
gain from: no quantization pass); ``auto`` picks per layer shape and row count from the kernel
table (kernel_table.py).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import Field, field_validator
from torch import nn

import tessellm
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.quantizer import CalibrationContext, Quantizer
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.quant.compressed_tensors_config import compressed_tensors_problem
from tessellm.plugins.quant.int8.cpu import fastest, int8_weight_matmul, int8pack_matmul, tiled_matmul
from tessellm.plugins.quant.int8.linear import Int8Linear
from tessellm.plugins.quant.int8.quantize import replace_linears
from tessellm.plugins.quant.int8.smooth import (DEFAULT_CALIBRATION_TEXT, calibration_chunks, experts_one_at_a_time,
                                                observe_input_ranges, smoothing_scales)
from tessellm.plugins.quant.kernel_table import KernelChoice, check_named, choose
from tessellm.plugins.quant.stored_linears import refuse_unread, replace_stored_linears

CUDA_MIN_ROWS = 17
"""torch._int_mm on CUDA takes only more than 16 rows (fewer are padded with zero rows)."""

logger = logging.getLogger(__name__)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], float32 scale [M, 1]) of activations x [M, K], one scale per row."""
    scale = x.detach().float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def w8a8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float @ (q [N, K] int8 * scale [N]).T with x quantized per token: an exact
    int32 product of the int8 operands, scaled back; [M, N] in x's dtype."""
    xq, x_scale = quantize_per_token(x)
    m = xq.shape[0]
    if xq.is_cuda and m < CUDA_MIN_ROWS:
        xq = torch.nn.functional.pad(xq, (0, 0, 0, CUDA_MIN_ROWS - m))
    acc = torch._int_mm(xq, q.T)[:m]  # [M, N] int32
    return (acc.float() * x_scale * scale[None, :]).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_w8a8():
    return torch.compile(w8a8_matmul, dynamic=True)


def compiled_w8a8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w8a8_matmul`` through ``torch.compile``: the per-token quantization and the scaling
    become one fused kernel each around ``torch._int_mm``."""
    return _compiled_w8a8()(x, q, scale)


def int8_dot_products() -> bool:
    """Whether torch's CPU kernels run AVX-512 (not limited by ATEN_CPU_CAPABILITY) on a CPU
    with VNNI: where ``torch._int_mm`` beats float32 at a few rows."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and torch.cpu._is_vnni_supported()


def reference_w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 product of the dequantized operands (what ``w8a8_matmul`` computes)."""
    xq, x_scale = quantize_per_token(x)
    return (xq.double() * x_scale.double()) @ (q.double() * scale.double()[:, None]).T


class W8A8Linear(Int8Linear):
    """``nn.Linear``'s forward with int8 weights (per output channel) and activations
    quantized per token at each call; the float weight is not kept. With ``smooth`` (s, one
    factor per input channel) it holds the int8 of ``W * s`` and divides its input by s
    before quantizing it (SmoothQuant)."""

    def __init__(self, linear: nn.Linear, smooth: torch.Tensor | None = None, kernel_choice: KernelChoice | None = None):
        weight = None if smooth is None else linear.weight * smooth.to(linear.weight)[None, :]
        super().__init__(linear, None, weight)
        self.register_buffer("inv_smooth", None if smooth is None else (1.0 / smooth).to(linear.weight))
        self._choose(kernel_choice)

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       kernel_choice: KernelChoice | None = None) -> "W8A8Linear":
        module = super().from_quantized(q, scale, bias)
        module.register_buffer("inv_smooth", None)
        module._choose(kernel_choice)
        return module

    def _choose(self, kernel_choice: KernelChoice | None) -> None:
        self.int_mm_shape = self.in_features % 8 == 0 and self.out_features % 8 == 0
        self.kernel_choice = kernel_choice or KernelChoice("w8a8", None)
        self._cuda_dispatch = None

    SMALL_KERNELS = ("int_mm", "compiled", "int8pack", "tiled")
    """The CPU's few-rows paths: w8a8's own int8 x int8 product, or `int8-weight`'s paths
    (the compiled reduction, torch's int8pack kernel, tiles + BLAS) on float activations."""
    KERNELS = ("int_mm", "int_mm_compiled", "triton", "triton_weight_only")
    """Every kernel the ``kernel`` option names (see the module's docstring)."""
    small_kernel = "int_mm"
    small_batch_rows = 0

    def small_rows(self, kernel: str, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (smoothing applied) through ``kernel``: one of ``KERNELS`` or ``SMALL_KERNELS``."""
        if kernel == "int_mm":
            return w8a8_matmul(rows, self.weight_int8, self.scale)
        if kernel == "int_mm_compiled":
            return compiled_w8a8_matmul(rows, self.weight_int8, self.scale)
        if kernel == "triton":
            from tessellm.plugins.quant.int8.triton_w8a8 import triton_w8a8_matmul

            return triton_w8a8_matmul(rows, self.weight_int8, self.scale)
        if kernel == "triton_weight_only":
            from tessellm.plugins.quant.int8.triton_matmul import triton_int8_weight_matmul

            return triton_int8_weight_matmul(rows, self.weight_int8, self.scale)
        if kernel == "compiled":
            return int8_weight_matmul(rows, self.weight_int8, self.scale)
        if kernel == "int8pack":
            return int8pack_matmul(rows, self.weight_int8, self.scale)
        return tiled_matmul(rows, self.weight_int8, self.scale)

    def unfit(self, kernel: str) -> str | None:
        """Why this layer cannot run ``kernel`` (None: it can)."""
        if kernel.startswith("int_mm") and not self.int_mm_shape:
            return f"torch._int_mm needs both feature counts multiples of 8 ({self.out_features} x {self.in_features})"
        return None

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.inv_smooth is not None:
            rows = rows * self.inv_smooth
        if self.kernel_choice.named is not None:
            return self.small_rows(self.kernel_choice.named, rows)
        if rows.device.type == "cpu" and rows.shape[0] <= self.small_batch_rows:
            return self.small_rows(self.small_kernel, rows)
        if rows.device.type == "cuda":
            return self.small_rows(self.cuda_dispatch().pick(rows.shape[0]), rows)
        return w8a8_matmul(rows, self.weight_int8, self.scale)

    def extra_repr(self) -> str:
        smoothed = ", smoothed" if self.inv_smooth is not None else ""
        few = f", up to {self.small_batch_rows} rows: {self.small_kernel}" if self.small_batch_rows else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and "
                f"activations{smoothed}{few}")


class W8A8Options(PluginOptions):
    """Options of `w8a8`."""

    quantize_lm_head: bool = False
    """Also quantize lm_head (its error reaches every logit directly)."""
    smoothquant_alpha: Optional[float] = Field(None, ge=0.0, le=1.0)
    """SmoothQuant's migration strength: None (no smoothing), or 0 to 1 (0.5 balances the
    activations' and the weights' ranges; larger moves more range into the weights)."""
    calibration_text: Optional[str] = None
    """A UTF-8 text file to calibrate the smoothing on; None: the bundled opening of Julius
    Caesar (smooth.py)."""
    calibration_tokens: int = Field(1024, ge=16, le=1 << 16)
    """Tokens of the calibration text run through the float model."""
    small_batch_rows: int = Field(6, ge=0, le=256)
    """On the CPU, steps of up to this many rows take ``cpu_kernel``'s path."""
    kernel: Literal["auto", "int_mm", "int_mm_compiled", "triton", "triton_weight_only"] = "auto"
    """The matmul. ``auto``: on CUDA per layer shape and row count from ``kernel_table``; on the
    CPU ``cpu_kernel`` up to ``small_batch_rows`` rows and ``int_mm`` above. A named kernel
    runs every step on any device that can run it (the Triton ones on CUDA, or under
    TRITON_INTERPRET=1); see the module's docstring. A layer it cannot run is refused at load."""
    kernel_table: Optional[str] = None
    """A kernel table written by ``bench/quant_kernels.py --table`` (JSON); None: the default
    for Hopper (plugins/quant/kernel_tables/sm_90.json)."""
    cpu_kernel: Literal["auto", "int_mm", "compiled", "int8pack", "tiled"] = "auto"
    """The CPU's path for up to ``small_batch_rows`` rows: ``int_mm`` (int8 activations, as
    above), or `int8-weight`'s ``compiled``, ``int8pack`` or ``tiled`` (activations in the
    model dtype, as CUDA runs decode-sized steps); ``auto`` times them on the largest layer at
    load and keeps the fastest on this CPU."""

    @field_validator("calibration_text")
    @classmethod
    def _readable(cls, path: Optional[str]) -> Optional[str]:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{path!r} is not a file; give a UTF-8 text file or null for the bundled text")
        return path


class W8A8Quantizer(Quantizer):
    """int8 weights per output channel and int8 activations per token for the decoder
    layers' linears (and optionally lm_head); int32 accumulation. With smoothquant_alpha,
    ``calibrate`` must run before ``apply`` (a Pipeline does that)."""

    name = "w8a8"
    api_version = "1.19"
    description = "int8 weights (per channel) x int8 activations (per token), int32 accumulation"
    Options = W8A8Options
    auto_priority = None  # quantization changes results: only when named
    max_relative_error = 0.06

    def __init__(self, options: W8A8Options, device: torch.device, dtype: torch.dtype):
        super().__init__(options, device, dtype)
        self.input_ranges: dict[str, torch.Tensor] = {}

    def calibrate(self, model: nn.Module, ctx: CalibrationContext) -> None:
        """With smoothquant_alpha: record each linear's largest input per channel on the
        calibration text."""
        options = self.options
        if options.smoothquant_alpha is None:
            return
        path = Path(options.calibration_text) if options.calibration_text else DEFAULT_CALIBRATION_TEXT
        try:
            ids = ctx.tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"quant.options.calibration_text {str(path)!r} cannot be read as UTF-8 text: {exc}") from None
        if len(ids) < 16:
            raise ConfigError(f"quant.options.calibration_text {str(path)!r} has {len(ids)} tokens; give at least 16")
        linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
        chunks = calibration_chunks(ids, options.calibration_tokens, min(512, ctx.max_tokens))
        with experts_one_at_a_time(model):
            self.input_ranges = observe_input_ranges(linears, ctx.run, chunks)

    def apply(self, model: nn.Module) -> nn.Module:
        alpha = self.options.smoothquant_alpha
        if alpha is not None and not self.input_ranges:
            raise ConfigError(f"quant plugin {self.name!r} with smoothquant_alpha needs calibrate(model, ctx) before "
                              f"apply (a Pipeline calls it)")

        choice = self.kernel_choice()

        def make(name: str, linear: nn.Linear) -> nn.Module:
            seen = self.input_ranges.get(name) if alpha is not None else None
            layer = W8A8Linear(linear, None if seen is None else smoothing_scales(seen, linear.weight, alpha), choice)
            check_named(choice.named, name, layer.unfit, W8A8Linear.KERNELS)
            return layer

        model = replace_linears(model, make, self.options.quantize_lm_head, self.name)
        self._choose_small_kernel(model)
        return model

    def kernel_choice(self) -> KernelChoice:
        """The layers' kernel choice from the ``kernel`` and ``kernel_table`` options."""
        return choose(self.name, self.options.kernel, self.options.kernel_table, self.device,
                      triton_kernels=("triton", "triton_weight_only"))

    def _choose_small_kernel(self, model: nn.Module) -> None:
        """On the CPU, the few-rows path of every layer: the option, or (auto) the fastest at
        one row on the largest layer, logged."""
        layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
        if self.device.type != "cpu" or not layers or not self.options.small_batch_rows or self.options.kernel != "auto":
            return
        kernel = self.options.cpu_kernel
        if kernel == "auto" and int8_dot_products():
            kernel = "int_mm"
        elif kernel == "auto":
            largest = max(layers, key=lambda m: m.weight_int8.numel())
            x = torch.randn(1, largest.in_features, dtype=self.dtype)
            weight_only = W8A8Linear.SMALL_KERNELS[1:]
            with torch.inference_mode():
                kernel = fastest({k: (lambda k=k: largest.small_rows(k, x)) for k in weight_only})
            logger.info("w8a8: no AVX-512 VNNI for int8 products: up to %d rows, %s (the fastest of %s) on float "
                        "activations", self.options.small_batch_rows, kernel, ", ".join(weight_only))
        for layer in layers:
            layer.small_kernel, layer.small_batch_rows = kernel, self.options.small_batch_rows

    @classmethod
    def checkpoint_support(cls, quantization_config: dict[str, Any]) -> str | None:
        """compressed-tensors ``int-quantized`` W8A8: int8 weights per channel, symmetric, and
        activations quantized per token at run time (what this plugin computes)."""
        method = quantization_config.get("quant_method")
        if method != "compressed-tensors":
            return f"quant_method {method!r} is not one it reads (compressed-tensors)"

        def dynamic_tokens(name: str, group: dict[str, Any]) -> str | None:
            weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
            if not weights.get("symmetric", True):
                return f"config group {name!r} has asymmetric weights (w8a8 reads symmetric)"
            if not acts or acts.get("num_bits") != 8 or acts.get("type") != "int" or acts.get("strategy") != "token" \
                    or not acts.get("dynamic") or not acts.get("symmetric", True):
                return (f"config group {name!r} has input activations {acts or None} (w8a8 reads 8-bit int, "
                        f"symmetric, per token, dynamic)")
            return None

        return compressed_tensors_problem(quantization_config, "w8a8", "int-quantized", 8, "int", ("channel",),
                                          dynamic_tokens)

    @classmethod
    def checkpoint_shard_rule(cls, suffix: str, weight_rule: Any, quantization_config: dict[str, Any]) -> Any:
        """The per-channel ``weight_scale`` [out, 1] follows the weight's output rows; a share
        of the input channels reads it whole."""
        if suffix != "weight_scale":
            return NotImplemented
        if weight_rule is None or isinstance(weight_rule, list):
            return weight_rule
        return weight_rule if weight_rule[0] == 0 else None

    def load_quantized(self, model: nn.Module, state: dict[str, torch.Tensor],
                       quantization_config: dict[str, Any]) -> None:
        """Every linear whose weight the checkpoint stores as int8 becomes a ``W8A8Linear``
        with the checkpoint's weights and scales."""
        choice = self.kernel_choice()

        def build(name: str, linear: nn.Linear) -> nn.Module | None:
            weight = state.get(f"{name}.weight")
            if weight is None or weight.dtype != torch.int8:
                return None
            q, scale = state.pop(f"{name}.weight").to(self.device), state.pop(f"{name}.weight_scale")
            bias = state.pop(f"{name}.bias", None)
            layer = W8A8Linear.from_quantized(q, scale.float().reshape(-1).to(self.device),
                                              None if bias is None else bias.to(self.device, self.dtype), choice)
            check_named(choice.named, name, layer.unfit, W8A8Linear.KERNELS)
            return layer

        replace_stored_linears(model, build)
        refuse_unread(state, self.name, "int8 tensors", lambda _, tensor: tensor.dtype == torch.int8)
        self._choose_small_kernel(model)


@tessellm.hookimpl
def register_quant(register):
    register(W8A8Quantizer)
