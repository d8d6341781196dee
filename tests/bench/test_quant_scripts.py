"""The quantized-kernel benchmarks run at tiny shapes on the CPU (--smoke) and report what they
claim: bench/quant_kernels.py times each kernel against bf16's linear and writes a table the
quantizers read; bench/quant_e2e.py runs each variant's pipeline with its ratios to bf16."""

from __future__ import annotations

import json

import pytest
import torch

from tessellm.plugins.quant.kernel_table import read_table

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke checks the CPU code path")


def test_quant_kernels_smoke_times_each_kernel_and_writes_a_table(bench_script, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    script = bench_script("quant_kernels.py")
    out, table = tmp_path / "points.json", tmp_path / "table.json"
    assert script.main(["--smoke", "--quantizers", "int8-weight,w8a8", "--out", str(out), "--table", str(table)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python bench/quant_kernels.py") and report["device"].startswith("cpu")
    timed = [p for p in report["points"] if "us" in p]
    assert {(p["quantizer"], p["kernel"]) for p in timed} == {
        ("int8-weight", k) for k in ("triton", "int8pack", "tiled")} | {
        ("w8a8", k) for k in ("int_mm", "triton", "triton_weight_only")}  # compiled ones: not in --smoke
    assert all(p["us"] > 0 and p["bf16_us"] > 0 and p["speedup"] >= 0 and p["rows"] in (1, 3) for p in timed)
    written = read_table(table)  # the quantizers' own reader takes it
    assert written["measured"] is True and set(written["kernels"]) == {"int8-weight", "w8a8"}
    for shapes in written["kernels"].values():
        assert set(shapes) == {"48x128", "64x96"}
        for steps in shapes.values():
            assert steps[-1][0] == 3 and all(a[1] != b[1] for a, b in zip(steps, steps[1:]))  # neighbours merged


def test_the_table_keeps_the_fastest_kernel_per_row_count(bench_script):
    script = bench_script("quant_kernels.py")
    points = [{"quantizer": "fp8", "n": 8, "k": 16, "rows": r, "kernel": k, "us": us}
              for r, k, us in [(1, "compiled", 1.0), (1, "scaled_mm", 2.0), (16, "compiled", 3.0), (16, "triton", 2.5),
                               (64, "scaled_mm", 1.0), (64, "triton", 4.0), (256, "scaled_mm", 1.0)]]
    points.append({"quantizer": "fp8", "n": 8, "k": 16, "rows": 1024, "kernel": "triton", "error": "x"})
    table = script.build_table(points, "dev", "cmd")
    assert table["kernels"] == {"fp8": {"8x16": [[1, "compiled"], [16, "triton"], [256, "scaled_mm"]]}}


@pytest.mark.extended  # five pipelines built on the CPU: about a minute and a half
def test_quant_e2e_smoke_runs_each_variant_against_bf16(bench_script, tmp_path):
    script = bench_script("quant_e2e.py")
    out = tmp_path / "e2e.json"
    assert script.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    decode, batch = report["decode"]["tiny"], report["batch256"]["tiny"]
    assert set(decode) == {"bf16", "int8-weight", "w4a16"} and set(batch) == {"bf16", "w8a8"}
    for result in decode.values():
        assert "error" not in result, result
        assert result["tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0 and result["vs_bf16"] > 0
    assert decode["bf16"]["vs_bf16"] == 1.0 and decode["w4a16"]["kernels"] == {"Int4WeightLinear": "auto"}
    assert batch["w8a8"]["decode_tokens_per_s"] > 0 and batch["w8a8"]["batch"] == 3
