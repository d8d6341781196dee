"""The torch LoRA kernel: the reference every other LoRA kernel is held to, and the CPU's.

Two ways to one sum, chosen per step by ``plan``:

- **stacked** (small batches: decode steps; and every CUDA-graph capture): one shrink over
  every slot at once (``x @ A_all^T``, [T, slots x rank]), the columns of the slots a row
  does not use zeroed, then one expand (``h @ B_all``, B_all the slots' B laid side by side,
  built once per slot load in ``LoraWeights.derived``). Three ops per layer however many
  adapters are mixed; it computes every slot for every row, so it stops paying as rows grow.
  A captured plan keeps nothing between replays: the graph was captured before any adapter
  was loaded, and a slot load replaces ``derived``'s entries while a graph would go on
  reading the old copy, so each replay rebuilds the mask and B_all from the slots as they are.
- **grouped** (larger batches: prefill chunks): the rows of each slot gathered, shrunk and
  expanded with two matmuls, and added back; work in proportion to the rows, four ops per
  slot in the batch. A batch all under one adapter takes its rows as they are (no gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import tessellm
from tessellm.core.interfaces.lora import LoraKernel, LoraMapping, LoraWeights

STACKED_ROW_SLOTS = 768
"""Rows x slots up to which a step takes the stacked form (beyond it the grouped form does
less work for the op count it costs; bench/lora_kernels.py --smoke times both)."""


@dataclass
class SlotRows:
    """One slot's rows of the packed batch (None: every row, contiguous)."""

    slot: int
    rows: torch.Tensor | None


@dataclass
class TorchPlan:
    groups: list[SlotRows] = field(default_factory=list)
    """The grouped form's slots and rows (empty: the stacked form)."""
    token_slots: torch.Tensor | None = None
    """The stacked form's slot per row (-1: none), read on the device."""
    captured: bool = False
    """A CUDA graph replays this plan over other slots and weights (``LoraMapping.static``):
    the stacked form's row masks and B_all are rebuilt by every apply, never kept."""
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


class TorchLora(LoraKernel):
    """Plain torch: one stacked shrink and expand over every slot for small batches, rows
    grouped by adapter for large ones."""

    name = "torch"
    api_version = "1.19"
    auto_priority = 10
    supports_cuda_graphs = True
    stacked_row_slots = STACKED_ROW_SLOTS
    """Rows x slots up to which an eager step takes the stacked form (0: always grouped)."""

    def plan(self, mapping: LoraMapping) -> TorchPlan:
        if mapping.static:
            return TorchPlan(token_slots=mapping.token_slots, captured=True)
        slots = np.asarray(mapping.seq_slots_cpu, dtype=np.int64)
        active = sorted(set(slots[slots >= 0].tolist()))
        if len(active) == 1 and (slots >= 0).all():
            return TorchPlan([SlotRows(active[0], None)])
        if mapping.num_tokens * mapping.num_slots <= self.stacked_row_slots:
            return TorchPlan(token_slots=mapping.token_slots)
        lengths = np.diff(np.asarray(mapping.query_starts_cpu, dtype=np.int64))
        row_slot = np.repeat(slots, lengths)
        order = np.argsort(row_slot, kind="stable")
        counts = [int((row_slot == s).sum()) for s in active]
        skipped = int((row_slot < 0).sum())
        rows = torch.from_numpy(order[skipped:]).to(mapping.token_slots.device)
        return TorchPlan([SlotRows(s, part) for s, part in zip(active, rows.split(counts))])

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        if plan.token_slots is not None:
            _apply_stacked(out, x, weights, plan)
            return
        for group in plan.groups:
            a, b = weights.a[group.slot], weights.b[group.slot]
            if group.rows is None:
                out.addmm_(x @ a.t(), b.t())
            else:
                out.index_add_(0, group.rows, (x.index_select(0, group.rows) @ a.t()) @ b.t())


def _apply_stacked(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: TorchPlan) -> None:
    """Every slot's shrink at once, each row's other slots' columns zeroed, then one expand
    over the slots' B side by side: rows at slot -1 get an exact zero added."""
    slots, rank = weights.num_slots, weights.rank
    mask = plan.masks.get(rank)
    if mask is None:
        owned = plan.token_slots[:, None] == torch.arange(slots, device=x.device)  # [T, slots]
        mask = owned.to(x.dtype).repeat_interleave(rank, dim=1)  # [T, slots x rank]
        if not plan.captured:
            plan.masks[rank] = mask
    a_all = weights.a.view(slots * rank, -1).t()  # [in, slots x rank], a view
    if plan.captured:  # B as the slots hold it at this replay (a copy made inside the graph)
        b_all = _b_side_by_side(weights)
    else:
        b_all = weights.derived.get("torch.b_all")
        if b_all is None:
            b_all = weights.derived["torch.b_all"] = _b_side_by_side(weights)
    out.addmm_(torch.mm(x, a_all).mul_(mask), b_all)


def _b_side_by_side(weights: LoraWeights) -> torch.Tensor:
    """B as [slots x rank, out]: slot s's B^T on rows s x rank .. (s + 1) x rank - 1."""
    return weights.b.transpose(1, 2).reshape(weights.num_slots * weights.rank, -1)


@tessellm.hookimpl
def register_lora(register):
    register(TorchLora)
