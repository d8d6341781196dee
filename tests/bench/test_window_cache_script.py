"""bench/window_cache.py runs at a short context (--smoke, CPU) and reports what it claims:
the same greedy tokens with and without out-of-window release, fewer K/V bytes held with it,
and `tessellm bench`'s KV figures for both arms."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "window_cache.py"


@pytest.mark.extended  # a benchmark script's smoke run; the release itself: tests/plugins/cache/paged
def test_smoke_compares_release_on_and_off(tmp_path):
    out = tmp_path / "window.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python ") and "--smoke" in report["command"]
    assert datetime.fromisoformat(report["date"]).utcoffset().total_seconds() == 0
    assert report["device"].startswith("cpu")
    off, on = report["arms"]
    assert (off["cache"], on["cache"]) == ("PagedCache", "WindowedPagedCache")
    assert report["identical_outputs"] is True
    assert on["kv_bytes_held_at_end"] < off["kv_bytes_held_at_end"] and report["kv_held_ratio"] > 1
    assert on["kv_bytes_per_token_at_max_len"] < off["kv_bytes_per_token"] <= off["kv_bytes_per_token_at_max_len"]
    assert on["kv_sequences_at_max_len"] > off["kv_sequences_at_max_len"] > 0
    assert on["kv_longest_context"] > 0 and on["tpot_ms"] > 0 and off["tpot_ms"] > 0
