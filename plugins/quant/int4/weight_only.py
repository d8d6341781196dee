"""Quant `int4-weight`: group-wise asymmetric int4 weights, activations in the model dtype.

Every ``nn.Linear`` of the decoder layers becomes an ``Int4WeightLinear`` at the same name,
quantized once at load (quantize.py): groups of ``group_size`` input channels, each with a
scale and an offset. Embeddings stay in the model dtype, and so does ``lm_head`` unless
``quantize_lm_head`` is set. Decode is memory-bound: half a byte a weight is the speed-up.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from pydantic import Field
from torch import nn

import tessellm
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.quantizer import Quantizer
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.quant.cpu.choice import rows_table
from tessellm.plugins.quant.cpu.int8_dot import int4_unfit as int8_dot_unfit
from tessellm.plugins.quant.int4.checkpoints import checkpoint_support, read_linear, shard_rule
from tessellm.plugins.quant.int4.cpu import int4pack_unfit
from tessellm.plugins.quant.int4.linear import Int4WeightLinear
from tessellm.plugins.quant.int4.quantize import Int4Weight
from tessellm.plugins.quant.int8.quantize import replace_linears
from tessellm.plugins.quant.kernel_table import KernelChoice, check_named, choose
from tessellm.plugins.quant.stored_linears import refuse_unread, replace_stored_linears


class Int4WeightOptions(PluginOptions):
    """Options of `int4-weight`."""

    group_size: Literal[32, 64, 128, 256] = 64
    """Input channels sharing one scale and offset; a layer whose in_features it does not
    divide gets a shorter last group."""
    quantize_lm_head: bool = False
    """Also quantize lm_head (the largest matrix of a small model; its error reaches every
    logit directly)."""
    kernel: Literal["auto", "triton", "tinygemm", "int4pack", "compiled", "tiled"] = "auto"
    """The matmul. ``auto``: on CUDA per layer shape and row count from ``kernel_table``; on the
    CPU ``cpu_kernel``. A named kernel runs every step on any device that can run it:
    ``triton`` (CUDA, or TRITON_INTERPRET=1), ``tinygemm`` (torch's CUDA int4 kernel,
    bfloat16 inside; CUDA only), ``int4pack`` (torch's CPU int4 kernel, bfloat16 inside),
    ``compiled`` (a ``torch.compile``d dequantize-and-reduce; whole groups), ``tiled``
    (dequantize tiles, then the BLAS / cuBLAS). A layer the named kernel cannot run is
    refused at load."""
    kernel_table: Optional[str] = None
    """A kernel table written by ``bench/quant_kernels.py --table`` (JSON); None: the default
    for Hopper (plugins/quant/kernel_tables/sm_90.json)."""
    cpu_kernel: Literal["auto", "int4pack", "int8-dot", "tiled"] = "auto"
    """On the CPU, for few rows: ``int4pack`` torch's int4 kernel (bfloat16 activations inside;
    every quantized layer must fit it), ``int8-dot`` int8 activations (per block of 32) times
    the int4 weights summed in int32 by the CPU's integer dot products (AVX2 or VNNI; a C++
    kernel built at first use, plugins/quant/cpu), ``tiled`` dequantize-then-BLAS. ``auto``
    times the kernels the layers fit on the largest layer at load, at 1, 4, 16 and 64 rows,
    and keeps the fastest for each range of rows (logged)."""
    small_batch_rows: int = Field(128, ge=0, le=1024)
    """Token rows up to which the CPU runs its few-rows kernel; above, the tiled path."""
    int8_dot_digits: Literal[1, 2] = 2
    """The int8 digits of each activation the ``int8-dot`` kernel multiplies: 1 is llama.cpp's
    arithmetic (int8 in blocks of 32, each value rounded to 1/254 of its block's largest:
    fastest), 2 adds a digit for the first's rounding (about 15 bits: float activations'
    perplexity, twice the integer products)."""


class Int4WeightQuantizer(Quantizer):
    """int4 weight-only quantization of the decoder layers' linears (and optionally lm_head)."""

    name = "int4-weight"
    api_version = "1.19"
    description = "group-wise asymmetric int4 weights, activations in the model dtype; dequantized inside the matmul"
    Options = Int4WeightOptions
    auto_priority = None  # quantization changes results: only when named
    max_relative_error = 0.75

    @classmethod
    def error_bound(cls, options: PluginOptions) -> float:
        # Random weights are int4's worst case (no structure, 16 levels over each group's
        # range: ~8-10% rms error a weight), and the tiny conformance model's logits come out
        # 20-41% off, more with lm_head quantized too. Real checkpoints lose far less: the
        # perplexity bound on SmolLM2 (tests/plugins/test_int4_quality.py) is the quality test.
        bound = {32: 0.4, 64: 0.45, 128: 0.5}.get(options.group_size, 0.55)
        return bound + (0.2 if options.quantize_lm_head else 0.0)

    def kernel_choice(self) -> KernelChoice:
        """The layers' kernel choice from the ``kernel`` and ``kernel_table`` options."""
        return choose(self.name, self.options.kernel, self.options.kernel_table, self.device,
                      triton_kernels=("triton",), cuda_kernels=("tinygemm",))

    def _int4pack(self, out_features: int, in_features: int, group_size: int, layer: str) -> bool:
        """Whether a CPU layer holds torch's int4pack layout too (a ConfigError where it is
        named, by ``cpu_kernel`` or ``kernel``, and the layer cannot take it)."""
        options = self.options
        unfit = int4pack_unfit(out_features, in_features, group_size)
        which = "kernel" if options.kernel == "int4pack" else "cpu_kernel" if options.cpu_kernel == "int4pack" else None
        if self.device.type == "cpu" and which and unfit:
            raise ConfigError(f"quant.options.{which} 'int4pack': torch's CPU int4 kernel cannot run {layer} "
                              f"({unfit}); use auto or tiled")
        return self.device.type == "cpu" and options.cpu_kernel in ("auto", "int4pack") and not unfit and \
            options.kernel in ("auto", "int4pack")

    def _check_int8_dot(self, out_features: int, in_features: int, group_size: int, layer: str) -> None:
        """A ConfigError where ``cpu_kernel`` names int8-dot and the layer cannot take it."""
        if self.device.type != "cpu" or self.options.cpu_kernel != "int8-dot" or self.options.kernel != "auto":
            return
        unfit = int8_dot_unfit(out_features, in_features, group_size)
        if unfit:
            raise ConfigError(f"quant.options.cpu_kernel 'int8-dot' cannot run {layer} ({unfit}); use "
                              f"cpu_kernel auto, int4pack or tiled")

    def apply(self, model: nn.Module) -> nn.Module:
        options = self.options
        choice = self.kernel_choice()

        def make(full: str, linear: nn.Linear) -> nn.Module:
            if linear.in_features % 2:
                raise ConfigError(f"quant 'int4-weight': {full} has an odd in_features ({linear.in_features}); "
                                  f"int4 packs two values a byte")
            self._check_int8_dot(linear.out_features, linear.in_features, options.group_size, full)
            layer = Int4WeightLinear.from_linear(
                linear, options.group_size, small_batch_rows=options.small_batch_rows, kernel_choice=choice,
                int4pack=self._int4pack(linear.out_features, linear.in_features, options.group_size, full))
            check_named(choice.named, full, layer.unfit, Int4WeightLinear.KERNELS)
            return layer

        model = replace_linears(model, make, options.quantize_lm_head, self.name)
        self._choose_cpu_kernels(model)
        return model

    def _choose_cpu_kernels(self, model: nn.Module) -> None:
        """Each CPU layer's few-rows kernels: the one named, or (``auto``) the fastest of those
        that fit, timed on the largest layer (lm_head only if it is the only one). A layer some
        kernel does not fit keeps the default (int4pack where it fits, else tiled); torch's
        packed copy is let go where no range runs it. Not on other devices, nor where
        ``kernel`` names the kernel for every step."""
        options = self.options
        if self.device.type != "cpu" or options.kernel != "auto":
            return
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, Int4WeightLinear)]
        if not named:
            return
        layers = [m for _, m in named]
        for layer in layers:
            layer.dot_digits = options.int8_dot_digits
        if options.cpu_kernel == "auto":
            timed = max([m for name, m in named if name.rpartition(".")[2] != "lm_head"] or layers,
                        key=lambda m: m.weight_packed.numel())
            fit = [k for k in Int4WeightLinear.SMALL_KERNELS if self._fits(k, timed)]
            table = rows_table(timed.run, fit, timed.in_features, options.small_batch_rows, self.dtype,
                               f"int4-weight g{options.group_size}")
        else:
            table = ((options.small_batch_rows, options.cpu_kernel),) if options.small_batch_rows else ()
        for layer in layers:
            if all(self._fits(kernel, layer) for _, kernel in table):
                layer.few_rows = table
            if not any(kernel == "int4pack" for _, kernel in layer.few_rows):
                layer.int4pack_weight = layer.int4pack_scales = None

    @staticmethod
    def _fits(kernel: str, layer: Int4WeightLinear) -> bool:
        if kernel == "int4pack":
            return layer.int4pack_weight is not None
        if kernel == "int8-dot":
            return int8_dot_unfit(layer.out_features, layer.in_features, layer.group_size) is None
        return True

    @classmethod
    def checkpoint_support(cls, quantization_config: dict[str, Any]) -> str | None:
        return checkpoint_support(quantization_config)

    @classmethod
    def checkpoint_shard_rule(cls, suffix: str, weight_rule: Any, quantization_config: dict[str, Any]) -> Any:
        return shard_rule(suffix, weight_rule, quantization_config)

    def load_quantized(self, model: nn.Module, state: dict[str, torch.Tensor],
                       quantization_config: dict[str, Any]) -> None:
        """Every linear the checkpoint stores as 4-bit (compressed-tensors, GPTQ, AWQ)
        becomes an ``Int4WeightLinear`` with the checkpoint's groups (``group_size`` is not
        used)."""
        options = self.options
        choice = self.kernel_choice()

        def build(name: str, linear: nn.Linear) -> nn.Module | None:
            read = read_linear(state, name, linear.out_features, linear.in_features, quantization_config)
            if read is None:
                return None
            weight, perm = read
            weight = Int4Weight(*(t.to(self.device) for t in (weight.packed, weight.scale, weight.offset)),
                                weight.group_size)
            bias = state.pop(f"{name}.bias", None)
            fits = self._int4pack(linear.out_features, linear.in_features, weight.group_size, name)
            layer = Int4WeightLinear(weight, linear.out_features,
                                     None if bias is None else bias.to(self.device, self.dtype), use_int4pack=fits,
                                     small_batch_rows=options.small_batch_rows, kernel_choice=choice,
                                     input_perm=None if perm is None else perm.to(self.device))
            check_named(choice.named, name, layer.unfit, Int4WeightLinear.KERNELS)
            return layer

        replace_stored_linears(model, build)
        self._choose_cpu_kernels(model)
        refuse_unread(state, self.name, "packed 4-bit tensors",
                      lambda name, _: name.endswith((".weight_packed", ".qweight", ".qzeros")))


@tessellm.hookimpl
def register_quant(register):
    register(Int4WeightQuantizer)
