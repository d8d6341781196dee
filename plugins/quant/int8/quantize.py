"""Symmetric int8 weight quantization and its plain-torch reference.

A weight [N, K] becomes int8 values q and float scales: one scale per output channel
(``group_size`` None, scale [N]) or one per group of ``group_size`` consecutive input
channels (scale [N, K // group_size]). Each scale is the group's largest magnitude over 127,
so w ~ q * scale with |q| <= 127 and an error of at most scale / 2 per weight.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tessellm.core.errors import ConfigError


def quantize_per_channel(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale float32 [N] or [N, K // group_size]) of ``weight`` [N, K]."""
    n, k = weight.shape
    w = weight.detach().float()
    if group_size is not None:
        if k % group_size:
            raise ValueError(f"group_size {group_size} does not divide in_features {k}")
        w = w.view(n, k // group_size, group_size)
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = (w / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.view(n, k), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that ``q`` and ``scale`` stand for (the reference)."""
    n, k = q.shape
    if scale.dim() == 1:
        return q.float() * scale[:, None]
    groups = scale.shape[1]
    return (q.view(n, groups, k // groups).float() * scale[..., None]).view(n, k)


def reference_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(q, scale).T (+ bias) in float64: what every kernel is held to."""
    out = x.double() @ dequantize(q, scale).double().T
    return out if bias is None else out + bias.double()


KEPT_FLOAT = frozenset({"shared_expert_gate"})
"""Linears left in the model dtype whatever the options: the MoE block's shared-expert gate
(core/model/moe.py; Qwen2-MoE), one output whose sigmoid scales the whole shared expert.
Quantizing its hidden_size weights saves nothing worth the error (and torch._int_mm on CUDA
cannot take one output channel). The MoE router (``mlp.gate``, moe.Router) is no nn.Linear and
stays in float32 too."""


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module], quantize_lm_head: bool,
                    plugin: str) -> nn.Module:
    """Replace every ``nn.Linear`` of model (``lm_head`` only when quantize_lm_head; never one
    named in ``KEPT_FLOAT``) by ``make(full_name, linear)`` at the same name; a model with none
    is a ConfigError naming the plugin."""
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child_name in KEPT_FLOAT or \
                    (child_name == "lm_head" and not quantize_lm_head):
                continue
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            setattr(parent, child_name, make(full, child))
            replaced += 1
    if replaced == 0:
        raise ConfigError(f"quant plugin {plugin!r} found no nn.Linear to quantize in {type(model).__name__}")
    return model
