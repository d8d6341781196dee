"""Do two arms sample from the same distribution? The statistics ``tessellm ab`` runs when either
arm samples.

Each arm draws ``n`` continuations of every prompt. For each output position the tokens there
form a histogram per arm (the position's marginal distribution); so do the continuations
themselves, cut to the longest prefix that still repeats. Each histogram pair gets a
chi-square test of homogeneity; tokens too rare for the chi-square approximation are pooled
into one bin first. Prompts are independent, so their statistics and degrees of freedom add up
to one test per position. Holm's step-down method keeps the chance of any false rejection
across the positions at ``alpha``.

Power is stated as the smallest total-variation distance (between the arms' distributions
over the test's bins, the same at every prompt) that a test rejects with probability
``power``, for the least detectable such difference: the noncentrality of the chi-square is
at least ``4 TV^2 n_a n_b / (n_a + n_b)`` per prompt, with equality when the difference is
spread over the bins in proportion to their mass.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

MIN_BIN_COUNT = 10
"""A bin needs this many draws of both arms together (5 expected per arm with equal samples)."""
ENDED = -1
"""The category of a position past a continuation's end (a stop string ended it early)."""
TEST_NAME = ("chi-square homogeneity per output position and on continuations (their longest repeating prefix), "
             "summed over prompts, Holm-corrected")


# ----------------------------------------------------------------------------- chi-square distributions


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    if df <= 0:
        return 1.0
    x = torch.tensor(max(statistic, 0.0) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), x))


def chi_square_quantile(q: float, df: int) -> float:
    """The x with P(X <= x) = q for X ~ chi-square(df), by bisection."""
    low, high = 0.0, float(df) + 10.0
    while 1.0 - chi_square_sf(high, df) < q:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if 1.0 - chi_square_sf(mid, df) < q else (low, mid)
    return (low + high) / 2


def noncentral_chi_square_sf(x: float, df: int, noncentrality: float) -> float:
    """P(X > x) for X ~ noncentral chi-square(df, noncentrality): a Poisson(noncentrality / 2)
    mixture of central chi-squares with df + 2j degrees of freedom."""
    half = noncentrality / 2
    last = int(half + 12 * math.sqrt(half) + 30)
    j = torch.arange(last + 1, dtype=torch.float64)
    log_weights = -half + j * math.log(half) - torch.lgamma(j + 1) if half > 0 else torch.where(j == 0, 0.0, -math.inf)
    tails = torch.special.gammaincc((df + 2 * j) / 2, torch.tensor(x / 2, dtype=torch.float64))
    return float((log_weights.exp() * tails).sum().clamp(0.0, 1.0))


def detectable_noncentrality(df: int, alpha: float, power: float = 0.8) -> float:
    """The noncentrality at which a chi-square(df) test at level ``alpha`` rejects with
    probability ``power``."""
    critical = chi_square_quantile(1.0 - alpha, df)
    low, high = 0.0, 1.0
    while noncentral_chi_square_sf(critical, df, high) < power:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if noncentral_chi_square_sf(critical, df, mid) < power else (low, mid)
    return (low + high) / 2


def detectable_tv(df: int, sample_sizes: Sequence[tuple[int, int]], alpha: float, power: float = 0.8) -> float | None:
    """Smallest total-variation distance, the same at each prompt, that the summed test with
    ``df`` degrees of freedom over prompts drawn ``(n_a, n_b)`` times each detects with
    probability ``power`` at level ``alpha``, whatever shape the difference takes; None if even
    TV 1 is not enough."""
    if df <= 0:
        return None
    weight = sum(4 * n_a * n_b / (n_a + n_b) for n_a, n_b in sample_sizes if n_a and n_b)
    tv = math.sqrt(detectable_noncentrality(df, alpha, power) / weight) if weight else math.inf
    return tv if tv <= 1.0 else None


# ----------------------------------------------------------------------------- one histogram pair


