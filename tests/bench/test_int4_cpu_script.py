"""bench/int4_cpu.py names float32, int8-weight and int4-weight at each group, and times
pipelines' batch-1 decode round by round (two short rounds here)."""

from __future__ import annotations

import pytest

from tessellm import LLM


def test_variants_cover_every_group_and_the_baselines(bench_script):
    names = [name for name, _ in bench_script("int4_cpu.py").variants()]
    assert names[:2] == ["float32", "int8-weight"]
    assert {"int4-weight g32", "int4-weight g64", "int4-weight g128", "int4-weight g32 lm_head"} <= set(names)


@pytest.mark.extended
def test_interleaved_rates_of_two_pipelines(bench_script, cpu_config, tiny_model):
    """Each variant's median rate and, per round, its ratio to the first variant's time."""
    llms = {"float32": LLM(cpu_config(tiny_model("llama"))),
            "int4": LLM(cpu_config(tiny_model("llama"), quant={"name": "int4-weight", "options": {"group_size": 32}}))}
    rates = bench_script("int4_cpu.py").interleaved_rates(llms, rounds=2)
    assert list(rates) == ["float32", "int4"]
    assert all(rate > 0 and len(ratios) == 2 for rate, ratios in rates.values())
    assert rates["float32"][1] == [1.0, 1.0]


def test_prequantized_variants_stack_and_keep_apart(bench_script, tmp_path):
    """--prequantized's two readings of a W4A16 folder: stacked at load, and kept apart."""
    script = bench_script("int4_cpu.py")
    assert [parts.get("stack", True) for _, parts in script.prequantized_variants(str(tmp_path))] == [True, False]
