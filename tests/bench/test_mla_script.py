"""bench/mla.py runs at tiny shapes (--smoke, CPU) and reports what it claims: both MLA forms
timed and in agreement, the whole-model runs' throughput, and a wrong fast path flagged."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import torch



@pytest.fixture(scope="module")
def mla_script(bench_script):
    return bench_script("mla.py")


def run(mla_script, tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    status = mla_script.main([*args, "--smoke", "--json", str(out)])
    return status, json.loads(out.read_text())


def assert_described(report: dict, part: str) -> None:
    assert report["command"].startswith("python bench/mla.py") and f"--part {part}" in report["command"]
    assert datetime.fromisoformat(report["date"]).utcoffset().total_seconds() == 0
    assert report["device"].startswith("cpu") and report["torch"] == torch.__version__
    assert report["part"] == part and report["smoke"] is True


def test_attention_smoke_times_both_forms_and_they_agree(mla_script, tmp_path, capsys):
    status, report = run(mla_script, tmp_path, "--part", "attention", "--reps", "2")
    assert status == 0
    assert_described(report, "attention")
    assert report["dtype"] == "float32" and report["shape"]["latent_dim"] == 48
    assert [(p["batch"], p["context"]) for p in report["points"]] == [(1, 64), (2, 64)]
    for p in report["points"]:
        assert p["naive_ms"] > 0 and p["absorbed_ms"] > 0
        assert abs(p["speedup"] - p["naive_ms"] / p["absorbed_ms"]) <= 0.01 * p["speedup"] + 0.01
        assert p["agree"] is True
        assert p["absorbed_max_abs_diff"] < 1e-4 and p["reference_max_abs_diff"] < 1e-4
        assert p["max_abs_out"] > 0.01  # the outputs compared are not all zero
    table = capsys.readouterr().out
    assert "naive_ms" in table and "absorbed_ms" in table and "MISMATCH" not in table


def test_attention_smoke_flags_a_wrong_fast_path(mla_script, tmp_path, monkeypatch, capsys):
    from tessellm.plugins.attention.mla import backend

    right = backend.absorbed_attention
    monkeypatch.setattr(backend, "absorbed_attention", lambda *a: right(*a) * 1.01)
    status, report = run(mla_script, tmp_path, "--part", "attention", "--batches", "1", "--reps", "1")
    assert status == 1
    point, = report["points"]
    assert point["agree"] is False and point["absorbed_max_abs_diff"] > 1e-3
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.extended
def test_model_smoke_reports_throughput_per_batch(mla_script, tmp_path, capsys):
    status, report = run(mla_script, tmp_path, "--part", "model")
    assert status == 0
    assert_described(report, "model")
    assert report["pipeline"]["attention"]["name"] == "mla" and report["resolved"]["attention"]["name"] == "mla"
    assert report["shapes"]["num_hidden_layers"] == 2 and report["parameters"] > 0
    assert [r["batch"] for r in report["runs"]] == [1, 2]
    for r in report["runs"]:
        assert r["output_tokens_per_s"] > 0 and r["tpot_ms_mean"] > 0 and r["new_tokens"] == 8
    assert "output_tokens_per_s" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the whole-model run is allowed")
def test_model_without_a_gpu_is_refused_unless_smoke(mla_script, capsys):
    with pytest.raises(SystemExit) as exc:
        mla_script.main(["--part", "model"])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_v2_lite_shapes_match_its_published_config(mla_script):
    spec = mla_script.model_spec(mla_script.V2_LITE)
    assert (spec.num_heads, spec.num_layers, spec.hidden_size, spec.vocab_size) == (16, 27, 2048, 102400)
    assert (spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, spec.mla.qk_nope_head_dim, spec.mla.v_head_dim,
            spec.mla.q_lora_rank, spec.mla.latent_dim) == (512, 64, 128, 128, None, 576)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.num_shared_experts, spec.moe.intermediate_size,
            spec.moe.first_dense_layers) == (64, 6, 2, 1408, 1)
    assert spec.rope_type == "yarn" and spec.attention_scale > 192 ** -0.5  # YaRN's mscale_all_dim
