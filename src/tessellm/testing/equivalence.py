"""Comparing two float32 computations that need not agree bit for bit.

Two computations agree bit for bit only when they run the same operations, in the same
order, on the same memory layouts. A CPU's matrix kernels pick their blocking (and so their
order of additions) by shape, stride and alignment, and by instruction set: the same
weights loaded from two files, a grouped product against per-expert ones, or one batch
composition against another may differ in the last bits on one CPU and not on another.
Where two sides are not the same by construction, compare them with these: within float32
rounding, and greedy tokens equal up to a near-tie (docs/architecture.md, "Bit-exact only by
construction").
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["NEAR_TIE", "assert_close_in_float32", "greedy_divergence"]

NEAR_TIE = 1e-4
"""A float32 greedy divergence is accepted only where the reference's two best logits are
closer than this: rounding differences of a few ulps can pick either there, not elsewhere."""


def assert_close_in_float32(got: torch.Tensor, expected: torch.Tensor, what: str = "", scale: float = 1e-5) -> None:
    """``got`` equals ``expected`` within float32 rounding accumulated over a forward: each
    element within ``scale`` times the larger of 1 and the tensor's largest magnitude."""
    assert got.shape == expected.shape, f"{what}: shapes {tuple(got.shape)} and {tuple(expected.shape)}"
    bound = scale * max(1.0, float(expected.abs().max()))
    error = float((got.double() - expected.double()).abs().max()) if got.numel() else 0.0
    assert error <= bound, f"{what}: max abs difference {error:.3g}, allowed {bound:.3g} (float32 rounding)"


def greedy_divergence(ours: list[int], reference: list[int], logits_after: Callable[[list[int]], torch.Tensor],
                      where: str = "") -> str | None:
    """None where the two greedy continuations are equal; where they first differ, a report
    if the reference's logits after the common prefix (``logits_after(reference[:i])``,
    a [vocab] row) have their two best within ``NEAR_TIE``, and an assertion error otherwise."""
    if ours == reference:
        return None
    i = next((j for j, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    assert i < min(len(ours), len(reference)), f"{where}: lengths differ ({len(ours)} vs {len(reference)} tokens)"
    top2 = logits_after(reference[:i]).double().topk(2).values
    gap = float(top2[0] - top2[1])
    report = f"{where}: diverges at token {i} ({ours[i]} vs {reference[i]}), top-2 logit gap {gap:.2e}"
    assert gap < NEAR_TIE, "not a near-tie: " + report
    return report
