"""The MLP (gated: SwiGLU, GeGLU; or plain) and the stacking of projections into one GEMM, below both
the decoder layer and the mixture of experts, which build on them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessellm.core.interfaces.spec import ModelSpec


def _stacked(**linears: nn.Module) -> nn.Module | None:
    """One module computing ``linears`` side by side (outputs concatenated in order), its
    ``stacked_parts`` naming each part and its width (a LoRA adapter targets the parts); None
    where they cannot be one. Plain ``nn.Linear`` weights are concatenated; other modules of
    one type go through that type's ``stack(modules)`` classmethod (a quantized linear's
    packed weights and scales, as a pre-quantized checkpoint stores them), which returns None
    for parts it cannot join; a type without one stays apart."""
    modules = list(linears.values())
    kind = type(modules[0])
    if any(type(m) is not kind for m in modules):
        return None
    stack = _stack_float_linears if kind is nn.Linear else getattr(kind, "stack", None)
    out = None if stack is None else stack(modules)
    if out is not None:
        out.stacked_parts = tuple((name, m.out_features) for name, m in linears.items())
    return out


def _stack_float_linears(linears: list[nn.Linear]) -> nn.Linear:
    first = linears[0]
    bias = first.bias is not None
    out = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=bias,
                    device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([m.weight for m in linears]))
        if bias:
            out.bias.copy_(torch.cat([m.bias for m in linears]))
    return out.requires_grad_(False)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "relu": F.relu}
"""The MLP's activations by ``ModelSpec.mlp_activation`` (core/model/spec.py ``ACTIVATION_NAMES``
maps Hugging Face's ``hidden_act`` names onto these)."""


class MLP(nn.Module):
    """The MLP: gated (``spec.gated_mlp``, the default), down(act(gate(x)) * up(x)) with SiLU
    (SwiGLU) or tanh-GELU (GeGLU); or plain, down(act(up(x))) with no ``gate_proj``
    (GPT-NeoX's dense_h_to_4h, GELU, dense_4h_to_h)."""

    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None):
        super().__init__()
        h, i = spec.hidden_size, intermediate_size or spec.intermediate_size
        self.act = ACTIVATIONS[spec.mlp_activation]
        self.gated = spec.gated_mlp
        self.swiglu = self.gated and spec.mlp_activation == "silu"  # what the fused kernels compute
        if self.gated:
            self.gate_proj = nn.Linear(h, i, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=spec.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """Replace gate/up_proj by one ``gate_up_proj`` (their weights stacked); kept apart
        where a subclass has its own ``forward``, and where there is no gate."""
        if self.gate_up_proj is not None or not self.gated or type(self).forward is not MLP.forward:
            return
        stacked = _stacked(gate_proj=self.gate_proj, up_proj=self.up_proj)
        if stacked is not None:
            self.gate_up_proj = stacked
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        fused = fused and self.swiglu
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)  # [T, 2 I]: gate, then up
            if fused:
                from tessellm.core.model.fused_ops import silu_mul_packed

                return self.down_proj(silu_mul_packed(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        if fused:
            from tessellm.core.model.fused_ops import silu_mul

            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        if not self.gated:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
