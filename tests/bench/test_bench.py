"""``tessellm bench``: workloads are deterministic and shaped as documented, JSONL files are
parsed or rejected with their line number, and the command reports every figure, with the
transformers baseline and a plot, on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tessellm.bench.offline import run_offline
from tessellm.bench.workloads import get_workload, make_workload, plain_token_ids
from tessellm.cli import main
from tessellm.core.errors import ConfigError, InvalidRequestError
from tessellm.core.model.loader import load_tokenizer

SMALL_MIXED = ["--workload-set", "prompt_median=16", "--workload-set", "prompt_max=48",
               "--workload-set", "output_median=6", "--workload-set", "output_min=2",
               "--workload-set", "output_max=12"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model("llama"))


@pytest.fixture(scope="module")
def config_file(tiny_model, cpu_config, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "pipeline.json"
    path.write_text(json.dumps(cpu_config(tiny_model("llama"), max_model_len=256)))
    return path


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("name, overrides", [("mixed", {}), ("shared-prefix", {"prefix_len": 64}),
                                             ("scoring", {"shot_len": 20}),
                                             ("multi-turn", {"system_len": 20, "reply_len": 8})])
def test_workload_is_deterministic_per_seed(name, overrides, tokenizer):
    def draw(seed):
        return make_workload(name, seed=seed, num_requests=20, tokenizer=tokenizer, max_model_len=2048, **overrides)

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_mixed_is_long_tailed_and_clipped(tokenizer):
    requests = make_workload("mixed", seed=0, num_requests=500, tokenizer=tokenizer, max_model_len=4096)
    prompts = np.array([len(r.prompt_token_ids) for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert 70 <= np.median(prompts) <= 140 and 45 <= np.median(outputs) <= 90
    assert np.percentile(prompts, 99) > 4 * np.median(prompts)
    assert np.percentile(outputs, 99) > 3 * np.median(outputs)
    assert prompts.min() >= 8 and prompts.max() <= 1024 and outputs.min() >= 8 and outputs.max() <= 512
    allowed = set(plain_token_ids(tokenizer).tolist())
    assert all(set(r.prompt_token_ids) <= allowed for r in requests)  # no EOS or chat markers
    assert len({r.request_id for r in requests}) == 500

    tight = make_workload("mixed", seed=0, num_requests=500, tokenizer=tokenizer, max_model_len=256)
    assert max(len(r.prompt_token_ids) + r.output_len for r in tight) <= 256
    assert min(r.output_len for r in tight) >= 8


def test_scoring_requests_share_the_shots_and_each_question_its_choices(tokenizer):
    requests = make_workload("scoring", seed=2, num_requests=8, tokenizer=tokenizer, max_model_len=512, shots=3,
                             shot_len=50, question_len=20, choices=4, choice_len=5)
    assert [len(r.prompt_token_ids) for r in requests] == [3 * 50 + 20 + 5] * 8
    assert all(r.output_len == 1 for r in requests)  # scoring: one token each
    shots = requests[0].prompt_token_ids[:150]
    assert all(r.prompt_token_ids[:150] == shots for r in requests)
    questions = [tuple(r.prompt_token_ids[150:170]) for r in requests]
    assert questions[:4] == [questions[0]] * 4 and questions[4:] == [questions[4]] * 4 and questions[0] != questions[4]
    with pytest.raises(ConfigError, match="scoring: .* exceed max_model_len"):
        make_workload("scoring", seed=0, num_requests=2, tokenizer=tokenizer, max_model_len=256)


def test_shared_prefix_requests_share_exactly_their_group_prefix(tokenizer):
    requests = make_workload("shared-prefix", seed=1, num_requests=12, tokenizer=tokenizer, max_model_len=256,
                             num_groups=3, prefix_len=40, question_len=10, question_spread=4, output_len=5)
    for i, a in enumerate(requests):
        assert 40 + 6 <= len(a.prompt_token_ids) <= 40 + 14 and a.output_len == 5
        for j, b in enumerate(requests[:i]):
            shared = _common_prefix(a.prompt_token_ids, b.prompt_token_ids)
            assert shared == (40 if i % 3 == j % 3 else 0), (i, j)  # groups interleave: request i is group i % 3


def test_shared_prefix_over_the_window_says_what_to_lower(tokenizer):
    with pytest.raises(ConfigError, match=r"prefix_len \(1024\).*max_model_len \(256\).*prefix_len="):
        make_workload("shared-prefix", num_requests=2, tokenizer=tokenizer, max_model_len=256)


@pytest.mark.parametrize("name, overrides, words", [
    ("sharegpt", [], ["'sharegpt'", "mixed, shared-prefix", ".jsonl"]),
    ("mixed", ["prefix_len=4"], ["prefix_len", "prompt_median", "output_max"]),
    ("mixed", ["prompt_median=lots"], ["prompt_median", "lots"]),
    ("mixed", ["prompt_min=50", "prompt_max=10"], ["prompt_min", "prompt_max"]),
    ("shared-prefix", ["prefix_len"], ["KEY=VALUE"]),
    ("/no/such/requests.jsonl", [], ["/no/such/requests.jsonl", "does not exist"]),
])
def test_bad_workload_is_a_config_error(name, overrides, words):
    with pytest.raises(ConfigError) as info:
        get_workload(name, overrides)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_jsonl_text_token_and_chat_prompts(tokenizer, tmp_path):
    path = tmp_path / "requests.jsonl"
    lines = [{"prompt": "Hello there"}, {"prompt_token_ids": [5, 6, 7], "max_tokens": 3}, {},
             {"prompt": "Hi", "chat": True, "max_tokens": 4}]
    path.write_text("\n".join("" if not obj else json.dumps(obj) for obj in lines) + "\n")
    requests = make_workload(path, tokenizer=tokenizer, max_model_len=256, max_tokens=9)
    assert requests[1].prompt_token_ids == [5, 6, 7]
    assert requests[0].prompt_token_ids == tokenizer("Hello there")["input_ids"]
    assert requests[2].prompt_token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert [r.output_len for r in requests] == [9, 3, 4]
    assert all(r.ignore_eos and r.sampling_params().ignore_eos for r in requests)
    assert [r.request_id for r in requests] == ["requests.jsonl:1", "requests.jsonl:2", "requests.jsonl:4"]
    assert len(make_workload(path, num_requests=2, tokenizer=tokenizer, max_model_len=256)) == 2
    with pytest.raises(InvalidRequestError, match="holds 3 requests, fewer than the 5"):
        make_workload(path, num_requests=5, tokenizer=tokenizer, max_model_len=256)


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "ok"', ["not valid JSON"]),
    ('["a list"]', ["JSON object"]),
    ('{"prompt": "hi", "max_token": 5}', ["'max_token'", "prompt_token_ids"]),
    ('{"prompt": "hi", "prompt_token_ids": [1]}', ["exactly one"]),
    ('{"prompt_token_ids": [1, 99999999]}', ["99999999"]),
    ('{"prompt_token_ids": [1], "chat": true}', ["chat"]),
    ('{"prompt": "hi", "max_tokens": 0}', ["max_tokens", "0"]),
    ('{"prompt": "hi", "max_tokens": 500}', ["max_model_len (256)"]),
    ('{"prompt": "hi", "ignore_eos": "no"}', ["ignore_eos", "true or false"]),
])
def test_bad_jsonl_line_names_file_and_line(line, words, tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(InvalidRequestError) as info:
        make_workload(path, tokenizer=tokenizer, max_model_len=256)
    message = str(info.value)
    assert "\n" not in message and "bad.jsonl" in message and "line 3" in message, message
    assert all(w in message for w in words), message


# ----------------------------------------------------------------------------- the offline run


def test_multi_turn_prompts_carry_the_whole_conversation(tokenizer):
    requests = make_workload("multi-turn", num_requests=7, tokenizer=tokenizer, max_model_len=256, turns=3,
                             system_len=16, user_len=4, reply_len=5, output_len=2)
    assert len(requests) == 6 and [r.turn for r in requests] == [0, 1, 2] * 2  # 7 // 3 conversations
    for c in range(2):
        turns = requests[3 * c:3 * c + 3]
        assert [len(r.prompt_token_ids) for r in turns] == [20, 29, 38]
        for earlier, later in zip(turns, turns[1:]):
            assert later.prompt_token_ids[:len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
    assert _common_prefix(requests[0].prompt_token_ids, requests[3].prompt_token_ids) == 0
    with pytest.raises(ConfigError, match="multi-turn: .* exceed max_model_len"):
        make_workload("multi-turn", num_requests=4, tokenizer=tokenizer, max_model_len=64, turns=4)


def test_run_offline_runs_turn_after_turn_and_later_turns_hit(tiny_model, cpu_config, tokenizer):
    from tessellm import LLM

    llm = LLM(cpu_config(tiny_model("llama"), max_model_len=256,
                         cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 128}},
                         scheduler={"name": "continuous"}))
    requests = make_workload("multi-turn", num_requests=6, tokenizer=tokenizer, max_model_len=256, turns=3,
                             system_len=24, user_len=4, reply_len=4, output_len=3)
    result = run_offline(llm, requests)
    assert [t.output_tokens for t in result.requests] == [3] * 6
    assert result.prefix_hit_rate > 0.4 and result.kv_tiers == {}  # each later turn finds the earlier one


def test_run_offline_times_every_request_and_aborts_on_error(tiny_model, cpu_config, tokenizer):
    from tessellm import LLM

    llm = LLM(cpu_config(tiny_model("llama"), max_model_len=256))
    requests = make_workload("mixed", num_requests=5, tokenizer=tokenizer, max_model_len=256, prompt_max=32,
                             output_min=1, output_max=6)
    result = run_offline(llm, requests)
    assert [t.output_tokens for t in result.requests] == [r.output_len for r in requests]
    for t in result.requests:
        assert 0 < t.ttft_s <= t.e2e_s <= result.elapsed_s
        assert (t.tpot_s is None) == (t.output_tokens == 1)
    assert llm.engine.stats.generated_tokens == sum(r.output_len for r in requests)  # warm-up not counted

    calls = []

    def failing_step():
        calls.append(1)
        raise RuntimeError("boom")

    llm.engine.step = failing_step
    with pytest.raises(RuntimeError, match="boom"):
        run_offline(llm, requests, warmup=False)
    assert calls and not llm.engine.requests and not llm.engine.has_unfinished()


# ----------------------------------------------------------------------------- the command

METRICS = {"ttft_ms", "tpot_ms", "e2e_ms"}
KEYS = {"output_tokens_per_s", "requests_per_s", *METRICS, "kv_waste", "prefix_hit_rate", "peak_kv_blocks",
        "peak_running", "preemptions", "num_requests", "total_prompt_tokens", "total_output_tokens", "elapsed_s",
        "workload", "pipeline", "device", "date", "command"}


@pytest.mark.extended
def test_cli_json_with_baseline_and_plot(config_file, tmp_path, capsys):
    plot = tmp_path / "out.png"
    argv = ["bench", "--config", str(config_file), "--set", "max_model_len=256", "--num-requests", "6",
            *SMALL_MIXED, "--seed", "2", "--json", "--baseline", "hf", "--baseline-batch-size", "4",
            "--plot", str(plot)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert KEYS <= report.keys() and {"baseline", "speedup"} <= report.keys()
    for side in (report, report["baseline"]):
        for key in METRICS:
            assert set(side[key]) == {"mean", "p50", "p90", "p99"} and side[key]["p50"] > 0
        assert side["num_requests"] == 6 and side["output_tokens_per_s"] > 0
    assert report["total_output_tokens"] == report["baseline"]["total_output_tokens"]
    assert report["baseline"]["kv_waste"] is None and report["baseline"]["batch_size"] == 4
    assert isinstance(report["speedup"], float) and report["speedup"] > 0
    assert report["workload"] == {"name": "mixed", "path": None, "seed": 2, "num_requests": 6,
                                  "params": {**report["workload"]["params"], "prompt_median": 16}}
    assert report["pipeline"]["max_model_len"] == 256 and report["pipeline"]["cache"]["name"] == "contiguous"
    assert 0 <= report["kv_waste"] <= 1 and report["peak_running"] >= 1 and report["preemptions"] == 0
    assert report["command"].startswith("tessellm bench --config")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_table_for_shared_prefix(config_file, capsys):
    argv = ["bench", "--config", str(config_file), "--workload", "shared-prefix", "--num-requests", "4",
            "--workload-set", "prefix_len=24", "--workload-set", "output_len=3", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tessellm bench: workload shared-prefix (4 requests, seed 0)" in out
    for row in ("output_tokens_per_s", "ttft_ms p99", "prefix_hit_rate", "peak_kv_blocks"):
        assert row in out


@pytest.mark.extended
def test_cli_plain_baseline_measures_speculative_decoding(config_file, tmp_path, capsys):
    """--baseline plain reruns the requests with plain decoding: speedup, acceptance and
    tokens per forward are reported, and greedy outputs are identical; requests may stop at EOS."""
    path = tmp_path / "repeat.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_token_ids": [17, 230, 4242] * (i + 2), "max_tokens": 12 + i,
                                           "ignore_eos": False}) for i in range(4)) + "\n")
    argv = ["bench", "--config", str(config_file), "--workload", str(path), "--json", "--baseline", "plain",
            "--set", "decoding.name=speculative", "--set", "decoding.options.k=3"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pipeline"]["decoding"]["name"] == "speculative"
    assert report["baseline"]["name"] == "plain" and report["baseline"]["decoding"] == "sample"
    assert report["identical_outputs"] == 1.0 and report["speedup"] > 0
    assert report["draft_tokens"] > 0 and 0 <= report["acceptance_rate"] <= 1 and report["tokens_per_forward"] >= 1
    assert report["baseline"]["draft_tokens"] == 0 and report["baseline"]["tokens_per_forward"] == 1.0
    assert report["total_output_tokens"] == report["baseline"]["total_output_tokens"]
    assert main(argv[:-4] + ["--baseline", "hf", "--no-progress"]) == 2
    assert "stop at EOS" in capsys.readouterr().err


@pytest.mark.parametrize("args, words", [
    (["--workload", "chatty"], ["'chatty'", "mixed, shared-prefix"]),
    (["--workload", "{tmp}/missing.jsonl"], ["missing.jsonl", "does not exist"]),
    (["--workload", "{tmp}/broken.jsonl"], ["broken.jsonl", "line 2", "not valid JSON"]),
    (["--num-requests", "0"], ["--num-requests", "0"]),
    (["--seed", "-1"], ["seed", "-1"]),
    (["--plot", "figure.svg"], ["figure.svg", "PNG"]),
    (["--workload-set", "prefix_len=8"], ["prefix_len", "allowed", "prompt_median"]),
])
def test_cli_errors_are_one_line_exit_2(args, words, config_file, tmp_path, capsys):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "fine"}\n{"prompt": \n')
    argv = ["bench", "--config", str(config_file), "--no-progress", *[a.format(tmp=tmp_path) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessellm: error: "), err
    assert all(w in err[0] for w in words), err[0]
