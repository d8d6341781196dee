"""The quantizer interface: transform weights (and modules) at load time."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tessellm.core.plugin import Plugin, PluginOptions


class Quantizer(Plugin):
    """Transforms a loaded model once, before the first forward.

    Contract: ``apply(model)`` returns the model to run, typically with ``nn.Linear`` layers
    swapped for quantized ones (gpt-fast style: walk the children, replace, keep names). It
    must leave the forward signature unchanged; it may keep a float copy of nothing it
    replaces. Quantized KV storage is a cache plugin's job, not a quantizer's.
    """

    kind: ClassVar[str] = "quant"

    def __init__(self, options: PluginOptions, device: torch.device, dtype: torch.dtype):
        self.options = options
        self.device = device
        self.dtype = dtype

    def apply(self, model: nn.Module) -> nn.Module:
        """Return the model to run (identity by default)."""
        return model
