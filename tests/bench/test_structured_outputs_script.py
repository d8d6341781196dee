"""bench/structured_outputs.py runs on a tiny model and reports what it claims: both sides on
the same requests with the same output lengths, interleaved, their ratio, the grammar's host
cost and the schema's compile times."""

from __future__ import annotations

import json

import pytest

SMALL_MIXED = ["prompt_median=12", "prompt_max=32", "output_median=6", "output_min=4", "output_max=10"]


@pytest.fixture(scope="module")
def script(bench_script):
    return bench_script("structured_outputs.py")


@pytest.mark.extended
def test_smoke_reports_both_sides_the_ratio_and_the_grammar_cost(script, tiny_model, tmp_path, capsys):
    pytest.importorskip("xgrammar")
    out = tmp_path / "so.json"
    args = ["--model", str(tiny_model("llama")), "--set", "device=cpu", "--set", "dtype=float32",
            "--num-requests", "3", "--repeats", "2", "--json", str(out)]
    for kv in SMALL_MIXED:
        args += ["--workload-set", kv]
    assert script.main(args) == 0
    report = json.loads(out.read_text())
    u, c = report["unconstrained"], report["constrained"]
    assert report["order"] == ["UC", "CU"] and report["workload"]["name"] == "mixed"
    assert report["device"].startswith("cpu") and report["command"].startswith("python bench/structured_outputs.py")
    assert [len(s["tokens_per_s"]["per_run"]) for s in (u, c)] == [2, 2]
    assert report["ratio"] == pytest.approx(c["tokens_per_s"]["median"] / u["tokens_per_s"]["median"], rel=1e-3)
    # minItems past half the longest output: no constrained output completes early
    assert report["lengths_match"] and u["mean_output_tokens"] == c["mean_output_tokens"] > 0
    assert c["finish_reasons"] == {"length": 6}
    assert report["min_items"] == report["schema"]["properties"]["items"]["minItems"]
    assert c["grammar_ms_per_step_median"]["fill"] > 0 and c["grammar_ms_per_step_median"]["accept"] > 0
    assert u["grammar_ms_per_step_median"]["total"] == 0
    assert report["compile"]["first_ms"] > report["compile"]["cached_us"] / 1e3 > 0
    assert report["constrained_outputs"]["sample"].lstrip().startswith("{")
    assert "ratio constrained / unconstrained" in capsys.readouterr().out


def test_output_check_tells_valid_from_broken(script):
    good = json.dumps({"items": [{"name": "a", "qty": 1}, {"name": "b", "qty": 2}]})
    assert script.check_output(good, 2) == "valid"
    assert script.check_output(good, 3) == "off schema"
    assert script.check_output(good[:-1], 1) == "not JSON"
    assert script.check_output(json.dumps({"items": [{"name": "a", "qty": 1.5}]}), 1) == "off schema"
