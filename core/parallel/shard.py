"""Which part of the model one rank holds, the ModelSpec it sees, and its slice of each
checkpoint tensor.

Query heads split over the ranks with their KV heads (Megatron's column-parallel q/k/v,
row-parallel o_proj); the MLP's (and every expert's) intermediate columns the same way
(column-parallel gate/up, row-parallel down). Shares are contiguous and as even as the
counts allow, so they may differ by one head or column: SmolLM2's 9 heads in 3 KV groups
split 3 + 6 over two ranks. With more ranks than KV heads each KV head is replicated on the
ranks that split its group of query heads. Embeddings, norms, the LM head, MLA's latent
projections, the MoE router and the shared-expert gate are replicated: each rank computes
full logits, so sampling needs no gather, at the cost of holding them whole (SmolLM2's tied
embedding: 113 MB of 540 MB in float32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessellm.core.errors import ConfigError
from tessellm.core.model.loader import load_state_dict
from tessellm.core.model.spec import ModelSpec

ZERO = "zero"
"""A row-parallel layer's bias: added once, on rank 0; the other ranks hold zeros."""


def split(count: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous, near-equal ranges of ``range(count)``."""
    return index * count // parts, (index + 1) * count // parts


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds: query heads ``heads`` [lo, hi), KV heads
    ``kv_heads`` (shared with other ranks when replicated), MLP columns ``intermediate``,
    each expert's ``moe_intermediate`` and the shared experts' ``shared_intermediate`` (MoE
    models)."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    moe_intermediate: tuple[int, int] | None
    shared_intermediate: tuple[int, int] | None = None


def allowed_sizes(spec: ModelSpec) -> list[int]:
    """Every tensor-parallel size this model splits into: up to its KV head count, or a
    multiple of it that leaves each rank at least one query head (and one MLP column)."""
    kv, group = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    widths = [spec.intermediate_size] + ([spec.moe.intermediate_size] if spec.moe else [])
    if spec.moe and spec.moe.shared_intermediate_size:
        widths.append(spec.moe.shared_intermediate_size)
    return [n for n in range(1, spec.num_heads + 1)
            if (n <= kv or (n % kv == 0 and n // kv <= group)) and all(n <= w for w in widths)]


def plan_shard(spec: ModelSpec, size: int, rank: int) -> Shard:
    """Rank ``rank``'s share of ``spec`` split ``size`` ways (a ConfigError naming the
    allowed sizes if it does not split so)."""
    allowed = allowed_sizes(spec)
    if size not in allowed:
        raise ConfigError(f"parallel.tensor {size} does not split this model ({spec.num_heads} query heads in "
                          f"{spec.num_kv_heads} KV heads, MLP width {spec.intermediate_size}); allowed: "
                          f"{', '.join(map(str, allowed))}")
    kv, group = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    if size <= kv:
        kv_heads = split(kv, size, rank)
        heads = (kv_heads[0] * group, kv_heads[1] * group)
    else:  # each KV head replicated on ``copies`` ranks, which split its query heads
        copies = size // kv
        head = rank // copies
        lo, hi = split(group, copies, rank % copies)
        kv_heads, heads = (head, head + 1), (head * group + lo, head * group + hi)
    moe = split(spec.moe.intermediate_size, size, rank) if spec.moe else None
    shared = split(spec.moe.shared_intermediate_size, size, rank) if spec.moe else None
    return Shard(rank, size, heads, kv_heads, split(spec.intermediate_size, size, rank), moe, shared)


def local_spec(spec: ModelSpec, shard: Shard) -> ModelSpec:
    """The ModelSpec of one rank's part: its own head counts and MLP widths (the hidden size,
    vocabulary and layer count stay whole). Attention backends, caches and the model are
    built from it, so they run unchanged on the local heads."""
    width = lambda r: r[1] - r[0]  # noqa: E731
    moe = spec.moe and dataclasses.replace(spec.moe, intermediate_size=width(shard.moe_intermediate),
                                           shared_intermediate_size=width(shard.shared_intermediate))
    return dataclasses.replace(spec, num_heads=width(shard.heads), num_kv_heads=width(shard.kv_heads),
                               intermediate_size=width(shard.intermediate), moe=moe)


def slice_rule(name: str, spec: ModelSpec, shard: Shard) -> tuple[int, int, int] | list | str | None:
    """How rank ``shard.rank`` reads checkpoint tensor ``name`` of the whole model ``spec``:
    ``(dim, lo, hi)`` (that slice), a list of dim-0 slices (concatenated: fused projections,
    Phi-3's ``qkv_proj`` and ``gate_up_proj``), ``ZERO`` (a row-parallel bias, kept on rank 0
    only) or None (replicated: the whole tensor)."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None
    kind, family = parts[-1], parts[3]
    head_dim = spec.head_dim
    v_dim = spec.mla.v_head_dim if spec.mla else head_dim
    (q0, q1), (k0, k1) = shard.heads, shard.kv_heads
    if family == "self_attn":
        module = parts[4]
        if module in ("q_proj", "q_b_proj"):
            return 0, q0 * head_dim, q1 * head_dim
        if module in ("k_proj", "v_proj"):
            return 0, k0 * head_dim, k1 * head_dim
        if module == "kv_b_proj":
            per_head = spec.mla.qk_nope_head_dim + v_dim
            return 0, q0 * per_head, q1 * per_head
        if module == "o_proj":
            return (1, q0 * v_dim, q1 * v_dim) if kind == "weight" else ZERO
        if module == "sinks":  # one sink logit per query head (GPT-OSS)
            return 0, q0, q1
        if module == "qkv_proj":  # q, k and v rows stacked: each one's share, in that order
            q_rows, kv_rows = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
            return [(0, q0 * head_dim, q1 * head_dim), (0, q_rows + k0 * head_dim, q_rows + k1 * head_dim),
                    (0, q_rows + kv_rows + k0 * head_dim, q_rows + kv_rows + k1 * head_dim)]
        return None  # MLA's q_a_proj, kv_a_proj_with_mqa and norms
    if family != "mlp":
        return None
    if parts[4] == "experts":
        if len(parts) < 8:  # experts stacked as 3-D tensors: sliced after they are split
            return None
        module, (lo, hi) = parts[6], shard.moe_intermediate
    elif parts[4] == "shared_experts":  # one MLP, split like the others (its gate is replicated)
        module, (lo, hi) = parts[5], shard.shared_intermediate
    elif parts[4] in ("gate_proj", "up_proj", "down_proj"):
        module, (lo, hi) = parts[4], shard.intermediate
    elif parts[4] == "gate_up_proj":  # gate rows, then up rows (Phi-3)
        (lo, hi), width = shard.intermediate, spec.intermediate_size
        return [(0, lo, hi), (0, width + lo, width + hi)]
    else:
        return None  # the MoE router
    if module in ("gate_proj", "up_proj"):
        return 0, lo, hi
    return (1, lo, hi) if kind == "weight" else ZERO


