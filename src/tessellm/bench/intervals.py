"""How ``tessellm ab`` times two arms and puts an interval on their speed ratio.

Schedule. Each arm first runs the workload ``warmup_rounds`` times untimed (after a tiny
warm-up request): a first run pays for allocator growth, caches and lazy set-up that later
runs do not, and timing it would favour whichever arm ran second. Then the timed rounds run
in paired blocks: round 0 runs A then B, round 1 B then A, and so on (``round_orders``), so
each round's two runs are adjacent in time and the order alternates.

Interval. Each round gives one paired log ratio, d_i = log(b_i / a_i): drift between rounds
(clock boost, other load coming and going) cancels in it, since both runs of a round share
it. What is left is noise, plus drift within the round, which falls on B in an "AB" round
and on A in a "BA" round, and any advantage of running first or second: an order effect of
opposite sign in the two kinds of round. ``paired_log_ratio_t`` removes the order effect by
a least-squares fit and puts Student-t intervals on the rest (exact when the noise is
normal), widened to hold the plain paired interval too, so that noise that is not normal
(interference) or a large order effect does not make it claim a difference: a false
difference between identical arms is the worst an A/B tool can report.

The percentile bootstrap over rounds that ``tessellm ab`` used before resampled a handful of
rounds as if they were the population: with 4 rounds it covers a true ratio of 1 far less
often than 95% of the time (bench/ab_calibration.py measures both).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np


def round_orders(rounds: int, first: str = "A") -> list[str]:
    """Each timed round's run order: "AB", "BA", "AB", ... (from "BA" when ``first`` is "B")."""
    if first not in ("A", "B"):
        raise ValueError(f"first must be 'A' or 'B', got {first!r}")
    pair = ["AB", "BA"] if first == "A" else ["BA", "AB"]
    return [pair[i % 2] for i in range(rounds)]


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom, by Simpson's rule on the density."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    x = np.linspace(0.0, abs(t), 4001)  # an even number of panels
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    h = x[1] - x[0]
    area = h / 3 * (density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum())
    return 0.5 + math.copysign(area, t)


@functools.lru_cache(maxsize=256)
def student_t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = ``p`` for Student's t with ``df`` degrees of freedom."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    low, high = -1.0, 1.0
    while student_t_cdf(low, df) > p:
        low *= 2
    while student_t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if student_t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def paired_ratio_ci(a: Sequence[float], b: Sequence[float], orders: Sequence[str],
                    level: float = 0.95) -> tuple[float, tuple[float, float]]:
    """B's speed over A's from paired rounds (``a[i]``, ``b[i]``: each arm's throughput in
    round i, run in ``orders[i]``, "AB" or "BA"), and its ``level`` interval: exp of
    ``paired_log_ratio_t``'s estimate and interval (the module's docstring says why)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError("a and b must be 1-d: one throughput per round")
    mu, low, high = paired_log_ratio_t(a[None], b[None], orders, level)
    return math.exp(mu[0]), (math.exp(low[0]), math.exp(high[0]))


def paired_log_ratio_t(a: np.ndarray, b: np.ndarray, orders: Sequence[str],
                       level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For many tests at once (a, b [tests, rounds], all with the same ``orders``) the log of
    B's speed over A's and its ``level`` interval, each [tests], from the rounds' log ratios
    d_i = log(b_i / a_i):

    - the estimate is mu of the least-squares fit d_i = mu + gamma * s_i (s_i = +1 for an
      "AB" round, -1 for "BA"): the ratio with the order effect removed (with as many rounds
      of each order, the mean of d);
    - the interval is the smallest holding two Student-t intervals, each exact when the noise
      is normal: that fit's (n - 2 degrees of freedom), and the plain one of the mean of d
      (n - 1), which an order effect can only widen. Where the noise is not normal (a run
      slowed now and then by interference) or an order effect is large, one of them may
      cover less than ``level``; the two together cover at least ``level`` on every machine
      bench/ab_calibration.py simulates. Two rounds give the plain interval alone."""
    n = a.shape[-1]
    if a.shape != b.shape or len(orders) != n or (a <= 0).any() or (b <= 0).any():
        raise ValueError("a, b and orders must be equally long, with positive a and b")
    sign = np.array([{"AB": 1.0, "BA": -1.0}[o] for o in orders])
    if n < 2 or abs(sign.sum()) == n:
        raise ValueError(f"an interval needs rounds in both orders (AB and BA), got {list(orders)}")
    d = np.log(b) - np.log(a)  # [tests, n]
    quantile = 0.5 + level / 2
    mean = d.mean(-1)
    half = student_t_quantile(quantile, n - 1) * d.std(-1, ddof=1) / math.sqrt(n)
    if n == 2:
        return mean, mean - half, mean + half
    design = np.stack([np.ones(n), sign], axis=1)  # [n, 2]
    coef = d @ np.linalg.pinv(design).T  # [tests, 2]: mu, gamma
    residual = d - coef @ design.T
    variance = (residual * residual).sum(-1) / (n - 2)
    mu = coef[:, 0]
    fitted = student_t_quantile(quantile, n - 2) * np.sqrt(variance * np.linalg.inv(design.T @ design)[0, 0])
    return mu, np.minimum(mu - fitted, mean - half), np.maximum(mu + fitted, mean + half)
