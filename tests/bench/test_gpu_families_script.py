"""bench/gpu_families.py, the model zoo's GPU stage: how it judges a divergence (a near-tie of
the reference's two best logits passes, anything else fails), which families it runs (every
declared model type, the ones seen failing first), and a tiny run of one family on the CPU
(its --device cpu rehearsal), a failing variant diagnosed by reruns."""

from __future__ import annotations

import json


def test_a_divergence_passes_only_at_a_near_tie(bench_script):
    families = bench_script("gpu_families.py")
    prompts = [[5], [6], [7]]
    theirs = [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
    ours = [[1, 2, 3], [1, 9, 9], [4, 4, 4]]
    gaps = {(1, 1): 1e-6, (2, 0): 0.3}
    result = families.judge(prompts, ours, theirs, lambda p, at: gaps[(p, at)])
    assert result["equal"] == 1 and not result["ok"]
    assert [(t["prompt"], t["token"]) for t in result["near_ties"]] == [(1, 1)]
    assert [(f["prompt"], f["token"], f["gap"]) for f in result["failures"]] == [(2, 0, 0.3)]
    assert families.judge(prompts[:1], [[1, 2]], [[1, 2, 3]], lambda p, at: 0.0)["failures"][0]["token"] == 2


def test_every_declared_family_runs_the_failing_first(bench_script):
    families = bench_script("gpu_families.py")
    types = families.model_types(None)
    assert types[0] == "gemma2" and "gemma3" not in types
    assert {"llama", "qwen3_moe", "gpt_oss", "deepseek_v2", "gemma", "olmo3", "phi3"} <= set(types)
    assert families.model_types(["phi3", "llama"]) == ["llama", "phi3"]


def test_a_cpu_rehearsal_of_one_family(bench_script, tmp_path, monkeypatch, capsys):
    """llama through base and bf16 on the CPU agrees with transformers; then base with its
    tokens spoiled fails and is rerun with one part of the pipeline changed at a time."""
    families = bench_script("gpu_families.py")
    out = tmp_path / "families.jsonl"
    args = ["--device", "cpu", "--families", "llama", "--prompts", "2", "--tokens", "3", "--vocab", "512",
            "--out", str(out)]
    assert families.main([*args, "--variants", "base,bf16"]) == 0
    base, bf16 = (json.loads(line) for line in out.read_text().splitlines())  # base on every family first
    assert base["base"]["equal"] == 2 and base["base"]["ok"] and bf16["bf16"]["ok"]
    printed = capsys.readouterr().out
    assert "llama: base 2/2" in printed and "llama: bf16 ok" in printed

    run = families.run_llm
    calls = []

    def spoiled(config, prompts, n, **kw):
        tokens, logprobs, facts = run(config, prompts, n, **kw)
        calls.append(config)
        return ([[t + 1 for t in seq] for seq in tokens] if len(calls) == 1 else tokens), logprobs, facts

    monkeypatch.setattr(families, "run_llm", spoiled)
    monkeypatch.setattr(families, "DIAGNOSES", families.DIAGNOSES[:1] + families.DIAGNOSES[-1:])
    assert families.main([*args, "--variants", "base"]) == 1
    record = json.loads(out.read_text().splitlines()[-1])
    assert not record["base"]["ok"] and record["base"]["failures"][0]["token"] == 0
    assert all(record["base"][name] == 2 for name, _ in families.DIAGNOSES)
    assert calls[1]["cuda_graphs"] is False and calls[-1]["attention"]["name"] == "sdpa"
