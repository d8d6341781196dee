"""A checkpoint's tensors under the names (and in the layouts) of its transformers module.

transformers 5 keeps some checkpoints' tensors in other layouts than it computes with (a
Mixtral checkpoint stores each expert's w1, w2, w3; the module holds all experts stacked as
``experts.gate_up_proj`` and ``experts.down_proj``) and renames others; ``from_pretrained``
converts them through the model's weight-conversion mapping (transformers'
``conversion_mapping``). tessellm's loader reads the files, then this applies the same
mapping to the tensors: renamings, the base-model prefix added or dropped, and converters
(stacking, concatenating, splitting) over the tensors they gather."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def convert_checkpoint(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (checkpoint names) as ``model``'s parameters and persistent buffers; tensors
    the module has no place for are left out (the loader then names what is missing)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    names = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", None)
    out: dict[str, torch.Tensor] = {}
    gathering: dict[str, Any] = {}
    for key in sorted(state, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:  # stored under the module's own name already
            renamed, pattern = rename_source_key(key, [], [], prefix, names)
        if renamed not in names:
            continue
        if pattern is None:
            out[renamed] = state[key]
            continue
        gathered = gathering.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
        gathered.add_tensor(renamed, key, pattern, state[key])
    for first, converter in gathering.items():
        for name, value in converter.convert(first, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out
