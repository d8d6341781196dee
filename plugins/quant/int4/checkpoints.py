"""Pre-quantized 4-bit checkpoints read into `int4-weight`'s layout (quantize.py), tensor by
tensor, with no float copy of the weights.

compressed-tensors ``pack-quantized`` (llm-compressor's W4A16): per linear ``weight_packed``
int32 [N, ceil(K / 8)], eight 4-bit values a word along K, the lowest bits first, each stored
as its signed value + 8; ``weight_scale`` [N, G] (G groups along K; one for the ``channel``
strategy); ``weight_shape`` [N, K]; and, asymmetric, ``weight_zero_point`` int32
[ceil(N / 8), G], packed the same way along N. The weight is (q - zero) * scale with q and
zero signed (both offsets of 8 cancel), so ``offset = -(zero + 8) * scale`` on the stored
nibbles, and ``-8 * scale`` without zero points.

GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` gptq or gptq_v2): ``qweight`` int32
[K / 8, N] packed along K, ``qzeros`` int32 [G, N / 8] packed along N, ``scales`` [G, N],
``g_idx`` [K] each input channel's group. The weight is (q - zero) * scale; the gptq (v1)
format stores zero - 1. With act-order (``desc_act``) the groups are not contiguous in K: the
input channels are permuted so that they are, and the layer permutes its input the same way.

AWQ (AutoAWQ GEMM): ``qweight`` int32 [K, N / 8] packed along N, nibble c of a word holding
column ``AWQ_ORDER[c]`` of its eight, ``qzeros`` [G, N / 8] the same way, ``scales`` [G, N];
(q - zero) * scale.
"""

from __future__ import annotations

from typing import Any

import torch

from tessellm.core.errors import ModelLoadError
from tessellm.plugins.quant.compressed_tensors_config import compressed_tensors_problem
from tessellm.plugins.quant.int4.quantize import Int4Weight, pack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The column of its word's eight each AWQ nibble holds, lowest nibble first."""


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

    def weight_only(name: str, group: dict[str, Any]) -> str | None:
        if (group.get("weights") or {}).get("actorder") == "group":
            return f"config group {name!r} has activation-ordered groups (actorder 'group'), not read yet"
        if group.get("input_activations") or group.get("output_activations"):
            return f"config group {name!r} quantizes activations too (int4-weight reads weight-only W4A16)"
        return None

    return compressed_tensors_problem(quant, "int4-weight", "pack-quantized", 4, "int", ("group", "channel"),
                                      weight_only)


