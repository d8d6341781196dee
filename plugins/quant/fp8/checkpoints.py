"""FP8 checkpoints read into ``Fp8Linear``, tensor by tensor.

- ``quant_method: fp8`` (transformers' fine-grained FP8, DeepSeek-V3's own): ``weight`` in
  float8 e4m3 and ``weight_scale_inv`` float32, one per block of ``weight_block_size``
  (the name notwithstanding, the weight is ``weight * weight_scale_inv``).
- compressed-tensors ``float-quantized`` (llm-compressor's FP8 and FP8_DYNAMIC, FP8_BLOCK):
  ``weight`` e4m3 and ``weight_scale`` per tensor, channel or block.

Activation scales (``input_scale``, static FP8 activations) are read past: under
``matmul: scaled_mm`` the activations are scaled per token as they come (dynamic), otherwise
the matmul runs in the model dtype over the dequantized weights.
"""

from __future__ import annotations

from typing import Any

import torch

from tessellm.core.errors import ModelLoadError
from tessellm.plugins.quant.compressed_tensors_config import compressed_tensors_problem
from tessellm.plugins.quant.fp8.linear import FP8


def _fine_grained_support(quant: dict[str, Any]) -> str | None:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        return f"fp8 format {fmt!r} (it reads e4m3)"
    block = quant.get("weight_block_size")
    if block is not None and len(block) != 2:
        return f"weight_block_size {block!r} is not [rows, columns]"
    return None


def checkpoint_support(quant: dict[str, Any]) -> str | None:
    """None when `fp8` reads a checkpoint with ``quant``, else why not."""
    method = quant.get("quant_method")
    if method == "fp8":
        return _fine_grained_support(quant)
    if method == "compressed-tensors":
        return compressed_tensors_problem(quant, "fp8", "float-quantized", 8, "float", ("tensor", "channel", "block"))
    return f"quant_method {method!r} is not one it reads (fp8, compressed-tensors)"


def _block_of(quant: dict[str, Any]) -> tuple[int, int] | None:
    if quant.get("quant_method") == "fp8":
        block = quant.get("weight_block_size")
        return None if block is None else (int(block[0]), int(block[1]))
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("strategy") == "block":
            return tuple(int(v) for v in weights.get("block_structure"))
    return None


def read_fp8(state: dict[str, torch.Tensor], prefix: str, quant: dict[str, Any]
             ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None] | None:
    """(e4m3 weight, its scale as [1, 1], [N, 1] or blocks, the block shape or None) of linear
    ``prefix`` where the checkpoint stores it in FP8 (tensors removed from ``state``); None
    where it does not."""
    weight = state.get(f"{prefix}.weight")
    if weight is None or weight.dtype != FP8:
        return None
    state.pop(f"{prefix}.weight")
    scale = state.pop(f"{prefix}.weight_scale_inv", None)
    if scale is None:
        scale = state.pop(f"{prefix}.weight_scale")
    state.pop(f"{prefix}.input_scale", None)
    block = _block_of(quant)
    if block is None and scale.numel() == 1:
        scale = scale.reshape(1, 1)
    elif block is None:
        scale = scale.reshape(-1, 1)
    return weight, scale.float(), block


def _strategy(quant: dict[str, Any]) -> str:
    """"block", "channel" or "tensor": how the checkpoint scales its FP8 weights."""
    if quant.get("quant_method") == "fp8":
        return "block" if quant.get("weight_block_size") is not None else "tensor"
    weights = next(iter((quant.get("config_groups") or {}).values()), {}).get("weights") or {}
    return str(weights.get("strategy"))


def shard_rule(suffix: str, weight_rule: Any, quant: dict[str, Any]) -> Any:
    """The tensor-parallel rule of an FP8 scale ``<linear>.<suffix>`` from its linear's float
    rule (the e4m3 weight itself takes the float rule)."""
    if suffix == "input_scale":
        return None
    if suffix not in ("weight_scale", "weight_scale_inv"):
        return NotImplemented
    strategy = _strategy(quant)
    if weight_rule is None or strategy == "tensor":
        return None
    if strategy == "channel":
        if isinstance(weight_rule, list):
            return weight_rule
        return weight_rule if weight_rule[0] == 0 else None
    block = _block_of(quant)
    rules = weight_rule if isinstance(weight_rule, list) else [weight_rule]
    scaled = []
    for dim, lo, hi in rules:
        by = block[dim]
        if lo % by or hi % by:
            raise ModelLoadError(f"{suffix}: a tensor-parallel rank's channels {lo}..{hi} split a {block[0]}x{block[1]} "
                                 f"scale block; choose a parallel.tensor that splits at multiples of {by}")
        scaled.append((dim, lo // by, hi // by))
    return scaled if isinstance(weight_rule, list) else scaled[0]
