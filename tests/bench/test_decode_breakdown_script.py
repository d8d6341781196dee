"""bench/decode_breakdown.py's stand-ins replace attributes that exist (a rename would make
the probe time the wrong thing), and its int4 timer restores the layer's forward."""

from __future__ import annotations

import pytest

from tessellm import LLM


def test_every_stand_in_replaces_an_existing_attribute(bench_script):
    stages = bench_script("decode_breakdown.py").replacements()
    assert len(stages) == 6
    assert all(callable(getattr(owner, attr)) for _, owner, attr, _ in stages)


@pytest.mark.extended
def test_the_int4_timer_reports_a_share_and_restores_forward(bench_script, cpu_config, tiny_model):
    from tessellm.plugins.quant.int4.linear import Int4WeightLinear

    forward = Int4WeightLinear.forward
    llm = LLM(cpu_config(tiny_model("llama"), quant={"name": "int4-weight", "options": {"group_size": 32}}))
    total, inside = bench_script("decode_breakdown.py").timed_int4(llm, repeats=1)
    assert 0 < inside < total and Int4WeightLinear.forward is forward
