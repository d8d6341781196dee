"""What the quant plugins check of a compressed-tensors ``quantization_config``: every config
group in the one format, bit width, number type and weight strategies a plugin reads."""

from __future__ import annotations

from typing import Any, Callable


def compressed_tensors_problem(quant: dict[str, Any], plugin: str, fmt: str, num_bits: int, number_type: str,
                               strategies: tuple[str, ...],
                               group_problem: Callable[[str, dict[str, Any]], str | None] | None = None) -> str | None:
    """Why ``plugin`` cannot read the compressed-tensors checkpoint ``quant`` (None: it can):
    each group must be ``fmt`` with ``num_bits``-bit ``number_type`` weights quantized by one
    of ``strategies``, and pass ``group_problem(name, group)`` if given."""
    if quant.get("quantization_status", "compressed") != "compressed":
        return f"quantization_status {quant.get('quantization_status')!r}: it reads compressed checkpoints"
    groups = quant.get("config_groups") or {}
    if not groups:
        return "the compressed-tensors config has no config_groups"
    for name, group in groups.items():
        group_fmt = group.get("format") or quant.get("format")
        weights = group.get("weights") or {}
        if group_fmt != fmt:
            return f"config group {name!r} has format {group_fmt!r} ({plugin} reads {fmt})"
        if weights.get("num_bits") != num_bits or weights.get("type") != number_type:
            return (f"config group {name!r} quantizes weights to {weights.get('num_bits')}-bit {weights.get('type')} "
                    f"({plugin} reads {num_bits}-bit {number_type})")
        if weights.get("strategy") not in strategies:
            return (f"config group {name!r} has weight strategy {weights.get('strategy')!r} (it reads "
                    f"{', '.join(strategies)})")
        why = group_problem(name, group) if group_problem else None
        if why:
            return why
    return None
