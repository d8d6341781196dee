"""The new built-in architectures through the apps by config alone. A tiny random Qwen2-MoE
(softmax top-4 routing, a shared expert behind a sigmoid gate, dense and sparse layers) through
every app: `tessellm generate`, `tessellm bench`, `tessellm ab` between the sdpa and cascade
attention backends (greedy outputs agree), `tessellm eval ppl` on a text of its words, and
`tessellm serve` answering the openai client with the offline tokens. Then Qwen3, Qwen3-MoE and
Mixtral: `tessellm generate --set model=FOLDER` gives transformers' greedy tokens."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from tessellm import LLM
from tessellm.cli import main
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.serve.app import build_app
from tessellm.testing.models import build_tiny
from tessellm.testing.serving import serving

PROMPTS = ["t5 t17 t300 t42", "t9 t9 t9", "t400 t233 t101 t45 t500 t64"]
WORDS = list(range(3, 512))
SMALL_MIXED = ["--workload-set", "prompt_median=12", "--workload-set", "prompt_max=40",
               "--workload-set", "output_median=6", "--workload-set", "output_min=2",
               "--workload-set", "output_max=10"]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """A pipeline config naming a tiny Qwen2-MoE folder, sdpa, the paged cache and continuous
    batching."""
    root = tmp_path_factory.mktemp("qwen2-moe-apps")
    folder = build_tiny("qwen2_moe", root / "model", vocab_size=512)
    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "max_model_len": 256,
              "attention": {"name": "sdpa"}, "cache": {"name": "paged", "options": {"block_size": 8}},
              "scheduler": {"name": "continuous"}}
    path = root / "pipeline.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def offline(config_file):
    llm = LLM(json.loads(config_file.read_text()))
    assert llm.pipeline.spec.architecture == "qwen2-moe" and llm.pipeline.spec.moe.shared_gate
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return llm, [o.outputs[0].text for o in outs], [o.token_ids for o in outs]


def test_generate_cli(config_file, offline, capsys):
    argv = ["generate", "--config", str(config_file), "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
            "--json", *PROMPTS]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["token_ids"] for r in records] == offline[2]
    assert [r["text"] for r in records] == offline[1]


def test_bench_runs_a_mixed_workload(config_file, capsys):
    assert main(["bench", "--config", str(config_file), "--num-requests", "4", *SMALL_MIXED, "--json",
                 "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pipeline"]["architecture"] == "qwen2-moe"
    assert report["num_requests"] == 4 and report["total_output_tokens"] > 0


def test_ab_sdpa_against_cascade_agrees(config_file, capsys, monkeypatch):
    """A shared-prefix workload (3 questions after one 24-token system prompt) and cascade's
    threshold lowered to 8 tokens, so its shared-prefix path runs (counted)."""
    from tessellm.plugins.attention import cascade

    cascades = []
    attend = cascade._Cascade.attend
    monkeypatch.setattr(cascade._Cascade, "attend", lambda self, *a: cascades.append(1) or attend(self, *a))
    argv = ["ab", "--config", str(config_file), "--a", "attention.name=sdpa",
            "--b", "attention.name=cascade,attention.options.min_shared_tokens=8", "--workload", "shared-prefix",
            "--workload-set", "prefix_len=24", "--workload-set", "question_len=4", "--workload-set",
            "question_spread=1", "--workload-set", "output_len=4", "--num-requests", "3", "--rounds", "2",
            "--num-agreement-prompts", "3", "--json", "--no-progress"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["a"]["config"]["attention"]["name"] == "sdpa"
    assert report["b"]["config"]["attention"]["name"] == "cascade"
    assert report["exact_match_rate"] == 1.0 and report["divergences"] == [] and cascades


def test_eval_perplexity_of_a_text_of_its_words(config_file, offline, tmp_path, capsys):
    """The word-level tokenizer reads only t0..t511 (any other word is t0), so the text is
    seeded random words of the vocabulary (from WORDS); one window, whose perplexity the
    offline engine's scores give directly."""
    llm = offline[0]
    rng = random.Random(0)
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"t{rng.choice(WORDS)}" for _ in range(120)))
    assert main(["eval", "ppl", "--config", str(config_file), "--text", str(text), "--window", "128", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ids = llm.tokenizer(text.read_text())["input_ids"]
    assert result["text_tokens"] == len(ids) == 120 and result["tokens_scored"] == 119
    logprobs = llm.engine.score(ids)[:-1].double().log_softmax(-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert result["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
    assert 1.0 < result["perplexity"] < 10 * 512  # a random model: near, or above, the vocabulary size


def test_serve_answers_the_openai_client_with_offline_tokens(offline):
    from openai import OpenAI

    llm, texts, _ = offline
    with serving(build_app(llm, model_name="tiny-qwen2-moe", api_key=None, max_request_bytes=64 * 1024)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for prompt, text in zip(PROMPTS, texts):
            out = client.completions.create(model="tiny-qwen2-moe", prompt=prompt, max_tokens=8, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == text


# ---------------------------------------------------------------- the other new families


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "mixtral"])
def test_generate_by_model_folder_gives_transformers_greedy_tokens(model_type, tmp_path, capsys):
    """The embedded config with the folder as its model (on the CPU, in float32), against
    transformers' own generate; its experts the eager loop, not the grouped kernels."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny(model_type, tmp_path / model_type, vocab_size=512)
    assert main(["generate", "--set", f"model={folder}", "--set", "device=cpu", "--set", "dtype=float32",
                 "--max-tokens", "8", "--json", *PROMPTS]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for prompt, record in zip(PROMPTS, records):
        encoded = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**encoded, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert record["prompt_tokens"] == encoded["input_ids"].shape[1]
        assert record["token_ids"] == out[0, encoded["input_ids"].shape[1]:].tolist(), (model_type, prompt)
