"""bench/moe.py runs at tiny shapes (--smoke, CPU) and reports what it claims: both forms of
the MoE layer timed at every shape and token count, in agreement, and a wrong grouped path
flagged."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "bench" / "moe.py"


@pytest.mark.extended
def test_smoke_times_both_forms_at_every_point(tmp_path):
    out = tmp_path / "moe.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python ") and "--smoke" in report["command"]
    assert datetime.fromisoformat(report["date"]).utcoffset().total_seconds() == 0
    assert report["device"].startswith("cpu") and report["torch"] == torch.__version__ and report["threads"] >= 1
    assert report["dtype"] == "float32" and report["smoke"] is True and report["reps"] >= 1
    assert set(report["shapes"]) == {"mixtral", "deepseek"}
    assert report["shapes"]["deepseek"]["shared_intermediate_size"] > 0
    assert [(p["shape"], p["tokens"]) for p in report["points"]] == \
        [(shape, tokens) for shape in report["shapes"] for tokens in (1, 16)]
    for p in report["points"]:
        assert p["reference_ms"] > 0 and p["grouped_ms"] > 0
        assert abs(p["speedup"] - p["reference_ms"] / p["grouped_ms"]) <= 0.01 * p["speedup"] + 0.01
        top_k = report["shapes"][p["shape"]]["top_k"]
        assert 1 <= p["experts_used"] <= min(p["tokens"] * top_k, report["shapes"][p["shape"]]["num_experts"])
        assert p["pad"] >= 1.0
        assert p["agree"] is True and p["max_abs_diff"] < 1e-4 and p["max_abs_out"] > 0.01
    assert "grouped_ms" in done.stdout and "MISMATCH" not in done.stdout


@pytest.mark.extended
def test_a_wrong_grouped_path_is_flagged(tmp_path, monkeypatch, capsys):
    from tessellm.core.model.moe import MoE

    spec = importlib.util.spec_from_file_location("bench_moe", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    right = MoE._grouped
    monkeypatch.setattr(MoE, "_grouped", lambda self, *a: right(self, *a) * 1.01)
    out = tmp_path / "moe.json"
    assert script.main(["--smoke", "--shapes", "mixtral", "--tokens", "16", "--reps", "1", "--json", str(out)]) == 1
    point, = json.loads(out.read_text())["points"]
    assert point["agree"] is False and point["max_abs_diff"] > 1e-3
    assert "MISMATCH" in capsys.readouterr().out
