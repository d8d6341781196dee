"""The quantizer interface: transform weights (and modules) at load time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from tessellm.core.plugin import Plugin, PluginOptions


@dataclass
class CalibrationContext:
    """What a quantizer may use to observe the float model (``Quantizer.calibrate``)."""

    tokenizer: Any
    """The model's tokenizer (a transformers tokenizer: ``tokenizer(text)["input_ids"]``)."""
    run: Callable[[list[int]], torch.Tensor]
    """Teacher-forced forward of token ids through the float model with the pipeline's own
    attention backend and cache; returns the logits [len, vocab]."""
    max_tokens: int
    """The longest token list ``run`` takes (the pipeline's max_model_len)."""


class Quantizer(Plugin):
    """Transforms a loaded model once, before the first forward.

    Contract: ``calibrate(model, ctx)``, if the plugin overrides it, observes the float model
    first (a calibration text run through it); then ``apply(model)`` returns the model to
    run, typically with ``nn.Linear`` layers swapped for quantized ones (gpt-fast style: walk
    the children, replace, keep names). It must leave the forward signature unchanged; it
    may keep a float copy of nothing it replaces. Quantized KV storage is a cache plugin's
    job, not a quantizer's.

    The model stacks each layer's q/k/v and gate/up projections into one product each before
    ``apply`` (``ModelArchitecture.after_load``, outside float64), so ``apply`` may meet
    ``qkv_proj`` and ``gate_up_proj``, whose ``stacked_parts`` name the parts (core carries
    that attribute over to the module put in their place). A checkpoint's stored quantized
    projections (``load_quantized``) are built before that: a module type a quantizer makes
    may define a classmethod ``stack(modules)``, which the stacking calls with one layer's
    q/k/v (or gate/up) modules of that type and which returns one module computing them side
    by side (outputs concatenated in order), or None where they cannot be joined; a type
    without it stays apart (plugin API 1.14).

    ``max_relative_error`` is the forward error the quantizer promises: over a batch of
    prompts, ||logits_quantized - logits_float|| / ||logits_float|| (Frobenius norms over
    every position, the float model being the same pipeline with quant ``none``) stays at or
    below it. The quant conformance suite holds a plugin to the bound it declares; declare
    the tightest one it meets. Where the error depends on the options (bits, group size),
    override ``error_bound(options)``; by default it is ``max_relative_error`` for any options.
    """

    kind: ClassVar[str] = "quant"
    max_relative_error: ClassVar[float] = 0.05
    """Declared bound on the relative logits error (see above). The default, 5%, is about
    what 4-bit weight-only quantization costs a small model; 8-bit schemes meet ~1%."""

    @classmethod
    def error_bound(cls, options: PluginOptions) -> float:
        """The relative logits error promised with ``options`` (validated by ``Options``):
        ``max_relative_error`` unless the quantizer overrides this. The quant suite holds the
        plugin to this bound."""
        return cls.max_relative_error

    def __init__(self, options: PluginOptions, device: torch.device, dtype: torch.dtype):
        self.options = options
        self.device = device
        self.dtype = dtype

    def calibrate(self, model: nn.Module, ctx: CalibrationContext) -> None:
        """Observe the float model before ``apply`` (plugin API 1.2; optional). The pipeline
        calls it only on a quantizer that overrides it: after the float model, its cache and
        attention backend are built, before ``apply``, warm-up and CUDA graph capture, under
        ``torch.inference_mode``. Typically: register forward hooks on the modules ``apply``
        will replace, run a text through ``ctx.run``, remove the hooks and keep the statistics
        (activation ranges) for ``apply``."""

    def apply(self, model: nn.Module) -> nn.Module:
        """Return the model to run (identity by default)."""
        return model

    @classmethod
    def checkpoint_support(cls, quantization_config: dict[str, Any]) -> str | None:
        """Whether this quantizer loads a pre-quantized checkpoint, whose config.json declares
        ``quantization_config`` (plugin API 1.11): None when it does, else why not. A
        checkpoint no installed quantizer reads is refused at load with every reason; with
        ``quant.name: auto`` the first quantizer that reads it is chosen."""
        return "it reads no pre-quantized checkpoint"

    def load_quantized(self, model: nn.Module, state: dict[str, torch.Tensor],
                       quantization_config: dict[str, Any]) -> None:
        """Build, in place, the modules of ``model`` that the checkpoint stores quantized
        (plugin API 1.11; called only where ``checkpoint_support`` returned None). ``model``
        is on the meta device, before any weight is loaded; ``state`` holds the checkpoint's
        tensors under the model's parameter names. Replace each such module by one built from
        its tensors and remove the tensors used from ``state``: the rest then load as usual,
        and ``apply`` is not called."""
        raise NotImplementedError(f"quant plugin {self.name!r} declares checkpoint support but has no load_quantized")

    @classmethod
    def checkpoint_shard_rule(cls, suffix: str, weight_rule: Any, quantization_config: dict[str, Any]) -> Any:
        """How a tensor-parallel rank reads the pre-quantized checkpoint tensor ``<linear>.<suffix>``
        (plugin API 1.11): ``weight_rule`` is the rule the linear's float ``weight`` [out, in]
        would have (``(dim, lo, hi)``, a list of dim-0 slices, or None: whole); return this
        tensor's rule in the same forms, or ``NotImplemented`` for a suffix that is not this
        quantizer's (the usual rules apply). Raise ModelLoadError for a split its layout
        cannot take (a boundary inside a packed word or a group). Default: NotImplemented."""
        return NotImplemented
