"""bench/lora_kernels.py runs at tiny shapes (--smoke, CPU, the kernels interpreted) and
reports what it claims: both LoRA kernels timed at every point, triton within tolerance of
the float32 reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "bench" / "lora_kernels.py"


@pytest.mark.extended
@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke checks the CPU code path")
def test_smoke_times_both_kernels_at_every_point(tmp_path):
    out = tmp_path / "lora.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python ") and "--smoke" in report["command"]
    assert datetime.fromisoformat(report["date"]).utcoffset().total_seconds() == 0
    assert report["device"].startswith("cpu") and report["smoke"] is True and report["dtype"] == "float32"
    kinds = {p["kind"] for p in report["points"]}
    assert kinds == {"decode", "prefill", "mixed"} and len(report["points"]) == 8
    for p in report["points"]:
        assert p["triton_us"] > 0 and p["torch_us"] > 0 and p["ok"] is True and p["max_err"] < 1e-4
    assert "triton_us" in done.stdout and "ERROR" not in done.stdout
