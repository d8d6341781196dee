"""A GPT-NeoX model plugin as a third party meets it: a model plugin written from the
docs alone (examples/tessellm-gptneox-example: LayerNorm with bias, parallel residual, partial
rotary, a plain GELU MLP, a per-head fused qkv) passes ``tessellm plugins --check`` against
transformers' own GPTNeoXForCausalLM with nothing of tessellm's internals touched; transformers'
default GPT-NeoX shapes (hidden 6144, 44 layers) are capped generically; shapes that would not
fit stop in one line before anything is allocated; and ``tessellm generate`` serves a
checkpoint with the plugin named in its summary line."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

from tessellm.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tessellm-gptneox-example"


@pytest.fixture
def gpt_neox(install_example):
    """The example installed as a distribution, in the registry pipelines use."""
    return install_example(EXAMPLE)[1]


@pytest.mark.extended
def test_check_passes_with_the_plugins_tiny_config(gpt_neox, capsys):
    assert gpt_neox.model_types()["gpt_neox"] == ["gpt-neox"]
    assert main(["plugins", "--check", "model:gpt-neox", "--examples", "2"]) == 0
    table = capsys.readouterr().out
    assert "model plugin 'gpt-neox' passes" in table, table
    for prop in ("spec_and_weights", "prefill_logits", "greedy_tokens", "arrivals_and_prefix_hits",
                 "chunked_prefill_and_preemption", "ngram_speculative"):
        assert f"{prop}" in table


def test_transformers_default_shapes_are_capped_generically():
    """A model type tessellm has no tiny shapes for gets transformers' defaults with every size
    capped: GPT-NeoX's 6144-wide, 44-layer default becomes a model of under a million parameters."""
    from transformers import AutoConfig

    from tessellm.testing.models import TINY_SHAPES, count_parameters, tiny_fields

    assert "gpt_neox" not in TINY_SHAPES
    fields = tiny_fields("gpt_neox")
    assert {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                   "max_position_embeddings", "vocab_size")} == {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "max_position_embeddings": 512, "vocab_size": 512}
    assert count_parameters(AutoConfig.for_model("gpt_neox", **fields)) < 1_000_000


def test_shapes_over_the_memory_limit_stop_in_one_line_before_allocating(gpt_neox, capsys):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    huge = json.dumps({"hidden_size": 6144, "num_attention_heads": 64, "intermediate_size": 24576,
                       "num_hidden_layers": 44})
    assert main(["plugins", "--check", "model:gpt-neox", "--shapes", huge]) == 1
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1, out
    assert out.startswith("model plugin 'gpt-neox' cannot be checked: the tiny gpt_neox checkpoint would have "), out
    assert "over its 2 GiB limit" in out and "--shapes" in out and "tiny_config" in out
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    assert grown < 1 << 20, f"the refused check grew the process by {grown} KiB"


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "[1]"], "--shapes must be a JSON object"),
    (["--shapes", '{"gpt_neox": {"hidden_size": 64}, "num_hidden_layers": 2}'], "not both"),
])
def test_bad_shapes_are_one_line(gpt_neox, capsys, argv, message):
    assert main(["plugins", "--check", "model:gpt-neox", *argv]) == 2
    assert message in capsys.readouterr().err


def test_shapes_are_for_the_model_suite_only(capsys):
    assert main(["plugins", "--check", "routing:round-robin", "--shapes", "{}"]) == 2
    assert "--shapes sets the tiny checkpoints of the model suite" in capsys.readouterr().err


@pytest.mark.parametrize("shapes", [
    {"use_parallel_residual": True, "num_hidden_layers": 2},
    pytest.param({"use_parallel_residual": False, "num_hidden_layers": 3, "attention_bias": False,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
                 marks=pytest.mark.extended),
], ids=["parallel", "sequential-half-rotary"])
def test_generate_gives_transformers_tokens_and_names_the_model_plugin(gpt_neox, tmp_path, capsys, shapes):
    from transformers import AutoModelForCausalLM

    from tessellm.testing.models import build_tiny

    folder = build_tiny("gpt_neox", tmp_path / "neox", **shapes)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ids = [5, 37, 300, 42]
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    argv = ["generate", "--set", f"model={folder}", "--set", "device=cpu", "--set", "dtype=float64",
            "--max-tokens", "6", "--ignore-eos", "--json", "t5 t37 t300 t42"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["token_ids"] == ids[4:]
    assert "(cpu, float64, model gpt-neox, attention " in captured.err, captured.err


def test_example_imports_only_the_plugin_api(plugin_api_imports):
    assert plugin_api_imports(EXAMPLE) == []
