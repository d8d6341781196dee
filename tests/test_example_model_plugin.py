"""A third party's model plugin (examples/tessellm-model-example: Toyformer, an architecture
no built-in serves, with its own transformers implementation) loads through its entry point,
is listed with the model type it builds, passes the model conformance suite
(``tessellm plugins --check model:toyformer``), and serves `tessellm generate` by config alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessellm.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tessellm-model-example"


@pytest.fixture
def toyformer(install_example):
    """The example installed as a distribution, in the registry pipelines use."""
    return install_example(EXAMPLE)


def test_listed_with_its_model_type_and_conformant(toyformer, capsys):
    dist, registry = toyformer
    entry = registry.get("model", "toyformer")
    assert entry is not None and entry.package == dist == "tessellm-model-example"
    assert registry.model_types()["toyformer"] == ["toyformer"]
    assert main(["plugins"]) == 0
    assert "model.toyformer" in capsys.readouterr().out
    assert main(["plugins", "--check", "model:toyformer", "--examples", "2"]) == 0
    table = capsys.readouterr().out
    assert "model plugin 'toyformer' passes" in table
    for prop in ("prefill_logits", "greedy_tokens", "arrivals_and_prefix_hits", "chunked_prefill_and_preemption",
                 "ngram_speculative"):
        assert prop in table


def test_generate_gives_the_reference_tokens(toyformer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessellm.testing.models import build_tiny

    folder = build_tiny("toyformer", tmp_path / "toy", num_hidden_layers=3, num_key_value_heads=1)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "toyformer"
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = "t5 t37 t300 t42"
    ids = AutoTokenizer.from_pretrained(folder)(prompt)["input_ids"]
    assert ids == [5, 37, 300, 42]
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    argv = ["generate", "--set", f"model={folder}", "--set", "device=cpu", "--max-tokens", "6", "--temperature", "0",
            "--ignore-eos", "--json", prompt]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["token_ids"] == ids[4:]


def test_example_imports_only_the_plugin_api(plugin_api_imports):
    assert plugin_api_imports(EXAMPLE) == []
