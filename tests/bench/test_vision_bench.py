"""``tessellm bench --workload vision`` on a tiny random Qwen2-VL: the report holds both sides'
throughput, the per-round ratios and the agreement (equal greedy tokens); arguments it does not
take are refused before a model loads; bench/vision_vs_hf.py runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessellm.cli import main
from tessellm.testing.models import build_tiny_qwen2_vl

SCRIPT = Path(__file__).parents[2] / "bench" / "vision_vs_hf.py"


@pytest.mark.extended  # two models loaded; the default set checks the arguments
def test_the_report_compares_with_transformers(tmp_path, capsys):
    folder = build_tiny_qwen2_vl(tmp_path / "qwen2_vl")
    argv = ["bench", "--workload", "vision", "--set", f"model={folder}", "--set", "dtype=float32", "--set",
            "device=cpu", "--num-requests", "3", "--workload-set", "rounds=2", "--workload-set", "max_tokens=3",
            "--workload-set", "images_per_request=2", "--workload-set", "batch_size=2", "--json", "--no-progress"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_requests"] == 3 and report["num_images"] == 6 and report["output_tokens"] == 9
    assert len(report["ratio_per_round"]) == 2 and report["tessellm_requests_per_s"] > 0
    assert report["transformers_output_tokens_per_s"] > 0 and report["device"].startswith("cpu")
    assert report["agreement"] == {"requests_with_equal_greedy_tokens": 3, "of": 3}


@pytest.mark.parametrize("extra,words", [(["--serve", "http://x"], "--serve does not apply"),
                                         (["--workload-set", "nope=1"], "has no parameter 'nope'"),
                                         (["--workload-set", "rounds=0"], "rounds")])
def test_arguments_it_does_not_take_are_refused(capsys, extra, words):
    assert main(["bench", "--workload", "vision", *extra]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.extended
def test_the_script_runs_at_small_sizes():
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["agreement"]["requests_with_equal_greedy_tokens"] == report["agreement"]["of"] == 3
