"""Pre-quantized 4-bit checkpoints read into `int4-weight`'s layout (quantize.py), tensor by
tensor, with no float copy of the weights.

compressed-tensors ``pack-quantized`` (llm-compressor's W4A16): per linear ``weight_packed``
int32 [N, ceil(K / 8)], eight 4-bit values a word along K, the lowest bits first, each stored
as its signed value + 8; ``weight_scale`` [N, G] (G groups along K; one for the ``channel``
strategy); ``weight_shape`` [N, K]; and, asymmetric, ``weight_zero_point`` int32
[ceil(N / 8), G], packed the same way along N. The weight is (q - zero) * scale with q and
zero signed (both offsets of 8 cancel), so ``offset = -(zero + 8) * scale`` on the stored
nibbles, and ``-8 * scale`` without zero points.
"""

from __future__ import annotations

from typing import Any

import torch

from tessellm.plugins.quant.int4.quantize import Int4Weight, pack_nibbles


def unpack_int32_nibbles(words: torch.Tensor, count: int) -> torch.Tensor:
    """[R, ceil(count / 8)] int32, eight nibbles a word (lowest first) -> [R, count] uint8 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 15
    return nibbles.reshape(words.shape[0], -1)[:, :count].to(torch.uint8)


def compressed_tensors_support(quant: dict[str, Any]) -> str | None:
    """None when ``quant`` is a compressed-tensors config whose every group is pack-quantized
    4-bit integer weights alone (W4A16), by groups or channels; else why not."""
    method = quant.get("quant_method")
    if method != "compressed-tensors":
        return f"quant_method {method!r} is not one it reads (compressed-tensors)"
    if quant.get("quantization_status", "compressed") != "compressed":
        return f"quantization_status {quant.get('quantization_status')!r}: it reads compressed checkpoints"
    groups = quant.get("config_groups") or {}
    if not groups:
        return "the compressed-tensors config has no config_groups"
    for name, group in groups.items():
        fmt = group.get("format") or quant.get("format")
        weights = group.get("weights") or {}
        if fmt != "pack-quantized":
            return f"config group {name!r} has format {fmt!r} (int4-weight reads pack-quantized)"
        if weights.get("num_bits") != 4 or weights.get("type") != "int":
            return (f"config group {name!r} quantizes weights to {weights.get('num_bits')}-bit "
                    f"{weights.get('type')} (int4-weight reads 4-bit int)")
        if weights.get("strategy") not in ("group", "channel"):
            return f"config group {name!r} has weight strategy {weights.get('strategy')!r} (it reads group, channel)"
        if weights.get("actorder") == "group":
            return f"config group {name!r} has activation-ordered groups (actorder 'group'), not read yet"
        if group.get("input_activations") or group.get("output_activations"):
            return f"config group {name!r} quantizes activations too (int4-weight reads weight-only W4A16)"
    return None


def read_compressed_tensors(state: dict[str, torch.Tensor], prefix: str, out_features: int,
                            in_features: int) -> Int4Weight:
    """The int4 weight of linear ``prefix`` from its compressed-tensors tensors, which are
    removed from ``state``."""
    packed = state.pop(f"{prefix}.weight_packed")
    shape = state.pop(f"{prefix}.weight_shape", None)
    if shape is not None and tuple(int(v) for v in shape.tolist()) != (out_features, in_features):
        raise ValueError(f"{prefix}: weight_shape {shape.tolist()} is not the model's "
                         f"[{out_features}, {in_features}]")
    scale = state.pop(f"{prefix}.weight_scale").float()
    if scale.dim() == 1:
        scale = scale[:, None]
    zero = state.pop(f"{prefix}.weight_zero_point", None)
    groups = scale.shape[1]
    if in_features % groups:
        raise ValueError(f"{prefix}: {groups} scale groups do not divide in_features {in_features}")
    stored_zero = 8.0 if zero is None else unpack_int32_nibbles(zero.T.contiguous(), out_features).T.float()
    q = unpack_int32_nibbles(packed, in_features)
    return Int4Weight(pack_nibbles(q), scale.contiguous(), (-stored_zero * scale).contiguous(), in_features // groups)