def read_compressed_tensors(state: dict[str, torch.Tensor], prefix: str, out_features: int,
                            in_features: int) -> Int4Weight:
    """The int4 weight of linear ``prefix`` from its compressed-tensors tensors, which are
    removed from ``state``."""
    packed = state.pop(f"{prefix}.weight_packed")
    state.pop(f"{prefix}.weight_shape", None)  # the whole layer's; a tensor-parallel rank holds a share
    if tuple(packed.shape) != (out_features, -(-in_features // 8)):
        raise ModelLoadError(f"{prefix}: weight_packed is {list(packed.shape)}, not the [{out_features}, "
                             f"{-(-in_features // 8)}] the model's [{out_features}, {in_features}] layer packs to")
    scale = state.pop(f"{prefix}.weight_scale").float()
    if scale.dim() == 1:
        scale = scale[:, None]
    zero = state.pop(f"{prefix}.weight_zero_point", None)
    groups = scale.shape[1]
    if in_features % groups:
        raise ModelLoadError(f"{prefix}: {groups} scale groups do not divide in_features {in_features}")
    stored_zero = 8.0 if zero is None else unpack_int32_nibbles(zero.T.contiguous(), out_features).T.float()
    q = unpack_int32_nibbles(packed, in_features)
    return Int4Weight(pack_nibbles(q), scale.contiguous(), (-stored_zero * scale).contiguous(), in_features // groups)


def checkpoint_support(quant: dict[str, Any]) -> str | None:
    """None when int4-weight reads a checkpoint with ``quant``, else why not."""
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return compressed_tensors_support(quant)
    if method == "gptq":
        fmt = quant.get("checkpoint_format", "gptq")
        if quant.get("bits") != 4:
            return f"{quant.get('bits')}-bit GPTQ (int4-weight reads 4-bit)"
        return None if fmt in ("gptq", "gptq_v2") else f"GPTQ checkpoint_format {fmt!r} (it reads gptq, gptq_v2)"
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        bits = quant.get("bits", quant.get("w_bit"))
        if bits != 4 or version != "gemm" or not quant.get("zero_point", True):
            return f"AWQ {bits}-bit, version {version!r}, zero_point {quant.get('zero_point', True)} (it reads 4-bit GEMM " \
                   f"with zero points)"
        return None
    return f"quant_method {method!r} is not one it reads (compressed-tensors, gptq, awq)"


def _groups_contiguous(prefix: str, weight: Int4Weight, q: torch.Tensor, g_idx: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q [N, K] with each group's input channels side by side, the input permutation that
    achieved it or None when they already were)."""
    k = q.shape[1]
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // weight.group_size):
        return q, None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], torch.arange(k) // weight.group_size):
        raise ModelLoadError(f"{prefix}: g_idx gives groups of unequal sizes (expected {weight.group_size} "
                             f"channels each)")
    return q[:, perm], perm


def read_gptq(state: dict[str, torch.Tensor], prefix: str, out_features: int, in_features: int, v1: bool
              ) -> tuple[Int4Weight, torch.Tensor | None]:
    """(the int4 weight of GPTQ linear ``prefix``, the input permutation of act-order or None);
    its tensors are removed from ``state``."""
    q = unpack_int32_nibbles(state.pop(f"{prefix}.qweight").T.contiguous(), in_features)  # [N, K]
    zero = unpack_int32_nibbles(state.pop(f"{prefix}.qzeros"), out_features).T.float()  # [N, G]
    scale = state.pop(f"{prefix}.scales").float().T.contiguous()
    g_idx = state.pop(f"{prefix}.g_idx", None)
    if g_idx is not None:  # a tensor-parallel rank's share of the input channels starts at its first group
        g_idx = g_idx - g_idx.min()
    zero = zero + 1 if v1 else zero
    weight = Int4Weight(q, scale, (-zero * scale).contiguous(), in_features // scale.shape[1])
    q, perm = _groups_contiguous(prefix, weight, q, g_idx)
    return Int4Weight(pack_nibbles(q), weight.scale, weight.offset, weight.group_size), perm


def _awq_columns(words: torch.Tensor, count: int) -> torch.Tensor:
    """[R, count / 8] AWQ words -> [R, count] uint8 in column order."""
    nibbles = unpack_int32_nibbles(words, count).view(words.shape[0], -1, 8)
    columns = torch.empty_like(nibbles)
    columns[:, :, list(AWQ_ORDER)] = nibbles
    return columns.view(words.shape[0], count)


def read_awq(state: dict[str, torch.Tensor], prefix: str, out_features: int, in_features: int) -> Int4Weight:
    """The int4 weight of AWQ (GEMM) linear ``prefix``; its tensors are removed from ``state``."""
    q = _awq_columns(state.pop(f"{prefix}.qweight"), out_features).T.contiguous()  # [N, K]
    zero = _awq_columns(state.pop(f"{prefix}.qzeros"), out_features).T.float()  # [N, G]
    scale = state.pop(f"{prefix}.scales").float().T.contiguous()
    return Int4Weight(pack_nibbles(q), scale, (-zero * scale).contiguous(), in_features // scale.shape[1])


def read_linear(state: dict[str, torch.Tensor], prefix: str, out_features: int, in_features: int,
                quant: dict[str, Any]) -> tuple[Int4Weight, torch.Tensor | None] | None:
    """(int4 weight, input permutation or None) of linear ``prefix`` where the checkpoint
    stores it quantized (its tensors removed from ``state``); None where it does not."""
    method = quant.get("quant_method")
    if method == "compressed-tensors" and f"{prefix}.weight_packed" in state:
        return read_compressed_tensors(state, prefix, out_features, in_features), None
    if method == "gptq" and f"{prefix}.qweight" in state:
        return read_gptq(state, prefix, out_features, in_features, quant.get("checkpoint_format", "gptq") == "gptq")
    if method == "awq" and f"{prefix}.qweight" in state:
        return read_awq(state, prefix, out_features, in_features), None
    return None


PACKED_ALONG = {  # format -> tensor -> (the dim holding output channels, entries' width there, along input)
    "compressed-tensors": {"weight_packed": (0, 1, 8), "weight_scale": (0, 1, "group"),
                           "weight_zero_point": (0, 8, "group"), "weight_shape": None},
    "gptq": {"qweight": (1, 1, 8), "qzeros": (1, 8, "group"), "scales": (1, 1, "group"), "g_idx": (None, 1, 1)},
    "awq": {"qweight": (1, 8, 1), "qzeros": (1, 8, "group"), "scales": (1, 1, "group")},
}
"""Where each stored tensor keeps a linear's output channels (the other dim holds the input
ones; None: only input channels), and how many channels one of its entries covers along the
output and along the input (8: a packed word; "group": a group's scale or zero point)."""


def _group_size(quant: dict[str, Any]) -> int | None:
    """The checkpoint's group size along the input (None: one group for the whole input)."""
    if quant.get("quant_method") == "compressed-tensors":
        weights = next(iter((quant.get("config_groups") or {}).values()), {}).get("weights") or {}
        return weights.get("group_size") if weights.get("strategy") == "group" else None
    size = quant.get("group_size", quant.get("q_group_size"))
    return None if size in (None, -1) else int(size)


def _scaled(suffix: str, dim: int, lo: int, hi: int, by: int) -> tuple[int, int, int]:
    if lo % by or hi % by:
        raise ModelLoadError(f"{suffix}: a tensor-parallel rank's channels {lo}..{hi} split an entry of {by} "
                             f"channels; choose a parallel.tensor that splits at multiples of {by}")
    return dim, lo // by, hi // by


def shard_rule(suffix: str, weight_rule: Any, quant: dict[str, Any]) -> Any:
    """The tensor-parallel rule of a pre-quantized tensor ``<linear>.<suffix>`` from its
    linear's float rule (``Quantizer.checkpoint_shard_rule``)."""
    layout = PACKED_ALONG.get(quant.get("quant_method"), {})
    if suffix not in layout:
        return NotImplemented
    entry = layout[suffix]
    if entry is None or weight_rule is None:
        return None
    out_dim, out_by, in_by = entry
    if isinstance(weight_rule, list):  # fused projections: slices of output rows
        if out_dim != 0:
            raise ModelLoadError(f"{suffix}: a fused projection's output slices cannot be read from the "
                                 f"{quant.get('quant_method')!r} layout (output channels along dim 1)")
        return [_scaled(suffix, 0, lo, hi, out_by) for _, lo, hi in weight_rule]
    dim, lo, hi = weight_rule
    if dim == 0:  # a share of the output channels
        return None if out_dim is None else _scaled(suffix, out_dim, lo, hi, out_by)
    if suffix == "g_idx" and quant.get("desc_act"):
        raise ModelLoadError("GPTQ act-order (desc_act) groups span the whole input: a row-parallel layer cannot "
                             "be split across tensor-parallel ranks")
    by = _group_size(quant) if in_by == "group" else in_by
    if by is None:  # one group for the whole input: every rank reads it whole
        return None
    in_dim = 0 if out_dim is None else 1 - out_dim
    return _scaled(suffix, in_dim, lo, hi, by)
