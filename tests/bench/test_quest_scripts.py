"""bench/quest.py, bench/quest_e2e.py and bench/quest_gpu.py run (tiny shapes, the CPU) and
report what they claim: a dense and a quest figure per point, and their ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_attention_microbenchmark_reports_dense_quest_and_the_ratio(tmp_path):
    out = tmp_path / "quest.json"
    run("quest.py", "--contexts", "512", "--budgets", "64", "--reps", "1", "--kernel", "torch", "--pages", "4", "16",
        "--json", str(out))
    report = json.loads(out.read_text())
    assert [p["page"] for p in report["points"]] == [4, 16]
    point = report["points"][0]
    assert point["context"] == 512 and point["dense_ms"] > 0 and point["quest_64_ms"] > 0
    assert abs(point["speedup_64"] - point["dense_ms"] / point["quest_64_ms"]) < 0.02 * point["speedup_64"] + 0.01
    assert 0 < point["quest_64_select_ms"] and point["quest_64_select_share"] > 0
    run("quest.py", "--prefill", "64", "--contexts", "256", "--reps", "2", "--json", str(out))
    point, = json.loads(out.read_text())["points"]
    assert point["chunk"] == 64 and point["prefill_sdpa_ms"] > 0 and point["prefill_quest_ms"] > 0
    assert point["prefill_ratio_range"][0] <= point["prefill_ratio"] <= point["prefill_ratio_range"][1]
    assert report["command"].startswith("python bench/quest.py") and report["date"] and report["device"]


@pytest.mark.extended  # a benchmark script's smoke run; QUEST itself: tests/plugins/attention/quest
def test_end_to_end_smoke_runs_both_arms(tmp_path):
    out = tmp_path / "e2e.json"
    run("quest_e2e.py", "--smoke", "--new-tokens", "4", "--json", str(out))
    arms = json.loads(out.read_text())["arms"]
    assert [a["attention"]["name"] for a in arms] == ["sdpa", "quest"]
    assert all(a["results"]["200"]["tpot_ms"] > 0 and a["results"]["200"]["kernel_builds"] == 0 for a in arms)
    assert arms[1]["results"]["200"]["tpot_ratio"] > 0 and arms[1]["results"]["200"]["ttft_ratio"] > 0
    assert arms[1]["rates"][0]["sequences"] == 2 and arms[1]["rates"][0]["rate_ratio"] > 0


@pytest.mark.extended
def test_passkey_arms_and_diagnosis_report_what_they_claim(tmp_path, smollm2_dir):
    """bench/quest_passkey.py on short prompts: dense and one quest arm with the share of
    dense's keys each keeps, and the diagnosis' rules per layer, each share in [0, 1]."""
    out = tmp_path / "passkey.json"
    run("quest_passkey.py", "--context", "200", "--trials", "2", "--budget", "64", "--arms", "{}",
        "--diagnose", "1", "--retrieval-mass", "0.0", "--json", str(out))
    report = json.loads(out.read_text())
    dense, quest = report["arms"]
    assert dense["attention"] == {"name": "sdpa"} and dense["found_of_dense"] == 1.0
    assert quest["attention"]["name"] == "quest" and quest["bounds_page"] == 4 and 0 <= quest["found_of_dense"] <= 1
    assert quest["selection"] and all(0 <= v <= 1 for v in quest["selection"].values())
    overall = report["diagnosis"]["overall"]
    assert set(overall) == {"quest", "relative", "bound_mass", "per_query_head", "true_max", "attention"}
    assert all(0 <= v <= 1 for v in overall.values()) and report["diagnosis"]["pairs"] > 0


@pytest.mark.extended  # a rehearsal of the GPU stage's every part, tiny shapes
def test_the_gpu_stage_rehearses_every_part_and_states_each_target(tmp_path):
    done = run("quest_gpu.py", "--smoke", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "quest_summary.json").read_text())
    assert set(summary["parts"]) == {"layer", "layer-pages", "e2e", "e2e-page-2"}
    assert all(p["status"] == "ok" for p in summary["parts"].values()), done.stdout[-2000:]
    names = set(summary["targets"])
    assert any(n.startswith("1: TTFT") for n in names) and any(n.startswith("2: score+select") for n in names)
    assert any(n.startswith("3: decode rate") for n in names) and "4: e2e-page-2 completes" in names
    assert all({"value", "target", "met"} == set(t) for t in summary["targets"].values())
