"""bench/stream_detokenize.py runs at small sizes and reports what it claims: both ways (the
old engine-thread detokenizing and the new reader-side one) per output length, with and
without a stop string, their streamed texts equal to the decoded output (the script asserts
it), and the new way's engine-thread part a share of its step."""

from __future__ import annotations

import json

import pytest



@pytest.fixture(scope="module")
def script(bench_script):
    return bench_script("stream_detokenize.py")


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
