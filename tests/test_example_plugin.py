"""The documented example plugin (examples/tessellm-plugin-example) works as docs/plugins.md
says: it loads through a real entry point and serves a pipeline, giving sdpa's tokens, and it
imports nothing but the plugin API (``tessellm`` and its testing kit)."""

from __future__ import annotations

from pathlib import Path

from tessellm import LLM
from tessellm.core import registry as registry_module
from tessellm.core.registry import PluginRegistry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tessellm-plugin-example"


def test_example_plugin_through_its_entry_point(monkeypatch, install_plugin_folder, tiny_model, cpu_config):
    dist = install_plugin_folder(EXAMPLE)
    registry = PluginRegistry()
    assert registry.failures == []
    entry = registry.get("attention", "example-logging")
    assert entry is not None and entry.package == dist == "tessellm-plugin-example"
    monkeypatch.setattr(registry_module, "_default", registry)

    folder = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = {"max_tokens": 5, "ignore_eos": True}
    example = LLM(cpu_config(folder, dtype="float64", attention={"name": "example-logging"}))
    reference = LLM(cpu_config(folder, dtype="float64", attention={"name": "sdpa"}))
    assert [o.token_ids for o in example.generate(prompts, params)] == \
        [o.token_ids for o in reference.generate(prompts, params)]
    assert example.pipeline.attention.layer_calls > 0


def test_example_imports_only_the_plugin_api(plugin_api_imports):
    assert plugin_api_imports(EXAMPLE) == []


def test_the_tutorial_shows_the_example_as_it_is():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    for path in ("pyproject.toml", "tessellm_plugin_example/attention.py", "tests/test_example_logging.py"):
        assert (EXAMPLE / path).read_text().rstrip() in docs, f"docs/plugins.md shows an old {path}"
