"""``tessellm ab`` when an arm samples: the chi-square machinery is exact, the comparison keeps
its level on identical synthetic distributions and detects a known shift with the power it
states, and on SmolLM2 two identical samplers pass while min_p 0.1 against plain sampling
fails. Every draw is seeded, so every outcome here is fixed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tessellm.bench.ab import ArmRequest, arm_request, load_arm_configs, parse_request_params, sampled_agreement
from tessellm.bench.distributions import (
    ENDED, binned_counts, chi_square_homogeneity, chi_square_quantile, chi_square_sf, compare_continuations,
    detectable_tv, holm_adjusted, noncentral_chi_square_sf, position_tokens, repeating_prefix_length)
from tessellm.bench.workloads import BenchRequest
from tessellm.cli import main
from tessellm.core.engine.pipeline import Pipeline

# ----------------------------------------------------------------------------- chi-square


def test_chi_square_tail_matches_closed_forms():
    assert chi_square_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-12)
    for x in (0.5, 3.0, 11.0):  # df 2 is an exponential with mean 2
        assert chi_square_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)
    assert chi_square_quantile(0.95, 10) == pytest.approx(18.307038, abs=1e-5)
    assert chi_square_sf(7.0, 0) == 1.0


@pytest.mark.parametrize("df, noncentrality, x", [(1, 0.0, 3.84), (3, 5.0, 8.0), (10, 20.0, 25.0)])
def test_noncentral_tail_matches_numpys_draws(df, noncentrality, x):
    rng = np.random.default_rng(0)
    draws = rng.noncentral_chisquare(df, noncentrality, 200_000) if noncentrality else rng.chisquare(df, 200_000)
    assert noncentral_chi_square_sf(x, df, noncentrality) == pytest.approx((draws > x).mean(), abs=4e-3)


def test_homogeneity_statistic_of_a_2x2_table_by_hand():
    # expected counts: 15 and 15 for A, 15 and 15 for B; each cell is 5 away
    assert chi_square_homogeneity([(20, 10), (10, 20)]) == pytest.approx((4 * 25 / 15, 1))
    assert chi_square_homogeneity([(20, 10)]) == (0.0, 0)


def test_holm_adjustment():
    assert holm_adjusted([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])


def test_bins_pool_rare_tokens_and_favour_no_arm():
    a, b = [1] * 12 + [2] * 3 + [3] * 2, [1] * 6 + [2] * 4 + [4] * 1
    assert binned_counts(a, b) == [(12, 6), (5, 5)]  # 2, 3 and 4 are rare: they share a bin of 10
    assert binned_counts(b, a) == [(6, 12), (5, 5)]
    assert binned_counts([1] * 12 + [2], [1] * 12 + [3]) == [(13, 13)]  # a rest of 2 joins the last bin
    assert position_tokens([[5, 6], [7]], 1) == [6, ENDED]
    # (1, 2) and (1, 9) each begin 12 of 24 continuations; no 3-token prefix begins 10
    assert repeating_prefix_length([[1, 2, 3]] * 8 + [[1, 2, 4]] * 4, [[1, 9, 9]] * 6 + [[1, 9, 8]] * 6) == 2


# ----------------------------------------------------------------------------- synthetic samples


def draw(rng: np.random.Generator, first: np.ndarray, n: int, length: int = 3) -> list[list[int]]:
    """``n`` continuations: the first token from ``first``, each later one the previous plus 0
    or 1 (a dependence between positions, so continuations repeat)."""
    tokens = rng.choice(len(first), size=n, p=first)
    steps = rng.integers(0, 2, size=(n, length - 1))
    return np.concatenate([tokens[:, None], tokens[:, None] + steps.cumsum(1)], axis=1).tolist()


BASE = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])


def test_identical_distributions_are_rejected_at_about_the_level():
    rejected = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        a = [draw(rng, BASE, 64) for _ in range(3)]
        b = [draw(rng, BASE, 64) for _ in range(3)]
        result = compare_continuations(a, b, alpha=0.05)
        assert result.testable and [t.what for t in result.tests if t.df] == [
            "position 1", "position 2", "position 3", "continuation"]
        rejected += result.rejected
    assert rejected <= 4  # 2 expected at alpha 0.05 (Holm keeps the family's level)
    assert result.verdict.startswith("same distribution: not rejected (smallest adjusted p ")


def test_a_known_shift_is_detected_every_time():
    shifted = BASE.copy()
    shifted[0] -= 0.25  # TV 0.25: a quarter of the mass moves from token 0 to token 2
    shifted[2] += 0.25
    for seed in range(10):
        rng = np.random.default_rng(seed)
        result = compare_continuations([draw(rng, BASE, 64) for _ in range(3)],
                                       [draw(rng, shifted, 64) for _ in range(3)], alpha=0.05)
        assert result.rejected and result.p_value < 0.05
        assert result.verdict.startswith(f"differ: rejected at p={result.p_value:.3g} (")


def test_stated_power_holds_for_the_least_detectable_difference():
    # The least detectable difference of TV d: A has (1 + d) times the mass on half of the
    # categories and (1 - d) times on the other half; B the reverse.
    mass, n, prompts = np.full(4, 0.25), 100, 3
    d = detectable_tv(3 * prompts, [(n, n)] * prompts, alpha=0.05, power=0.8)
    assert 0.05 < d < 0.3
    up = mass * np.array([1 + d, 1 + d, 1 - d, 1 - d])
    down = mass * np.array([1 - d, 1 - d, 1 + d, 1 + d])
    assert 0.5 * np.abs(up - down).sum() == pytest.approx(d)
    hits = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        a = [[[int(t)] for t in rng.choice(4, size=n, p=up)] for _ in range(prompts)]
        b = [[[int(t)] for t in rng.choice(4, size=n, p=down)] for _ in range(prompts)]
        result = compare_continuations(a, b, alpha=0.05)  # one position, no continuation test
        assert [t.df for t in result.tests] == [9, 0] and result.tests[0].detectable_tv == pytest.approx(d)
        hits += result.rejected
    assert 0.72 <= hits / 300 <= 0.88


def test_tokens_that_never_repeat_are_untestable():
    a = [[[i, i + 1]] for i in range(0, 200, 2)]
    result = compare_continuations([sum(a, [])], [[[1000 + i, i] for i in range(100)]])
    assert not result.testable and not result.rejected and result.verdict.startswith("untestable")
    assert result.as_dict()["tests"] == [] and result.as_dict()["detectable_tv"] is None


# ----------------------------------------------------------------------------- request parameters


def test_request_params_parse_and_name_their_flag():
    assert parse_request_params(["temperature=1.0,min_p=0.1", "extra_args.alpha=2"], "--params") == {
        "temperature": 1.0, "min_p": 0.1, "extra_args": {"alpha": 2}}
    shared = {"temperature": 1.0, "extra_args": {"alpha": 2}}
    assert parse_request_params(["extra_args.beta=x", "temperature=0.5"], "--b-params", shared) == {
        "temperature": 0.5, "extra_args": {"alpha": 2, "beta": "x"}}
    assert shared == {"temperature": 1.0, "extra_args": {"alpha": 2}}
    for values, words in ((["max_tokens=4"], ["--a-params 'max_tokens=4'", "set by the workload"]),
                          (["min_p=2"], ["--a-params 'min_p=2'", "min_p", "less than or equal to 1"]),
                          (["temprature=1"], ["temprature", "Extra inputs"]), (["top_k"], ["KEY=VALUE"])):
        with pytest.raises(ValueError) as info:
            parse_request_params(values, "--a-params")
        assert all(w in str(info.value) for w in words), str(info.value)


def test_arm_requests_keep_the_workloads_lengths():
    r = BenchRequest("r0", [1, 2, 3], 7, ignore_eos=True)
    sampled = arm_request(r, "r0#a1", {"temperature": 1.0, "min_p": 0.1})
    assert isinstance(sampled, ArmRequest) and sampled.request_id == "r0#a1"
    p = sampled.sampling_params()
    assert (p.max_tokens, p.ignore_eos, p.temperature, p.min_p) == (7, True, 1.0, 0.1)
    assert type(arm_request(r, "r0#b0", {})) is BenchRequest and r.sampling_params().temperature == 0


def test_arms_may_differ_in_request_params_only():
    a, b = load_arm_configs([], params_differ=True)
    assert a == b
    with pytest.raises(ValueError, match="nothing to compare"):
        load_arm_configs([])


# ----------------------------------------------------------------------------- SmolLM2 and the command


@pytest.mark.extended
def test_smollm2_same_sampler_passes_and_min_p_fails(smollm2_llm):
    llm = smollm2_llm
    # min_p 0.1 drops about half of either prompt's next-token mass (TV 0.55 and 0.5)
    prompts = [llm.encode("The weather today is"), llm.encode("My favorite food is")]
    hot = {"temperature": 1.0}
    same = sampled_agreement(llm, llm, prompts, hot, hot, num_samples=96, max_tokens=3)
    assert same.testable and not same.rejected and same.p_value > 0.2, same.as_dict()
    differ = sampled_agreement(llm, llm, prompts, hot, {**hot, "min_p": 0.1}, num_samples=96, max_tokens=3)
    assert differ.rejected and differ.p_value < 1e-6, differ.as_dict()
    assert differ.verdict.startswith("differ: rejected at p=")


@pytest.fixture(scope="module")
def config_file(tiny_model, cpu_config, tmp_path_factory):
    path = tmp_path_factory.mktemp("ab-sampled") / "pipeline.json"
    path.write_text(json.dumps(cpu_config(tiny_model("llama"), max_model_len=256)))
    return path


SMALL = ["--num-requests", "2", "--rounds", "2", "--num-agreement-prompts", "2", "--no-progress",
         "--workload-set", "prompt_median=8", "--workload-set", "prompt_max=16", "--workload-set", "output_median=4",
         "--workload-set", "output_min=2", "--workload-set", "output_max=4"]


def test_cli_reports_the_distribution_test(config_file, capsys):
    argv = ["ab", "--config", str(config_file), "--params", "temperature=1.0,top_k=3", "--b-params", "top_k=1",
            "--num-samples", "48", "--sample-tokens", "3", "--json", *SMALL]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["a"]["request_params"] == {"temperature": 1.0, "top_k": 3}
    assert report["b"]["request_params"] == {"temperature": 1.0, "top_k": 1}
    d = report["distribution"]
    assert (d["prompts"], d["samples_per_arm"], d["max_tokens"], d["alpha"], d["power"]) == (2, 48, 3, 0.05, 0.8)
    assert d["rejected"] and d["verdict"].startswith("differ: rejected at p=") and "chi-square" in d["test"]
    assert 0 < d["detectable_tv"] < 1 and d["tests"][0]["what"] == "position 1"
    assert report["exact_match_rate"] == 1.0  # one pipeline: greedy agreement alone cannot tell samplers apart
    from tessellm.bench.ab import format_ab_report

    text = format_ab_report(report)
    for words in ("request params: A temperature=1.0,top_k=3; B temperature=1.0,top_k=1",
                  "sampled distributions on 2 prompts x 48 continuations x 3 tokens per arm: differ: rejected",
                  "power: 80% to detect a total variation of", "ratio B/A"):
        assert words in text, text


@pytest.mark.extended
def test_cli_identical_sampling_arms_are_not_rejected(config_file, capsys):
    argv = ["ab", "--config", str(config_file), "--a", "dtype=float32", "--b", "dtype=float32",
            "--params", "temperature=1.0,top_k=3", "--num-samples", "48", "--sample-tokens", "3", *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sampled distributions on 2 prompts x 48 continuations x 3 tokens per arm: same distribution: " \
           "not rejected" in out, out


@pytest.mark.parametrize("args, words", [
    (["--params", "max_tokens=3"], ["--params 'max_tokens=3'", "set by the workload"]),
    (["--b-params", "min_p=2"], ["--b-params 'min_p=2'", "min_p"]),
    (["--alpha", "1.5"], ["--alpha", "1.5"]),
    (["--num-samples", "1"], ["--num-samples", "at least 2"]),
    (["--sample-tokens", "0"], ["--sample-tokens", "at least 1"]),
])
def test_cli_errors_are_one_line_before_loading(args, words, config_file, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(Pipeline, "__init__", no_loading)
    assert main(["ab", "--config", str(config_file), "--a", "dtype=float64", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessellm: error: "), err
    assert all(w in err[0] for w in words), err[0]
