"""The live A/B's report, in ``tessellm ab``'s terms (bench/ab.py): each arm's output tokens
per second and latency percentiles, the ratio B/A with a paired bootstrap 95% interval (here
over requests, each request's two answers being a pair, where offline pairs rounds), and the
exact-match rate of the texts over the requests that can agree (greedy or seeded)."""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from typing import Any

import numpy as np

AGREEMENT_NOTE = ("agreement is only meaningful for greedy (temperature 0) or seeded requests: only those are "
                  "compared; sampled requests count for speed only")
SHARED_MACHINE_NOTE = "both arms answer every request at the same time, so on one machine they share its cores"


def _summary(values: list[float | None]) -> dict[str, float | None]:
    from tessellm.bench.offline import summarize

    return summarize(values)


def arm_summary(results: list[Any], url: str) -> dict[str, Any]:
    """One arm's speed and latency over its answered requests."""
    ok = [r for r in results if r.ok]
    rates = [r.tokens_per_s for r in ok if r.tokens_per_s is not None]
    return {"url": url, "answered": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
            "output_tokens_per_s": {"mean": round(float(np.mean(rates)), 3) if rates else None},
            "ttft_ms": _summary([r.ttft_s for r in ok]), "e2e_ms": _summary([r.wall_s for r in ok])}


def speed_ratio(records: list[Any]) -> tuple[float | None, list[float] | None, int]:
    """B/A of mean output tokens/s over the requests both arms answered, its paired bootstrap
    95% interval (None under two pairs) and the number of pairs."""
    from tessellm.bench.ab import bootstrap_ratio_ci

    pairs = [(r.a.tokens_per_s, r.b.tokens_per_s) for r in records
             if r.a.tokens_per_s is not None and r.b.tokens_per_s is not None]
    if not pairs:
        return None, None, 0
    a, b = (np.array(x) for x in zip(*pairs))
    ratio = round(float(b.mean() / a.mean()), 4)
    if len(pairs) < 2:
        return ratio, None, len(pairs)
    low, high = bootstrap_ratio_ci(a, b, seed=0)
    return ratio, [round(low, 4), round(high, 4)], len(pairs)


def agreement(records: list[Any]) -> dict[str, Any]:
    """Exact match of the texts (every choice) over the comparable requests both arms answered."""
    compared = [r for r in records if r.comparable and r.a.ok and r.b.ok and r.a.texts and r.b.texts]
    differ = [i for i, r in enumerate(compared) if r.a.texts != r.b.texts]
    return {"compared": len(compared), "exact_match_rate": None if not compared else
            round(1 - len(differ) / len(compared), 4), "differing": len(differ),
            "not_comparable": sum(1 for r in records if not r.comparable)}


def live_report(records: list[Any], labels: tuple[str, str], command: str, started: str,
                urls: tuple[str, str] = ("", "")) -> dict[str, Any]:
    """The report GET /ab returns and ``tessellm ab --serve`` prints at exit."""
    ratio, ci, pairs = speed_ratio(records)
    return {"mode": "live", "requests": len(records), "a": {"label": labels[0], **arm_summary([r.a for r in records],
                                                                                            urls[0])},
            "b": {"label": labels[1], **arm_summary([r.b for r in records], urls[1])},
            "ratio": ratio, "ratio_ci95": ci, "pairs": pairs, **agreement(records),
            "notes": [AGREEMENT_NOTE, SHARED_MACHINE_NOTE], "started": started,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
            "python": platform.python_version()}


def format_live_report(report: dict[str, Any]) -> str:
    """Plain text, as ``format_ab_report`` writes the offline one."""
    a, b = report["a"], report["b"]
    cell = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    lines = [f"tessellm ab --serve: {report['requests']} mirrored requests; A {a['label']} -> B {b['label']}",
             f"{'':<22}{'A':>12}{'B':>12}",
             f"{'answered':<22}{a['answered']:>12}{b['answered']:>12}",
             f"{'failed':<22}{a['failed']:>12}{b['failed']:>12}",
             f"{'output tokens/s mean':<22}{cell(a['output_tokens_per_s']['mean']):>12}"
             f"{cell(b['output_tokens_per_s']['mean']):>12}"]
    lines += [f"{key + ' ' + stat:<22}{cell(a[key][stat]):>12}{cell(b[key][stat]):>12}"
              for key in ("ttft_ms", "e2e_ms") for stat in ("p50", "p90", "p99")]
    if report["ratio"] is None:
        lines.append("ratio B/A (output tokens/s): no request answered by both arms yet")
    elif report["ratio_ci95"] is None:
        lines.append(f"ratio B/A (output tokens/s): {report['ratio']:.4g} over 1 request (no interval)")
    else:
        low, high = report["ratio_ci95"]
        verdict = "no difference resolved" if low <= 1 <= high else ("B faster" if low > 1 else "B slower")
        lines.append(f"ratio B/A (output tokens/s): {report['ratio']:.4g}, 95% CI [{low:.4g}, {high:.4g}] over "
                     f"{report['pairs']} requests: {verdict}")
    if report["compared"]:
        lines.append(f"agreement on {report['compared']} greedy or seeded requests: exact match "
                     f"{100 * report['exact_match_rate']:.1f}% ({report['differing']} differ)")
    else:
        lines.append("agreement: no greedy or seeded request answered by both arms yet")
    lines += [f"note: {n}" for n in report["notes"]]
    for arm in ("a", "b"):
        lines += [f"{arm.upper()} error: {e}" for e in report[arm]["errors"]]
    lines.append(f"{report['date']}  $ {report['command']}")
    return "\n".join(lines)