def tensor_rule(name: str, spec: ModelSpec, shard: Shard, architecture: Any = None) -> Any:
    """How rank ``shard.rank`` reads parameter ``name`` (the module's name): the model
    plugin's rule where it has one ("whole": replicated), else core's ``slice_rule``."""
    own = architecture.shard_rule(name, spec, shard) if architecture is not None else None
    if own == "whole":
        return None
    return own if own is not None else slice_rule(name, spec, shard)


def load_shard(folder: Path, spec: ModelSpec, shard: Shard, architecture: Any = None,
               quantized: tuple[Any, dict[str, Any]] | None = None,
               keep: Any = None) -> dict[str, torch.Tensor]:
    """This rank's tensors from the folder's safetensors files, under the checkpoint's own
    names, reading only its slices (safetensors reads a slice without the rest of the
    tensor). ``architecture``, the model plugin, maps checkpoint names to the module's,
    which the slicing rules are written for; experts stacked as 3-D tensors are read whole,
    split per expert and sliced then. ``quantized`` (the quant plugin class and the
    checkpoint's quantization_config) rules the tensors of a pre-quantized checkpoint's
    linears (``Quantizer.checkpoint_shard_rule``); ``keep(name)`` says which tensors are read
    at all (a pipeline stage's)."""
    from tessellm.core.model.moe import unstack_experts

    def module_name(name: str) -> str:
        mapped = architecture.checkpoint_name(name) if architecture is not None else name
        return mapped or name

    def rule(name: str) -> tuple[int, int, int] | list | str | None:
        mapped = module_name(name)
        if quantized is not None and "." in mapped:
            prefix, suffix = mapped.rsplit(".", 1)
            if suffix not in ("weight", "bias"):
                weight_rule = tensor_rule(f"{prefix}.weight", spec, shard, architecture)
                own = quantized[0].checkpoint_shard_rule(suffix, weight_rule, quantized[1])
                if own is not NotImplemented:
                    return own
        return tensor_rule(mapped, spec, shard, architecture)

    def read(f: Any, name: str) -> torch.Tensor:
        return _sliced(lambda: f.get_tensor(name), f.get_slice(name), rule(name), shard.rank)

    state = load_state_dict(folder, read, keep)
    stacked = {k: v for k, v in state.items() if v.dim() in (2, 3) and k.endswith((
        "experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias", "experts.down_proj_bias"))}
    layout = getattr(architecture, "expert_layout", "concatenated")
    unstacked = unstack_experts(stacked, layout)
    for name, tensor in unstacked.items():
        # a copy: a view would keep the whole stack, every rank's share of every expert, alive
        part = _sliced(lambda t=tensor: t, tensor, rule(name), shard.rank)
        state[name] = part.clone(memory_format=torch.contiguous_format)
    for name in stacked.keys() - unstacked.keys():
        del state[name]
    return state


def _sliced(whole: Any, part: Any, rule: tuple[int, int, int] | str | None, rank: int) -> torch.Tensor:
    """One tensor as ``rule`` says rank ``rank`` holds it: ``whole()`` the tensor, ``part``
    something sliceable the same way (a safetensors slice, or the tensor)."""
    if rule is None or (rule == ZERO and rank == 0):
        return whole()
    if rule == ZERO:
        return torch.zeros_like(whole())
    if isinstance(rule, list):
        return torch.cat([part[lo:hi] for _, lo, hi in rule])
    dim, lo, hi = rule
    return part[lo:hi] if dim == 0 else part[:, lo:hi]
