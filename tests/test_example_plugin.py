"""The documented example plugin (examples/tessellm-plugin-example) works as docs/plugins.md
says: it loads through a real entry point and serves a pipeline, giving sdpa's tokens."""

from __future__ import annotations

import sys
from pathlib import Path

from tessellm import LLM
from tessellm.core import registry as registry_module
from tessellm.core.registry import PluginRegistry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tessellm-plugin-example"


def test_example_plugin_through_its_entry_point(tmp_path, monkeypatch, tiny_model, cpu_config):
    dist = tmp_path / "tessellm_plugin_example-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tessellm-plugin-example\nVersion: 0.1.0\n")
    project = tomllib.loads(EXAMPLE.joinpath("pyproject.toml").read_text())["project"]
    lines = [f"{name} = {target}" for name, target in project["entry-points"]["tessellm"].items()]
    (dist / "entry_points.txt").write_text("[tessellm]\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    registry = PluginRegistry()
    assert registry.failures == []
    entry = registry.get("attention", "example-logging")
    assert entry is not None and entry.package == "tessellm-plugin-example"
    monkeypatch.setattr(registry_module, "_default", registry)

    folder = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = {"max_tokens": 5, "ignore_eos": True}
    example = LLM(cpu_config(folder, dtype="float64", attention={"name": "example-logging"}))
    reference = LLM(cpu_config(folder, dtype="float64", attention={"name": "sdpa"}))
    assert [o.token_ids for o in example.generate(prompts, params)] == \
        [o.token_ids for o in reference.generate(prompts, params)]
    assert example.pipeline.attention.layer_calls > 0