def binned_counts(a: Sequence[Hashable], b: Sequence[Hashable],
                  min_count: int = MIN_BIN_COUNT) -> list[tuple[int, int]]:
    """The two arms' draws as ``(count in a, count in b)`` per bin. A bin is a category drawn at
    least ``min_count`` times by both arms together; the rarer categories share one bin,
    which joins the smallest other bin if it is itself too small. Bins depend on the pooled
    draws only, so they favour neither arm."""
    ca, cb = Counter(a), Counter(b)
    pooled = ca + cb
    common = [c for c, k in pooled.most_common() if k >= min_count]
    bins = [(ca[c], cb[c]) for c in common]
    rest = (len(a) - sum(x for x, _ in bins), len(b) - sum(y for _, y in bins))
    if sum(rest) >= min_count or not bins:
        bins.append(rest)
    elif sum(rest):
        x, y = bins.pop()  # most_common order: the last bin is the smallest
        bins.append((x + rest[0], y + rest[1]))
    return [pair for pair in bins if sum(pair)]


def chi_square_homogeneity(bins: Sequence[tuple[int, int]]) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom for a 2 x len(bins) table of counts."""
    n_a, n_b = sum(x for x, _ in bins), sum(y for _, y in bins)
    total = n_a + n_b
    if len(bins) < 2 or not n_a or not n_b:
        return 0.0, 0
    statistic = 0.0
    for x, y in bins:
        ea, eb = n_a * (x + y) / total, n_b * (x + y) / total
        statistic += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return statistic, len(bins) - 1


def repeating_prefix_length(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]],
                            min_count: int = MIN_BIN_COUNT) -> int:
    """The longest k such that at least half of all continuations share their first k tokens
    with ``min_count`` - 1 others (pooled over both arms); 0 if none does at k = 1."""
    longest = max((len(c) for c in [*a, *b]), default=0)
    best = 0
    for k in range(1, longest + 1):
        counts = Counter(tuple(c[:k]) for c in [*a, *b])
        if 2 * sum(n for n in counts.values() if n >= min_count) < len(a) + len(b):
            break
        best = k
    return best


# ----------------------------------------------------------------------------- the whole comparison


@dataclass
class SummedTest:
    """One chi-square test, its statistic and degrees of freedom summed over prompts."""

    what: str
    """``"position 3"`` (the 1-based output position) or ``"continuation"``."""
    statistic: float = 0.0
    df: int = 0
    sample_sizes: list[tuple[int, int]] = field(default_factory=list)
    """Per prompt that contributed a table: (draws of A, draws of B)."""
    p_value: float = 1.0
    p_adjusted: float = 1.0
    """After Holm's correction over all tests that have degrees of freedom."""
    detectable_tv: float | None = None
    """Smallest TV this test detects with the comparison's power at its Bonferroni level."""

    def add(self, bins: list[tuple[int, int]]) -> None:
        statistic, df = chi_square_homogeneity(bins)
        if df:
            self.statistic += statistic
            self.df += df
            self.sample_sizes.append((sum(x for x, _ in bins), sum(y for _, y in bins)))


@dataclass
class DistributionComparison:
    """Whether A's and B's sampled continuations could come from one distribution."""

    tests: list[SummedTest]
    alpha: float
    power: float
    rejected: bool
    p_value: float
    """Smallest Holm-adjusted p-value (1.0 when nothing was testable)."""
    testable: bool

    def as_dict(self) -> dict[str, Any]:
        """The report's ``distribution`` entry (without the sample sizes, which the caller knows)."""
        run = [t for t in self.tests if t.df]
        return {"test": TEST_NAME, "alpha": self.alpha, "power": self.power, "rejected": self.rejected,
                "p_value": self.p_value, "verdict": self.verdict,
                "detectable_tv": run[0].detectable_tv if run else None,
                "tests": [{"what": t.what, "statistic": round(t.statistic, 4), "df": t.df,
                           "p_value": t.p_value, "p_adjusted": t.p_adjusted, "detectable_tv": t.detectable_tv}
                          for t in run]}

    @property
    def verdict(self) -> str:
        if not self.testable:
            return "untestable: no token repeats often enough; draw more samples"
        if self.rejected:
            where = min((t for t in self.tests if t.df), key=lambda t: t.p_adjusted).what
            return f"differ: rejected at p={self.p_value:.3g} ({where})"
        return f"same distribution: not rejected (smallest adjusted p {self.p_value:.3g})"


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: reject where adjusted p <= alpha keeps the chance of
    any false rejection at alpha, whatever the dependence between the tests."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def position_tokens(continuations: Sequence[Sequence[int]], position: int) -> list[int]:
    """Each continuation's token at ``position`` (0-based), ``ENDED`` past its end."""
    return [c[position] if position < len(c) else ENDED for c in continuations]


