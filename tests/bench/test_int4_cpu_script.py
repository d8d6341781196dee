"""bench/int4_cpu.py names float32, int8-weight and int4-weight at each group, and times a
pipeline's batch-1 decode (one short run here)."""

from __future__ import annotations

from tessellm import LLM


def test_variants_cover_every_group_and_the_baselines(bench_script):
    names = [name for name, _ in bench_script("int4_cpu.py").variants()]
    assert names[:2] == ["float32", "int8-weight"]
    assert {"int4-weight g32", "int4-weight g64", "int4-weight g128", "int4-weight g32 lm_head"} <= set(names)


def test_decode_rate_of_an_int4_pipeline(bench_script, cpu_config, tiny_model):
    llm = LLM(cpu_config(tiny_model("llama"), quant={"name": "int4-weight", "options": {"group_size": 32}}))
    assert bench_script("int4_cpu.py").decode_tok_s(llm, repeats=1) > 0
