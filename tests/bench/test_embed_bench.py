"""``tessellm bench --workload embed`` on a tiny embedding model and a tiny reranker: the report
holds both sides' throughput, the per-round ratios and the agreement (equal outputs), and
arguments it does not take are refused before a model loads; bench/embed_vs_st.py runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessellm.bench.embed import EmbedParams, embed_texts
from tessellm.cli import main
from tessellm.core.errors import ConfigError
from tessellm.testing.embedding import build_sentence_transformer, build_tiny_encoder

SCRIPT = Path(__file__).parents[2] / "bench" / "embed_vs_st.py"
ARGS = ["--num-requests", "4", "--workload-set", "rounds=2", "--workload-set", "length_median=8", "--json",
        "--no-progress", "--set", "dtype=float32", "--set", "device=cpu"]


@pytest.mark.parametrize("head", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_the_report_compares_with_sentence_transformers(tmp_path, capsys, head):
    folder = build_tiny_encoder("bert", tmp_path / "base", head=head)
    if not head:
        folder = build_sentence_transformer(folder, tmp_path / "st", pooling="mean")
    assert main(["bench", "--workload", "embed", "--set", f"model={folder}", *ARGS]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["task"] == ("score" if head else "embed") and report["num_texts"] == 4
    assert len(report["ratio_per_round"]) == 2 and report["tessellm_texts_per_s"] > 0
    assert report["sentence-transformers_tokens_per_s"] > 0 and report["device"].startswith("cpu")
    agreement = report["agreement"]
    assert agreement.get("min_cosine", 1.0) >= 0.9999 and agreement.get("max_abs_score_difference", 0.0) < 1e-5


@pytest.mark.parametrize("extra,words", [(["--serve", "http://x"], "--serve does not apply"),
                                         (["--workload-set", "nope=1"], "has no parameter 'nope'"),
                                         (["--workload-set", "rounds=0"], "rounds"),
                                         (["--workload-set", "length_min=50", "--workload-set", "length_max=10"],
                                          "length_min (50) is above length_max (10)")])
def test_arguments_it_does_not_take_are_refused(capsys, extra, words):
    assert main(["bench", "--workload", "embed", *extra]) == 2
    assert words in capsys.readouterr().err


def test_texts_that_cannot_fit_the_model_say_which_parameter_to_lower():
    with pytest.raises(ConfigError, match=r"length_min \(20\) does not fit under the model's 24 tokens"):
        embed_texts(EmbedParams(length_min=20), tokenizer=None, seed=0, num_texts=3, max_len=24)


@pytest.mark.extended
def test_the_script_runs_at_small_sizes():
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout)["agreement"]["min_cosine"] >= 0.9999
