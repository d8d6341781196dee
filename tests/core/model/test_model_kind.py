"""Selecting a model plugin: auto by the checkpoint's model_type and priority, by name from
the config's architecture section, and the one-line errors for a wrong name, a plugin that
does not build the checkpoint's type, and a plugin that breaks its contract."""

from __future__ import annotations

import pytest
import torch

import tessellm
from tessellm import LLM
from tessellm.core.errors import ConfigError, PluginCallError
from tessellm.core.registry import PluginRegistry
from tessellm.plugins.model.llama import LlamaArchitecture


class FasterLlama(LlamaArchitecture):
    """A third party's Llama, preferred under auto by its priority."""

    name = "faster-llama"
    api_version = "1.6"
    auto_priority = 5


class NamedOnlyLlama(LlamaArchitecture):
    name = "named-llama"
    api_version = "1.6"
    auto_priority = None


class SpecNotASpec(LlamaArchitecture):
    name = "spec-not-a-spec"
    api_version = "1.6"
    auto_priority = None

    def spec(self, hf_config):
        return {"layers": 2}


class BuildsNothing(LlamaArchitecture):
    name = "builds-nothing"
    api_version = "1.6"
    auto_priority = None

    def build(self, spec):
        return None


class LeavesABuffer(LlamaArchitecture):
    name = "leaves-a-buffer"
    api_version = "1.6"
    auto_priority = None

    def build(self, spec):
        model = super().build(spec)
        model.register_buffer("table", torch.empty(4), persistent=False)
        return model


@tessellm.hookimpl
def register_model(register):
    for cls in (FasterLlama, NamedOnlyLlama, SpecNotASpec, BuildsNothing, LeavesABuffer):
        register(cls)


def test_auto_takes_the_highest_priority_plugin_for_the_model_type(authors_plugins, tiny_model, cpu_config):
    llm = LLM(cpu_config(tiny_model("llama")))
    assert llm.pipeline.spec.architecture == "faster-llama"
    assert authors_plugins.model_types()["llama"][0] == "faster-llama"


def test_a_named_plugin_is_used_and_gives_the_same_tokens(authors_plugins, tiny_model, cpu_config):
    folder = tiny_model("llama")
    named = LLM(cpu_config(folder, architecture={"name": "named-llama"}, decoding={"name": "greedy"}))
    assert named.pipeline.spec.architecture == "named-llama"
    builtin = LLM(cpu_config(folder, architecture={"name": "llama"}, decoding={"name": "greedy"}))
    params = {"max_tokens": 6, "ignore_eos": True}
    assert named.generate([[5, 6, 7]], params)[0].token_ids == builtin.generate([[5, 6, 7]], params)[0].token_ids


def test_naming_errors_are_one_line_config_errors(tiny_model, cpu_config):
    folder = tiny_model("llama")
    with pytest.raises(ConfigError, match=r"architecture.name: unknown model plugin 'lama' \(did you mean 'llama'\?\)"):
        LLM(cpu_config(folder, architecture={"name": "lama"}))
    with pytest.raises(ConfigError, match="model plugin 'mixtral' builds model types mixtral, not this checkpoint's "
                                          "'llama'"):
        LLM(cpu_config(folder, architecture={"name": "mixtral"}))
    with pytest.raises(ConfigError, match="architecture.options: invalid for model plugin 'llama'"):
        LLM(cpu_config(folder, architecture={"name": "llama", "options": {"fast": True}}))


@pytest.mark.parametrize("name, message", [
    ("spec-not-a-spec", "spec returned dict, not a tessellm ModelSpec"),
    ("builds-nothing", "build returned NoneType, not a torch.nn.Module"),
    ("leaves-a-buffer", "left buffers without values after loading: table"),
])
def test_a_plugin_breaking_its_contract_is_named(authors_plugins, tiny_model, cpu_config, name, message):
    with pytest.raises(PluginCallError, match=f"model plugin '{name}'.*{message}"):
        LLM(cpu_config(tiny_model("llama"), architecture={"name": name}))


def test_a_model_type_no_plugin_builds_names_the_supported_ones(tmp_path, monkeypatch):
    """Without the transformers plugin (which takes any type), an undeclared type is refused."""
    from transformers import GPT2Config

    from tessellm.core.errors import ModelLoadError

    monkeypatch.setenv("TESSELLM_DISABLE_PLUGINS", "model.transformers")
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported; supported: .*qwen3_moe.*"
                                             "tessellm new-plugin model NAME"):
        PluginRegistry().architecture_for(GPT2Config())


def test_stacked_and_per_expert_names_give_one_state(tmp_path):
    from tessellm.core.model.moe import unstack_experts

    gate_up, down = torch.randn(3, 8, 4), torch.randn(3, 4, 4)
    state = unstack_experts({"model.layers.0.mlp.experts.gate_up_proj": gate_up,
                             "model.layers.0.mlp.experts.down_proj": down, "x": torch.ones(1)})
    assert set(state) == {"x"} | {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(3)
                                  for p in ("gate", "up", "down")}
    assert torch.equal(state["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 4:])
    assert torch.equal(state["model.layers.0.mlp.experts.2.down_proj.weight"], down[2])


def test_moe_models_decode_eagerly_on_cuda(tmp_path):
    """An MoE block reads each expert's token count on the host, which a CUDA graph cannot
    replay: the runner says so instead of capturing."""
    from tessellm.core.model.runner import ModelRunner
    from tessellm.testing.models import build_tiny

    moe = LLM({"model": str(build_tiny("mixtral", tmp_path / "m")), "device": "cpu"})
    runner = moe.pipeline.runner
    assert "mixture-of-experts" in moe.pipeline.model.cuda_graphs_unsupported()
    on_cuda = ModelRunner(runner.model, runner.spec, runner.backend, runner.cache, torch.device("cuda"))
    backend = type("GraphBackend", (), {"supports_cuda_graphs": True, "name": "g"})()
    on_cuda.backend = backend
    on_cuda.cache = type("Cache", (), {"scratch_block": 0, "name": "c"})()
    assert "mixture-of-experts" in on_cuda.graphs_unsupported()


def test_a_model_plugin_without_build_does_not_load():
    class Half(tessellm.ModelArchitecture):
        name = "half"
        api_version = "1.6"
        model_types = ("half",)

        def spec(self, hf_config):
            return tessellm.decoder_spec(hf_config)

    @tessellm.hookimpl
    def register_model(register):
        register(Half)

    registry = PluginRegistry(entry_points=False)
    registry.add_module(type("M", (), {"register_model": staticmethod(register_model)})(), package="half-pkg")
    assert registry.get("model", "half") is None
    assert "model plugin 'half': it does not implement build (required of every model plugin)" in \
        str(registry.failures[0])
