"""bench/quest.py and bench/quest_e2e.py run (tiny shapes) and report what they claim: a
dense and a quest figure per point, and their ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_attention_microbenchmark_reports_dense_quest_and_the_ratio(tmp_path):
    out = tmp_path / "quest.json"
    run("quest.py", "--contexts", "512", "--budgets", "64", "--reps", "1", "--kernel", "torch", "--json", str(out))
    report = json.loads(out.read_text())
    point, = report["points"]
    assert point["context"] == 512 and point["dense_ms"] > 0 and point["quest_64_ms"] > 0
    assert abs(point["speedup_64"] - point["dense_ms"] / point["quest_64_ms"]) < 0.02 * point["speedup_64"] + 0.01
    assert report["command"].startswith("python bench/quest.py") and report["date"] and report["device"]


def test_end_to_end_smoke_runs_both_arms(tmp_path):
    out = tmp_path / "e2e.json"
    run("quest_e2e.py", "--smoke", "--new-tokens", "4", "--json", str(out))
    arms = json.loads(out.read_text())["arms"]
    assert [a["attention"]["name"] for a in arms] == ["sdpa", "quest"]
    assert all(a["tpot_ms"] > 0 for a in arms) and arms[1]["decode_speedup"] > 0
