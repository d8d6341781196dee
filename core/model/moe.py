"""The one mixture-of-experts block every MoE family builds on (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2/V3): a router that picks each token's experts and their weights, routed SwiGLU
experts, and optional shared experts (always on, optionally behind a sigmoid gate).

Routing (``MoESpec`` says which): softmax or sigmoid scores of the router logits; top-k of
them, or of a group-limited subset (DeepSeek's group_limited_greedy and noaux_tc, the latter
choosing by scores plus a correction bias); the chosen weights renormalised or not, scaled,
or (``softmax_after_topk``) the softmax taken over the k chosen logits alone.

Module names are fixed, whatever the family's checkpoint calls them (a model plugin maps
its names onto these): ``gate.weight`` (the router; ``gate.e_score_correction_bias``),
``experts.{e}.{gate,up,down}_proj``, ``shared_experts.{gate,up,down}_proj`` and
``shared_expert_gate``. Checkpoints that stack their experts as 3-D tensors
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) are split per expert
on loading (``unstack_experts``), so quantizers and tensor parallelism see one Linear per
expert either way.

``MoE.forward`` runs either path: the plain-torch reference (each expert once over its
tokens, added in expert order) or, after ``stack_experts``, the grouped path (tokens sorted
by expert, one batched product per projection over the experts), used on CUDA.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tessellm.core.interfaces.spec import ModelSpec, MoESpec
from tessellm.core.model.mlp import MLP


class Router(nn.Module):
    """Chooses each token's experts and their weights, in float32 whatever the compute dtype
    (as the reference implementations do). ``weight`` [num_experts, hidden]; with
    ``score_bias``, ``e_score_correction_bias`` [num_experts] shifts the choice, not the
    weights."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe = spec.moe
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, spec.hidden_size))
        if moe.score_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, top_k] int64, weights [T, top_k] float32, float64
        for float64 x)."""
        moe = self.moe
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32  # float64 stays exact
        logits = F.linear(x.to(dtype), self.weight.to(dtype))  # [T, E]
        if moe.softmax_after_topk:  # the k best logits, then a softmax over those k alone
            top, ids = logits.topk(moe.top_k, dim=-1)
            return ids, top.softmax(dim=-1) * moe.routed_scaling_factor
        scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
        choice = scores + self.e_score_correction_bias.to(dtype) if moe.score_bias else scores
        if moe.topk_method != "greedy":
            choice = _limit_to_groups(choice, moe)
        ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * moe.routed_scaling_factor


def _limit_to_groups(choice: torch.Tensor, moe: MoESpec) -> torch.Tensor:
    """``choice`` [T, E] with the experts outside each token's ``topk_group`` best groups
    masked to -inf: a group's strength is its best expert (group_limited_greedy) or the sum
    of its two best (noaux_tc)."""
    grouped = choice.view(choice.shape[0], moe.num_groups, -1)
    if moe.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1, sorted=False).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class MoE(nn.Module):
    """Routed experts (the router's top-k, weighted) plus the shared experts, if any.

    ``forward`` is the plain-torch reference unless ``stack_experts`` switched it to the
    grouped path; the two agree to rounding (tests/core/model/test_moe.py)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe: MoESpec = spec.moe
        self.gate = Router(spec)
        self.experts = nn.ModuleList(MLP(spec, moe.intermediate_size) for _ in range(moe.num_experts))
        self.shared_experts = MLP(spec, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False) if moe.shared_gate else None
        self.grouped = False
        self._stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        ids, weights = self.gate(x)
        # a quantizer applied after stacking replaces the expert linears: then the stacks are stale
        grouped = self.grouped and type(self.experts[0].down_proj) is nn.Linear
        out = self._grouped(x, ids, weights) if grouped else self.reference(x, ids, weights)
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum, one expert at a time over the tokens routed to it."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, pick = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, pick, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def stack_experts(self) -> None:
        """Stack the routed experts' weights for the grouped path (after loading). The
        per-expert modules stay, as the reference, their weights re-pointed at views of the
        stacks so nothing is held twice. Quantized or biased experts keep the reference, and
        stacks made before a quantizer replaced the experts are let go (called again then)."""
        linears = [getattr(e, name) for e in self.experts for name in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
            self._stacked, self.grouped = None, False
            return
        if self._stacked is not None:
            return
        stacks = []
        for name in ("gate_proj", "up_proj", "down_proj"):
            stack = torch.stack([getattr(e, name).weight for e in self.experts])
            for e, expert in enumerate(self.experts):
                getattr(expert, name).weight = nn.Parameter(stack[e], requires_grad=False)
            stacks.append(stack)
        self._stacked = tuple(stacks)
        self.grouped = True

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same sum as ``reference``: token copies sorted by expert into an [experts in
        the batch, busiest count, hidden] batch, three batched products, scattered back."""
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        expert = flat[order]
        token = order // ids.shape[1]
        counts = torch.bincount(flat, minlength=self._stacked[0].shape[0])
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(flat.numel(), device=x.device) - starts[expert]  # position within its expert
        slot, (gate_w, up_w, down_w) = _batch_experts(counts, self._stacked)  # [N, I, H], [N, I, H], [N, H, I]
        h = x.new_zeros(gate_w.shape[0], int(counts.max()), x.shape[1])
        h[slot[expert], rank] = x[token]
        a = torch.bmm(h, gate_w.transpose(1, 2))
        b = torch.bmm(h, up_w.transpose(1, 2))
        y = torch.bmm(F.silu(a) * b, down_w.transpose(1, 2))[slot[expert], rank]  # [T*k, H]
        y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


def _batch_experts(counts: torch.Tensor, stacks: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple]:
    """(each expert's slot in the batched products, the stacks the products use), given the
    tokens per expert ``counts`` [E]. When more than a third of the experts have tokens, all
    of them enter, the stacks as they are (the idle ones multiply zero rows); else only those
    with tokens, their weights copied out: a copy reads and writes them once before the
    products read them, three passes over the used experts against one over all."""
    used = counts.nonzero().squeeze(1)
    num_experts = counts.numel()
    if 3 * used.numel() > num_experts:
        return torch.arange(num_experts, device=counts.device), stacks
    slot = torch.full((num_experts,), -1, dtype=torch.long, device=counts.device)
    slot[used] = torch.arange(used.numel(), device=counts.device)
    return slot, tuple(w[used] for w in stacks)


# a model's names (``model.layers.0.mlp.experts.down_proj``) or a block's own (``experts.down_proj``)
def drop_stale_stacks(model: nn.Module) -> None:
    """Let every MoE block of ``model`` whose experts a quantizer replaced free the float
    stacks it made for the grouped path (it runs the reference over the new experts)."""
    for module in model.modules():
        if isinstance(module, MoE) and module._stacked is not None:
            module.stack_experts()


_STACKED = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<kind>gate_up_proj|down_proj)(?P<bias>_bias)?$")

EXPERT_LAYOUTS = ("concatenated", "interleaved_transposed")
"""How a checkpoint stacks its experts (``ModelArchitecture.expert_layout``): "concatenated",
gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I], as Linear
weights; "interleaved_transposed" (GPT-OSS), gate_up_proj [E, H, 2I] with gate and up in
alternate columns, down_proj [E, I, H], and biases gate_up_proj_bias [E, 2I] (alternate),
down_proj_bias [E, H]."""


def unstack_experts(state: dict[str, torch.Tensor], layout: str = "concatenated") -> dict[str, torch.Tensor]:
    """``state`` with experts stored as stacks split into one tensor per expert, as nn.Linear
    weights and biases: ``P.experts.gate_up_proj`` becomes ``P.experts.{e}.gate_proj.weight``
    and ``up_proj.weight`` [I, H], ``P.experts.down_proj`` ``P.experts.{e}.down_proj.weight``
    [H, I] (and their ``_bias`` stacks the experts' biases), read in ``layout`` (one of
    ``EXPERT_LAYOUTS``). Other tensors pass through unchanged."""
    interleaved = layout == "interleaved_transposed"
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _STACKED.match(name)
        bias = match is not None and match["bias"] is not None
        if match is None or tensor.dim() != (2 if bias else 3) or (bias and not interleaved):
            out[name] = tensor
            continue
        prefix, part = match["prefix"], "bias" if bias else "weight"
        for e in range(tensor.shape[0]):
            one = tensor[e] if bias or not interleaved else tensor[e].t()  # as a Linear's [out, in]
            if match["kind"] == "down_proj":
                out[f"{prefix}.{e}.down_proj.{part}"] = one.contiguous() if interleaved else one
            elif interleaved:  # gate and up alternate along the output dim
                out[f"{prefix}.{e}.gate_proj.{part}"] = one[0::2].contiguous()
                out[f"{prefix}.{e}.up_proj.{part}"] = one[1::2].contiguous()
            else:
                gate, up = one.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.{part}"] = gate
                out[f"{prefix}.{e}.up_proj.{part}"] = up
    return out
