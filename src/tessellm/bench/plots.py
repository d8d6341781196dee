"""Plots of the benchmark and A/B reports (matplotlib, the ``[bench]`` extra), as PNG files."""

from __future__ import annotations

from typing import Any

import numpy as np

from tessellm.bench.offline import BenchResult
from tessellm.extras import require

matplotlib = require("matplotlib", "bench")
matplotlib.use("Agg")  # no display needed; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402


def plot_report(report: dict[str, Any], results: dict[str, BenchResult], path: str) -> None:
    """TTFT and TPOT distributions (CDFs) of each result, and a throughput bar chart, as a PNG."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, field, label in ((axes[0], "ttft_s", "TTFT (ms)"), (axes[1], "tpot_s", "TPOT (ms)")):
        for name, res in results.items():
            values = np.sort([getattr(r, field) * 1000 for r in res.requests if getattr(r, field) is not None])
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    names = list(results)
    rates = [results[n].metrics()["output_tokens_per_s"] for n in names]
    bars = axes[2].bar(names, rates, color=["tab:blue", "tab:orange", "tab:green"][:len(names)])
    axes[2].bar_label(bars, fmt="%.1f")
    axes[2].set_ylabel("output tokens/s")
    w = report["workload"]
    fig.suptitle(f"tessellm bench: {w['name']}, {w['num_requests']} requests (seed {w['seed']}) | "
                 f"{report['device']} | {report['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ab_report(report: dict[str, Any], path: str) -> None:
    """Per-round throughput of both arms, and the per-round ratios with the overall ratio and its
    interval, as a PNG."""
    a = np.array(report["a"]["output_tokens_per_s"]["per_round"])
    b = np.array(report["b"]["output_tokens_per_s"]["per_round"])
    x = np.arange(a.size)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(x, a, "o-", label="A")
    left.plot(x, b, "s-", label="B")
    left.set_ylabel("output tokens/s")
    right.plot(x, b / a, "o", color="tab:gray", label="B / A in the round")
    low, high = report["ratio_ci95"]
    right.axhspan(low, high, color="tab:orange", alpha=0.25, label=f"95% CI [{low:.4g}, {high:.4g}]")
    right.axhline(report["ratio"], color="tab:orange", label=f"ratio {report['ratio']:.4g}")
    right.axhline(1.0, color="black", ls="--", lw=0.8)
    right.set_ylabel("B / A output tokens/s")
    for ax in (left, right):
        ax.set_xticks(x, [f"{i}\n{o}" for i, o in zip(x, report["order"])])
        ax.set_xlabel("round (and run order)")
        ax.grid(alpha=0.3)
        ax.legend()
    w = report["workload"]
    fig.suptitle(f"tessellm ab: {w['name']}, {w['num_requests']} requests (seed {w['seed']}) | "
                 f"{report['device']} | {report['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
