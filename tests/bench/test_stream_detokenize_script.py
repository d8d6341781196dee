"""bench/stream_detokenize.py runs at small sizes and reports what it claims: both ways (the
old engine-thread detokenizing and the new reader-side one) per output length, with and
without a stop string, their streamed texts equal to the decoded output (the script asserts
it), and the new way's engine-thread part a share of its step."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "stream_detokenize.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_stream_detokenize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_small_run_reports_both_ways_at_each_length(script, tokenizer_dir, tmp_path):
    out = tmp_path / "sd.json"
    assert script.main(["--lengths", "40", "120", "--repeats", "1", "--tokenizer", str(tokenizer_dir),
                        "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python bench/stream_detokenize.py --lengths 40 120")
    assert {(r["arm"], r["output_tokens"], bool(r["stop"])) for r in report["rows"]} == \
        {(arm, n, stop) for arm in ("old", "new") for n in (40, 120) for stop in (False, True)}
    assert set(report["growth"]) == {"old", "new", "old_stop", "new_stop"}
    for row in report["rows"]:
        assert 0 < row["median_us"] and 0 < row["engine_thread_us"] <= row["median_us"] + 1e-3
        assert (row["reader_us"] == 0) == (row["arm"] == "old")
