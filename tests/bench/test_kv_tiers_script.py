"""bench/kv_tiers.py and bench/kv_tiers_gpu.py run (the CPU rehearsals) and report what they
claim: every arm of the multi-turn comparison with its tier hits, and the tier copy bandwidth
beside one large copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


def run(script: str, *args: str, out: Path) -> dict:
    done = subprocess.run([sys.executable, str(BENCH / script), *args, str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.extended
def test_copy_bandwidth_rehearsal_on_the_cpu(tmp_path):
    report = run("kv_tiers_gpu.py", "--blocks", "2", "--out", out=tmp_path / "gpu.json")
    assert report["device"].startswith("cpu") and report["command"].startswith("python ")
    assert report["write_back_GBps"] > 0 and report["load_GBps"] > 0 and report["load_vs_raw"] > 0


@pytest.mark.extended
def test_multi_turn_smoke_runs_every_arm(tmp_path):
    report = run("kv_tiers.py", "--smoke", "--json", out=tmp_path / "tiers.json")
    arms = {a["arm"]: a for a in report["arms"]}
    assert list(arms) == ["device", "host", "host+disk (cold)", "host+disk (restart)", "disk (restart)"]
    assert arms["device"]["tiers"] == {} and arms["host"]["tiers"]["host"]["hit_tokens"] > 0
    for name in ("host+disk (restart)", "disk (restart)"):  # the first process's blocks, read from disk
        assert arms[name]["tiers"]["disk"]["hit_tokens"] > 0
        assert arms[name]["prefix_hit_rate"] > arms["host+disk (cold)"]["prefix_hit_rate"]
