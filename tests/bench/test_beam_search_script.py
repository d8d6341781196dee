"""bench/beam_search.py runs at small sizes (--smoke, CPU) and reports what it claims: a beam
group holds fewer blocks than independent copies of its prompt, and the same best beams as
transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "beam_search.py"


@pytest.mark.extended
def test_smoke_reports_blocks_and_agreement(tmp_path):
    out = tmp_path / "beam.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python ") and report["device"].startswith("cpu")
    memory, speed = report["memory"], report["speed"]
    assert memory["beam_group_peak_blocks"] < memory["independent_copies_peak_blocks"]
    assert speed["same_best_beam"] == f"{speed['prompts']}/{speed['prompts']}"
    assert speed["tessellm_requests_per_s"] > 0 and speed["transformers_batched_requests_per_s"] > 0
