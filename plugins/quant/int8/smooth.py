"""SmoothQuant smoothing for `w8a8` (Xiao et al., 2023): move activation outliers into the weights.

A few input channels of a linear carry activations far larger than the rest, and a per-token
int8 scale must widen to them, so every other channel of that token loses precision. Since
``x @ W.T == (x / s) @ (W * s).T`` for any per-input-channel vector ``s``, dividing the
activations by ``s`` and multiplying the weights' columns by it changes nothing in exact
arithmetic but moves range from the activations to the weights. With
``s_j = max|x_j| ** alpha / max|W_j| ** (1 - alpha)`` (``max|x_j|`` observed on a calibration
text, ``max|W_j|`` over the output channels), alpha 0.5 balances the two.

Here the division happens at run time, inside the quantized linear (one multiply of its
input), rather than folded into the preceding RMSNorm, so every linear can be smoothed,
o_proj and down_proj included.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

DEFAULT_CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
"""The opening of Julius Caesar (public domain; CALIBRATION_NOTICE.md)."""


def calibration_chunks(token_ids: list[int], max_tokens: int, chunk: int = 512) -> list[list[int]]:
    """The first ``max_tokens`` of token_ids in pieces of at most ``chunk`` tokens."""
    ids = token_ids[:max_tokens]
    return [ids[i:i + chunk] for i in range(0, len(ids), chunk)]


@contextlib.contextmanager
def experts_one_at_a_time(model: nn.Module) -> Iterator[None]:
    """Every MoE block of ``model`` on its per-expert path for the duration: the grouped path
    (core/model/moe.py's ``stack_experts``, on CUDA) multiplies the stacked weights directly,
    so the experts' linears, and hooks on them, would never see an input."""
    from tessellm.core.model.moe import MoE

    grouped = [m for m in model.modules() if isinstance(m, MoE) and m.grouped]
    for m in grouped:
        m.grouped = False
    try:
        yield
    finally:
        for m in grouped:
            m.grouped = True


def observe_input_ranges(linears: dict[str, nn.Module], run: Callable[[list[int]], object],
                         chunks: list[list[int]]) -> dict[str, torch.Tensor]:
    """Name -> largest |input| per input channel (float32 [in_features]) of each module while
    ``run`` runs every chunk; the hooks are gone when it returns, whatever happened. A module
    that saw no input (an expert no token was routed to) has no entry."""
    ranges: dict[str, torch.Tensor] = {}

    def recorder(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            seen = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen
        return record

    handles = [m.register_forward_pre_hook(recorder(name)) for name, m in linears.items()]
    try:
        for ids in chunks:
            run(ids)
    finally:
        for h in handles:
            h.remove()
    return ranges


def smoothing_scales(input_range: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-input-channel s (float32 [in_features]) for weight [out, in]: range(x)^alpha /
    range(W)^(1 - alpha), both ranges floored at 1e-5 so a silent channel keeps s finite."""
    weight_range = weight.detach().abs().amax(dim=0).float().clamp(min=1e-5)
    return (input_range.to(weight_range.device).clamp(min=1e-5).pow(alpha) / weight_range.pow(1 - alpha)).clamp(min=1e-5)
