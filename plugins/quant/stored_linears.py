"""What the quant plugins that read pre-quantized checkpoints share: replacing a model's plain
linears by modules built from their stored tensors, and refusing tensors none of them read."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tessellm.core.errors import ModelLoadError


def replace_stored_linears(model: nn.Module, build: Callable[[str, nn.Linear], nn.Module | None]) -> None:
    """Replace each plain ``nn.Linear`` of ``model`` for which ``build(name, linear)`` returns
    a module (None: the checkpoint stores that one in float)."""
    for name, linear in list(model.named_modules()):
        if type(linear) is nn.Linear:
            module = build(name, linear)
            if module is not None:
                model.set_submodule(name, module)


def refuse_unread(state: dict[str, torch.Tensor], plugin: str, what: str,
                  unread: Callable[[str, torch.Tensor], bool]) -> None:
    """A ModelLoadError naming the tensors ``unread(name, tensor)`` picks out of what is left in
    ``state``: quantized tensors no module read would otherwise load unscaled, or not at all."""
    left = [name for name, tensor in state.items() if unread(name, tensor)]
    if left:
        raise ModelLoadError(f"quant {plugin!r}: the checkpoint holds {what} of no linear it reads, "
                             f"e.g. {', '.join(left[:3])}")
