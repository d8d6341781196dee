"""A tiny random DeepSeek-V2 checkpoint through every app by config alone: `tessellm
generate`, `tessellm bench` (the latent cache's bytes per token beside plain multi-head
attention's), `tessellm ab` between the naive and absorbed MLA forms (greedy outputs agree),
and `tessellm serve` answering the openai client with the offline tokens."""

from __future__ import annotations

import json

import pytest

from tessellm import LLM
from tessellm.cli import main
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.serve.app import build_app
from tessellm.testing.models import TINY_DEEPSEEK, build_tiny_deepseek
from tessellm.testing.serving import serving

PROMPTS = ["t5 t17 t300 t42", "t9 t9 t9", "t100 t200 t300 t400 t500 t11"]
SMALL_MIXED = ["--workload-set", "prompt_median=12", "--workload-set", "prompt_max=40",
               "--workload-set", "output_median=6", "--workload-set", "output_min=2",
               "--workload-set", "output_max=10"]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """A pipeline config naming a tiny DeepSeek-V2 folder, the mla backend and the paged cache."""
    root = tmp_path_factory.mktemp("deepseek-apps")
    folder = build_tiny_deepseek(root / "model", 2, vocab_size=512)
    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "max_model_len": 256,
              "attention": {"name": "mla"}, "cache": {"name": "paged", "options": {"block_size": 8}},
              "scheduler": {"name": "continuous"}}
    path = root / "pipeline.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def offline(config_file):
    llm = LLM(json.loads(config_file.read_text()))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return llm, [o.outputs[0].text for o in outs]


def test_generate_cli(config_file, offline, capsys):
    argv = ["generate", "--config", str(config_file), "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
            "--json", *PROMPTS]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["text"] for r in records] == offline[1]


def test_bench_reports_latent_bytes_beside_mha(config_file, capsys):
    assert main(["bench", "--config", str(config_file), "--num-requests", "4", *SMALL_MIXED, "--json",
                 "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    shapes = TINY_DEEPSEEK[2]
    layers, heads = shapes["num_hidden_layers"], shapes["num_attention_heads"]
    latent = shapes["kv_lora_rank"] + shapes["qk_rope_head_dim"]
    qk = shapes["qk_nope_head_dim"] + shapes["qk_rope_head_dim"]
    assert report["kv_bytes_per_token"] == layers * latent * 4
    assert report["mha_kv_bytes_per_token"] == layers * heads * (qk + shapes["v_head_dim"]) * 4
    assert report["pipeline"]["attention"]["name"] == "mla" and report["total_output_tokens"] > 0


def test_ab_naive_against_absorbed_agrees(config_file, capsys):
    argv = ["ab", "--config", str(config_file), "--a", "attention.options.form=naive",
            "--b", "attention.options.form=absorbed", "--num-requests", "3", *SMALL_MIXED, "--rounds", "2",
            "--num-agreement-prompts", "3", "--json", "--no-progress"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["a"]["config"]["attention"]["options"]["form"] == "naive"
    assert report["b"]["config"]["attention"]["options"]["form"] == "absorbed"
    assert report["exact_match_rate"] == 1.0 and report["divergences"] == []


def test_serve_answers_the_openai_client_with_offline_tokens(offline):
    from openai import OpenAI

    llm, texts = offline
    with serving(build_app(llm, model_name="tiny-deepseek", api_key=None, max_request_bytes=64 * 1024)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for prompt, text in zip(PROMPTS, texts):
            out = client.completions.create(model="tiny-deepseek", prompt=prompt, max_tokens=8, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == text
