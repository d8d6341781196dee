"""``tessellm ab``: the paired bootstrap interval is exact and deterministic, output agreement
tells identical pipelines from different models, and the command reports every figure (JSON,
text, plot) and rejects bad arguments in one line before loading a model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tessellm.bench.ab import bootstrap_ratio_ci, load_arm_configs, output_agreement, split_overrides
from tessellm.cli import main
from tessellm.core.engine.pipeline import Pipeline

SMALL_MIXED = ["--workload-set", "prompt_median=16", "--workload-set", "prompt_max=48",
               "--workload-set", "output_median=6", "--workload-set", "output_min=2",
               "--workload-set", "output_max=12"]


# ----------------------------------------------------------------------------- the bootstrap


def test_bootstrap_of_identical_rounds_is_exactly_one():
    a = [100.0, 97.5, 103.2, 99.9, 101.1]
    assert bootstrap_ratio_ci(a, list(a), seed=3) == (1.0, 1.0)


@pytest.mark.parametrize("flip", [lambda n: n[::-1], lambda n: -n])
def test_bootstrap_of_symmetric_noise_around_equal_means_contains_one(flip):
    noise = np.random.default_rng(7).normal(0.0, 5.0, 10)
    noise -= noise.mean()  # both arms have mean 100 exactly
    low, high = bootstrap_ratio_ci(100 + noise, 100 + flip(noise), seed=0)
    assert low < 1 < high


def test_bootstrap_of_b_twice_as_fast_excludes_one():
    rng = np.random.default_rng(11)
    a = 100 + rng.normal(0, 10, 8)  # rounds drift, and B is about 2x A in every one of them
    b = 2 * a * (1 + rng.normal(0, 0.02, 8))
    low, high = bootstrap_ratio_ci(a, b, seed=0)
    assert 1.95 < low <= b.mean() / a.mean() <= high < 2.05


def test_bootstrap_is_deterministic_per_seed_and_checks_its_input():
    rng = np.random.default_rng(5)
    a, b = 100 + rng.normal(0, 5, 6), 100 + rng.normal(0, 5, 6)
    assert bootstrap_ratio_ci(a, b, seed=4) == bootstrap_ratio_ci(a, b, seed=4)
    assert bootstrap_ratio_ci(a, b, seed=4) != bootstrap_ratio_ci(a, b, seed=5)
    for bad in (([1.0, 2.0], [1.0]), ([], []), ([0.0, 1.0], [1.0, 1.0])):
        with pytest.raises(ValueError):
            bootstrap_ratio_ci(*bad)


# ----------------------------------------------------------------------------- arms and agreement


def test_split_overrides_keeps_commas_inside_values():
    assert split_overrides(["attention.name=sdpa,dtype=float32", "x.options.sizes=[1, 2],seed=3", "y=1"]) == [
        "attention.name=sdpa", "dtype=float32", "x.options.sizes=[1, 2]", "seed=3", "y=1"]


@pytest.fixture(scope="module")
def config_file(tiny_model, cpu_config, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ab") / "pipeline.json"
    path.write_text(json.dumps(cpu_config(tiny_model("llama"), dtype="float64", max_model_len=256)))
    return path


def test_arm_configs_are_the_base_with_each_arms_overrides(config_file):
    a, b = load_arm_configs([], base=str(config_file), shared=["max_model_len=128"],
                            a=["attention.name=sdpa,seed=4"], b=["attention.name=cascade", "dtype=float32"])
    assert (a.attention.name, a.seed, a.dtype, a.max_model_len) == ("sdpa", 4, "float64", 128)
    assert (b.attention.name, b.seed, b.dtype, b.max_model_len) == ("cascade", 0, "float32", 128)


@pytest.fixture(scope="module")
def tiny_llms(tiny_model, cpu_config):
    from tessellm import LLM

    return {arch: LLM(cpu_config(tiny_model(arch), dtype="float64", max_model_len=256)) for arch in ("llama", "qwen2")}


PROMPTS = [[100 + i, 2000 + 7 * i, 3000, 45 + i, 9000 - i] for i in range(3)]


def test_agreement_of_a_pipeline_with_itself_is_exact(tiny_llms):
    agree = output_agreement(tiny_llms["llama"], tiny_llms["llama"], PROMPTS, max_tokens=6)
    assert agree.exact_match_rate == 1.0 and agree.mean_kl == 0.0 and agree.max_kl == 0.0
    assert agree.first_divergence == {} and (agree.num_prompts, agree.max_tokens) == (3, 6)


def test_agreement_of_different_models_is_their_kl(tiny_llms):
    a, b = tiny_llms["llama"], tiny_llms["qwen2"]  # both use SmolLM2's tokenizer and vocabulary
    agree = output_agreement(a, b, PROMPTS, max_tokens=6)
    assert agree.exact_match_rate < 1 and 0 < agree.mean_kl <= agree.max_kl
    assert set(agree.first_divergence) and all(0 <= j < 6 for j in agree.first_divergence.values())
    # reference: KL(P_A || P_B) by torch, on the prompt plus A's greedy output
    kls = []
    for prompt in PROMPTS:
        out = a.generate([prompt], {"max_tokens": 6, "ignore_eos": True}, progress=False)[0].token_ids
        ids = prompt + out[:-1]
        la, lb = (llm.engine.score(ids)[len(prompt) - 1:].double().log_softmax(-1) for llm in (a, b))
        kls.append(torch.nn.functional.kl_div(lb, la, log_target=True, reduction="none").sum(-1))
    kl = torch.cat(kls)
    assert kl.shape == (18,)
    assert agree.mean_kl == pytest.approx(float(kl.mean()), rel=1e-9)
    assert agree.max_kl == pytest.approx(float(kl.max()), rel=1e-9)


# ----------------------------------------------------------------------------- the command

ARM_KEYS = {"config", "kv_cache_slots", "output_tokens_per_s", "ttft_ms", "tpot_ms", "e2e_ms"}
KEYS = {"a", "b", "ratio", "ratio_ci95", "exact_match_rate", "mean_kl", "max_kl", "divergences", "agreement",
        "rounds", "order", "workload", "device", "date", "command", "python", "torch"}


def test_cli_identical_arms_agree_exactly(config_file, tmp_path, capsys):
    plot = tmp_path / "ab.png"
    argv = ["ab", "--config", str(config_file), "--set", "max_model_len=256", "--a", "dtype=float64",
            "--b", "dtype=float64", "--num-requests", "4", *SMALL_MIXED, "--rounds", "3",
            "--num-agreement-prompts", "3", "--seed", "1", "--json", "--plot", str(plot)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert KEYS <= report.keys()
    for arm in ("a", "b"):
        side = report[arm]
        assert ARM_KEYS <= side.keys()
        assert len(side["output_tokens_per_s"]["per_round"]) == 3 and side["output_tokens_per_s"]["mean"] > 0
        assert set(side["ttft_ms"]) == {"mean", "p50", "p90", "p99"} and side["ttft_ms"]["p50"] > 0
        assert side["config"]["dtype"] == "float64" and side["config"]["max_model_len"] == 256
    assert report["a"]["config"] == report["b"]["config"]
    assert report["exact_match_rate"] == 1.0 and report["mean_kl"] < 1e-12 and report["divergences"] == []
    low, high = report["ratio_ci95"]
    assert report["ratio"] > 0 and 0 < low <= high
    assert report["rounds"] == 3 and report["order"] == ["AB", "BA", "AB"]
    assert report["agreement"] == {"prompts": 3, "max_tokens": 32}
    assert report["workload"]["num_requests"] == 4 and report["workload"]["seed"] == 1
    assert report["command"].startswith("tessellm ab --config")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_two_config_files_text_report(tiny_model, cpu_config, tmp_path, capsys):
    a = cpu_config(tiny_model("llama"), dtype="float64", max_model_len=256)
    b = {**a, "cache": {"name": "paged", "options": {"num_blocks": 64}}, "scheduler": {"name": "continuous"}}
    (tmp_path / "a.yaml").write_text(json.dumps(a))  # JSON is YAML
    (tmp_path / "b.yaml").write_text(json.dumps(b))
    argv = ["ab", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), "--num-requests", "3", *SMALL_MIXED,
            "--rounds", "2", "--num-agreement-prompts", "2", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tessellm ab: workload mixed (3 requests, seed 0), 2 interleaved rounds" in out
    assert "cache.name: contiguous -> paged" in out and "scheduler.name: static -> continuous" in out
    for text in ("output tokens/s mean", "tpot_ms p99", "A per round", "ratio B/A", "95% CI",
                 "agreement on 2 prompts x 32 greedy tokens"):
        assert text in out


@pytest.mark.parametrize("args, words", [
    (["{tmp}/a.json", "{tmp}/a.json", "--a", "dtype=float32"], ["two config files", "not both"]),
    (["{tmp}/a.json"], ["exactly two", "got 1"]),
    ([], ["nothing to compare", "--a"]),
    (["--a", "dtype=float32", "--rounds", "1"], ["--rounds", "at least 2", "got 1"]),
    (["--a", "atention.name=sdpa"], ["--a 'atention.name=sdpa'", "unknown field 'atention'"]),
    (["--a", "dtype=float32,cache.options.blok=2"], ["arm A", "blok"]),
    (["--b", "dtype=float65"], ["arm B", "dtype", "float65"]),
    (["--b", "attention.name=flashy"], ["arm B", "attention.name", "flashy"]),
    (["--b", "seed", "--a", "dtype=float32"], ["--b 'seed'", "KEY=VALUE"]),
    (["--a", "dtype=float32", "--num-requests", "0"], ["--num-requests", "0"]),
    (["--a", "dtype=float32", "--plot", "ab.svg"], ["ab.svg", "PNG"]),
    (["--a", "dtype=float32", "--workload", "chatty"], ["'chatty'", "mixed, shared-prefix"]),
])
def test_cli_errors_are_one_line_exit_2_before_loading(args, words, config_file, tmp_path, capsys, monkeypatch):
    (tmp_path / "a.json").write_text(config_file.read_text())

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(Pipeline, "__init__", no_loading)
    base = [] if args and args[0].startswith("{tmp}") else ["--config", str(config_file)]
    assert main(["ab", *base, *[a.format(tmp=tmp_path) for a in args]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessellm: error: "), err
    assert all(w in err[0] for w in words), err[0]
