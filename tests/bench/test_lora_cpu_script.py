"""bench/lora_cpu.py times both forms of the torch LoRA kernel and the base projection at each
row count, and one decode forward without and with adapters (a tiny run here)."""

from __future__ import annotations

import pytest

from tessellm.testing.lora import build_tiny_lora


def test_projection_timings_name_every_form(bench_script):
    rows = bench_script("lora_cpu.py").projection_rows(slots=2, rank=4, k=24, n=40, rows_list=[3, 17], repeats=2)
    assert [r["rows"] for r in rows] == [3, 17]
    assert all(r[key] > 0 for r in rows for key in ("base_us", "stacked_us", "grouped_us"))


@pytest.mark.extended
def test_decode_forward_runs_with_and_without_adapters(bench_script, smollm2_dir, tmp_path):
    build_tiny_lora(smollm2_dir, tmp_path / "a", rank=2, target_modules=("q_proj",), std=0.01)
    result = bench_script("lora_cpu.py").decode_forward(tmp_path, seqs=2, repeats=1)
    assert result["adapters"] == ["a"] and result["seqs"] == 2
    assert result["base_ms"] > 0 and result["lora_ms"] > 0
