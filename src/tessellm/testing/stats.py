"""Goodness-of-fit for sampler tests: does a sampler draw from the distribution it should?"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> ChiSquare:
    """Pearson's chi-square test of observed ``counts`` against category ``probs``.

    Categories expected fewer than ``min_expected`` times are pooled into one (the test's
    approximation needs about five per cell); a draw in a category of probability 0 makes the
    statistic infinite. The p-value is the chi-square survival function,
    Q(dof / 2, statistic / 2), the regularised upper incomplete gamma function.
    """
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    if counts.shape != probs.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and probs {tuple(probs.shape)} differ in shape")
    n = float(counts.sum())
    if float(counts[probs <= 0].sum()) > 0:
        return ChiSquare(float("inf"), 0, 0.0)
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = int(obs.numel()) - 1
    if dof < 1:
        raise ValueError("fewer than two categories with enough expected draws; draw more samples")
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return ChiSquare(stat, dof, p)
