"""How often ``tessellm ab``'s 95% interval contains 1 when the two arms are the same
pipeline: simulated round times with what a shared machine does to them, run through the
tool's own schedule (``round_orders``, untimed warm-up rounds) and interval
(``paired_ratio_ci``), beside the percentile bootstrap over rounds the tool used before
(timed from the first, cold run, with the tiny warm-up it had).

A run's throughput is base x exp(drift(t) + cold + order + noise), t counting runs in the
order they happen:

- drift: a random walk (machine load coming and going), a linear trend and a slow wave
  (clock boost fading, thermal cycles), shared by both arms;
- cold: an arm's first run is slower (allocator growth, caches, lazy set-up), its second a
  little;
- order: the second run of a round gains a little from the first (warm caches);
- noise: Gaussian jitter, and now and then a run slowed by interference (heavy-tailed).

    .venv/bin/python bench/ab_calibration.py [--sims 20000] [--bootstrap-sims 1000] [--rounds 3 4 5 8]

Prints, per scenario, number of rounds and which arm runs first, the share of simulated
identical-arm tests whose interval contains 1, for the calibrated tool and for the old one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np

from tessellm.bench.ab import bootstrap_ratio_ci
from tessellm.bench.intervals import paired_log_ratio_t, round_orders


@dataclass(frozen=True)
class Machine:
    """What happens to run times (log-throughput terms; 0.05 is about 5%)."""

    jitter: float = 0.03          # Gaussian noise per run
    spike_rate: float = 0.0       # chance a run is slowed by interference
    spike: float = 0.15           # how much, at most (uniform in [0, spike])
    walk: float = 0.0             # random-walk step per run
    trend: float = 0.0            # linear drift per run
    wave: float = 0.0             # amplitude of a slow wave (period 10 runs)
    cold: float = 0.0             # an arm's first run is this much slower, its second a third of it
    order: float = 0.0            # the second run of a round is this much faster


SCENARIOS = {
    "noise": Machine(),
    "drift": Machine(walk=0.02, trend=0.01, wave=0.05),
    "cold start": Machine(cold=0.12),
    "interference": Machine(spike_rate=0.15, spike=0.3),
    "order effect": Machine(order=0.03),
    "all at once": Machine(jitter=0.03, spike_rate=0.1, spike=0.25, walk=0.02, trend=0.01, wave=0.04, cold=0.12,
                           order=0.02),
}
"""The machines simulated; "all at once" is the issue's kind of spell (drift, a cold first
run, noise)."""


def simulate(machine: Machine, rng: np.random.Generator, tests: int, rounds: int, *, warmup_rounds: int,
             first: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``tests`` identical-arm A/B tests at once: each arm's timed throughput per round
    [tests, rounds], and the rounds' orders."""
    orders = round_orders(rounds, first)
    runs = [arm for _ in range(warmup_rounds) for arm in (first, "B" if first == "A" else "A")]
    runs += [arm for order in orders for arm in order]
    shape = (tests, len(runs))
    t = np.arange(len(runs))
    log_tps = np.cumsum(rng.normal(0, machine.walk, shape), axis=1) + machine.trend * t
    log_tps += machine.wave * np.sin(2 * np.pi * t / 10 + rng.uniform(0, 2 * np.pi, (tests, 1)))
    log_tps += rng.normal(0, machine.jitter, shape)
    log_tps -= (rng.random(shape) < machine.spike_rate) * rng.uniform(0, machine.spike, shape)
    nth = [runs[:i].count(arm) for i, arm in enumerate(runs)]  # the arm's how-many-th run
    log_tps -= machine.cold * np.array([1.0 if k == 0 else 1 / 3 if k == 1 else 0.0 for k in nth])
    log_tps += machine.order * np.array([i >= 2 * warmup_rounds and i % 2 == 1 for i in range(len(runs))])
    timed = 30.0 * np.exp(log_tps[:, 2 * warmup_rounds:])
    a = np.stack([timed[:, 2 * r + order.index("A")] for r, order in enumerate(orders)], axis=1)
    b = np.stack([timed[:, 2 * r + order.index("B")] for r, order in enumerate(orders)], axis=1)
    return a, b, orders


def coverage(machine: Machine, rounds: int, first: str, sims: int, *, seed: int = 0,
             method: str = "calibrated") -> float:
    """The share of ``sims`` simulated identical-arm tests whose 95% interval contains 1:
    ``method`` "calibrated" (one untimed warm-up round, the tool's ``paired_log_ratio_t``)
    or "bootstrap" (timed from the first run, the percentile bootstrap over rounds)."""
    key = [seed, rounds, ord(first), *(round(v * 1e4) for v in vars(machine).values())]
    rng = np.random.default_rng(key)
    if method == "calibrated":
        a, b, orders = simulate(machine, rng, sims, rounds, warmup_rounds=1, first=first)
        _, low, high = paired_log_ratio_t(a, b, orders)
        return float(((low <= 0) & (0 <= high)).mean())
    a, b, _ = simulate(machine, rng, sims, rounds, warmup_rounds=0, first=first)
    covered = sum(low <= 1.0 <= high for low, high in
                  (bootstrap_ratio_ci(a[i], b[i], seed=i, resamples=2_000) for i in range(sims)))
    return covered / sims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sims", type=int, default=20_000, help="simulated A/B tests per cell (default 20000)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[3, 4, 5, 8])
    parser.add_argument("--bootstrap-sims", type=int, default=1000, help="simulated tests per cell, old tool")
    args = parser.parse_args()
    print(f"# bench/ab_calibration.py, {datetime.now(timezone.utc):%Y-%m-%d}: share of identical-arm tests whose "
          f"95% interval contains 1 ({args.sims} simulated tests a cell; old tool {args.bootstrap_sims})")
    print(f"{'scenario':<14} {'rounds':>6} {'first':>5} {'calibrated':>10} {'old bootstrap':>13}")
    for name, machine in SCENARIOS.items():
        for rounds in args.rounds:
            for first in ("A", "B"):
                new = coverage(machine, rounds, first, args.sims)
                old = coverage(machine, rounds, first, args.bootstrap_sims, method="bootstrap")
                print(f"{name:<14} {rounds:>6} {first:>5} {new:>10.4f} {old:>13.4f}")


if __name__ == "__main__":
    main()