def compare_continuations(a: Sequence[Sequence[Sequence[int]]], b: Sequence[Sequence[Sequence[int]]], *,
                          alpha: float = 0.05, power: float = 0.8,
                          min_count: int = MIN_BIN_COUNT) -> DistributionComparison:
    """Test whether ``a[i]`` and ``b[i]`` (each arm's continuations of prompt i, token ids)
    come from one distribution: one summed chi-square test per output position and one on
    continuations (cut to their longest repeating prefix, when that is 2 tokens or more),
    Holm-corrected; see the module docstring."""
    if len(a) != len(b):
        raise ValueError(f"the arms have continuations of {len(a)} and {len(b)} prompts")
    length = max((len(c) for arm in (a, b) for cs in arm for c in cs), default=0)
    tests = [SummedTest(f"position {t + 1}") for t in range(length)] + [SummedTest("continuation")]
    for ca, cb in zip(a, b):
        for t in range(length):
            tests[t].add(binned_counts(position_tokens(ca, t), position_tokens(cb, t), min_count))
        k = repeating_prefix_length(ca, cb, min_count)
        if k >= 2:
            tests[-1].add(binned_counts([tuple(c[:k]) for c in ca], [tuple(c[:k]) for c in cb], min_count))
    run = [t for t in tests if t.df]
    for test in run:
        test.p_value = chi_square_sf(test.statistic, test.df)
    for test, p in zip(run, holm_adjusted([t.p_value for t in run])):
        test.p_adjusted = p
        test.detectable_tv = detectable_tv(test.df, test.sample_sizes, alpha / len(run), power)
    smallest = min((t.p_adjusted for t in run), default=1.0)
    return DistributionComparison(tests, alpha, power, smallest <= alpha, smallest, bool(run))


def format_comparison(d: dict[str, Any]) -> list[str]:
    """Text lines for a report's ``distribution`` entry (``as_dict`` plus ``prompts``,
    ``samples_per_arm`` and ``max_tokens``)."""
    lines = [f"sampled distributions on {d['prompts']} prompts x {d['samples_per_arm']} continuations x "
             f"{d['max_tokens']} tokens per arm: {d['verdict']}",
             f"  test: {d['test']}, alpha {d['alpha']:g}"]
    tvs = [t["detectable_tv"] for t in d["tests"]]
    if tvs:
        shown = lambda tv: "- (no power)" if tv is None else f"{tv:.3g}"  # noqa: E731
        known = [tv for tv in tvs if tv is not None]
        spread = f" ({min(known):.3g} to {max(known):.3g} over the {len(tvs)} tests)" if len(known) > 1 else ""
        lines.append(f"  power: {100 * d['power']:.0f}% to detect a total variation of {shown(tvs[0])} at "
                     f"{d['tests'][0]['what']}, per prompt{spread}")
    lines += [f"  {t['what']}: chi2 {t['statistic']:.4g} (df {t['df']}), p {t['p_value']:.3g}, "
              f"adjusted {t['p_adjusted']:.3g}" for t in d["tests"] if t["p_adjusted"] <= d["alpha"]]
    return lines
