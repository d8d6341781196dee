"""Validate-then-select: ``resolve(config, registry, model_spec)`` checks every name and
option against the registry, picks ``auto`` plugins by priority among those that can serve,
and never falls back from a plugin the config names explicitly.

The model is a ModelSpec built from a small transformers LlamaConfig (no weights). Throwaway
plugins live in registries built with ``PluginRegistry(entry_points=False, modules=[...])``.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
import transformers

import tessellm
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.config import PipelineConfig
from tessellm.core.errors import ConfigError
from tessellm.core.model.spec import ModelSpec
from tessellm.core.interfaces.quantizer import Quantizer
from tessellm.core.registry import LoadFailure, PluginRegistry
from tessellm.core.resolve import ORDER, ResolvedPipeline, resolve
from tessellm.plugins.attention.sdpa import SdpaAttention
from tessellm.plugins.cache.contiguous import ContiguousCache, _physical_memory

BUILTIN_MODULES = ["attention.sdpa", "cache.contiguous", "scheduler.static", "decoding.greedy",
                   "decoding.sample", "quant.none"]
MAX_POS = 256


def tiny_spec(**overrides) -> ModelSpec:
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS)
    sizes.update(overrides)
    return ModelSpec.from_hf_config(transformers.LlamaConfig(**sizes))


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return tiny_spec()


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    """The reference plugins only (a fixed list, so plugins added to the project later do
    not change what ``auto`` picks here)."""
    return registry_with()


def config(**fields) -> PipelineConfig:
    return PipelineConfig.model_validate({"device": "cpu", **fields})


def plugin_module(name: str, **classes) -> types.ModuleType:
    """A module-like object whose register_<kind> hooks register ``classes[kind]`` (a list)."""
    module = types.ModuleType(name)
    for kind, cls_list in classes.items():
        def hook(register, cls_list=cls_list):
            for cls in cls_list:
                register(cls)

        hook.__name__ = f"register_{kind}"
        setattr(module, hook.__name__, tessellm.hookimpl(hook))
    return module


def registry_with(*extra: types.ModuleType) -> PluginRegistry:
    """The built-in plugins plus ``extra`` throwaway modules, without reading entry points."""
    builtins = [importlib.import_module(f"tessellm.plugins.{m}") for m in BUILTIN_MODULES]
    reg = PluginRegistry(entry_points=False, modules=[*builtins, *extra])
    assert reg.failures == [], reg.failures
    return reg


def names(resolved: ResolvedPipeline) -> dict[str, str]:
    return {kind: choice.entry.name for kind, choice in resolved.choices.items()}


def error_of(cfg: PipelineConfig, reg: PluginRegistry, model: ModelSpec) -> str:
    with pytest.raises(ConfigError) as info:
        resolve(cfg, reg, model)
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


# ---------------------------------------------------------------------------- throwaway plugins


class LatentCache(ContiguousCache):
    """A cache storing one compressed vector per token (MLA-style)."""

    name = "latentcache"
    api_version = "1.0"
    auto_priority = None

    @classmethod
    def kv_layout(cls, options, ctx) -> KVLayout:
        return KVLayout("latent", ctx.max_model_len, ctx.dtype)


class EagerLatentCache(LatentCache):
    """The latent cache, taking part in auto selection ahead of contiguous."""

    name = "eagerlatent"
    api_version = "1.0"
    auto_priority = 100


class LatentAttention(SdpaAttention):
    """An attention backend that also reads the latent format; ranked below sdpa."""

    name = "mla"
    api_version = "1.0"
    auto_priority = 1
    cache_formats = frozenset({"kv", "latent"})


class OddHeadAttention(SdpaAttention):
    """Reads kv only, and only head dim 999."""

    name = "oddhead"
    api_version = "1.0"
    auto_priority = 5
    head_dims = frozenset({999})


class CudaOnlyAttention(SdpaAttention):
    name = "cudaonly"
    api_version = "1.0"
    auto_priority = 100
    devices = frozenset({"cuda"})


class CudaOnlyCache(ContiguousCache):
    name = "cudacache"
    api_version = "1.0"
    auto_priority = None
    devices = frozenset({"cuda"})


def ranked_attention(name: str, priority: int | None):
    return type(f"Attention_{name}", (SdpaAttention,), {"name": name, "api_version": "1.0",
                                                         "auto_priority": priority})


# ---------------------------------------------------------------------------- defaults


def test_default_config_resolves_on_cpu(registry, spec):
    resolved = resolve(config(), registry, spec)
    assert isinstance(resolved, ResolvedPipeline)
    assert list(resolved.choices) == [k for k in ORDER if k not in ("grammar", "lora", "pooling")]  # optional ones
    assert names(resolved) == {"quant": "none", "cache": "contiguous", "attention": "sdpa",
                               "scheduler": "static", "decoding": "sample"}
    assert resolved.device == torch.device("cpu")
    assert resolved.dtype == torch.float32  # auto on cpu
    assert resolved.max_model_len == MAX_POS  # default: the model's max_position_embeddings
    assert resolved.kv_layout == KVLayout("kv", MAX_POS, torch.float32)
    assert resolved.choices["cache"].options.max_seqs == 8  # the option's default
    summary = resolved.summary()
    assert summary["device"] == "cpu" and summary["dtype"] == "float32"
    assert summary["decoding"]["name"] == "sample" and summary["cache"]["options"] == {"max_seqs": 8}
    assert summary["async_scheduling"] is False  # unset: on with CUDA only


def test_embedded_default_config_resolves(registry, spec):
    from tessellm.core.config import load_config

    resolved = resolve(load_config(overrides=["device=cpu"]), registry, spec)
    assert names(resolved)["quant"] == "none"


def test_default_config_resolves_with_the_entry_point_registry(spec):
    from tessellm.core.config import load_config

    resolved = resolve(load_config(overrides=["device=cpu"]), PluginRegistry(), spec)
    assert list(resolved.choices) == [k for k in ORDER if k != "pooling"]  # a checkpoint that says nothing: it generates
    assert all(choice.entry.package for choice in resolved.choices.values())


@pytest.mark.parametrize("mode,chosen", [("mean", "mean"), ("lasttoken", "last"), ("cls", "cls"),
                                         ("classify", "classify"), (None, None)])
def test_auto_pooler_follows_what_the_checkpoint_says(spec, mode, chosen):
    from tessellm.core.config import load_config
    from tessellm.core.interfaces.pooling import CheckpointPooling

    resolved = resolve(load_config(overrides=["device=cpu"]), PluginRegistry(), spec, pooling=CheckpointPooling(mode))
    assert (resolved.choices["pooling"].entry.name if "pooling" in resolved.choices else None) == chosen


def test_a_named_pooler_overrides_the_checkpoint_and_an_unknown_one_is_refused(spec):
    from tessellm.core.config import load_config
    from tessellm.core.interfaces.pooling import CheckpointPooling

    said = CheckpointPooling("cls")
    resolved = resolve(load_config(overrides=["device=cpu", "pooling.name=mean"]), PluginRegistry(), spec, pooling=said)
    assert resolved.choices["pooling"].entry.name == "mean"
    with pytest.raises(ConfigError, match=r"pooling.name: unknown pooling plugin 'meen' \(did you mean 'mean'\?\)"):
        resolve(load_config(overrides=["device=cpu", "pooling.name=meen"]), PluginRegistry(), spec, pooling=said)


def test_explicit_names_and_options(registry, spec):
    cfg = config(dtype="float64", max_model_len=100,
                 attention={"name": "sdpa", "options": {"batch_decode": False}},
                 cache={"name": "contiguous", "options": {"max_seqs": 4}},
                 scheduler={"name": "static", "options": {"max_batch_size": 3}},
                 decoding={"name": "greedy"}, quant={"name": "none"})
    resolved = resolve(cfg, registry, spec)
    assert names(resolved)["decoding"] == "greedy"
    assert resolved.dtype == torch.float64
    assert resolved.max_model_len == 100
    assert resolved.kv_layout == KVLayout("kv", 100, torch.float64)
    assert resolved.choices["cache"].options.max_seqs == 4
    assert resolved.choices["attention"].options.batch_decode is False
    assert resolved.choices["scheduler"].options.max_batch_size == 3


# ---------------------------------------------------------------------------- auto priority


def test_auto_picks_highest_priority_builtin(registry, spec):
    # decoding: sample (10) before greedy (5)
    assert [e.name for e in registry.auto_order("decoding")] == ["sample", "greedy"]
    assert names(resolve(config(decoding={"name": "auto"}), registry, spec))["decoding"] == "sample"


def test_auto_picks_highest_priority_throwaway(spec):
    reg = registry_with(plugin_module("ranked", attention=[ranked_attention("low", 1), ranked_attention("high", 50),
                                                          ranked_attention("mid", 20)]))
    assert [e.name for e in reg.auto_order("attention")] == ["high", "mid", "sdpa", "low"]
    assert names(resolve(config(), reg, spec))["attention"] == "high"


def test_auto_ties_break_by_name(spec):
    reg = registry_with(plugin_module("ties", attention=[ranked_attention("zeta", 50), ranked_attention("alpha", 50)]))
    assert names(resolve(config(), reg, spec))["attention"] == "alpha"


def test_auto_ignores_plugins_without_priority(spec):
    reg = registry_with(plugin_module("manual", attention=[ranked_attention("manual", None)]))
    assert "manual" not in [e.name for e in reg.auto_order("attention")]
    assert names(resolve(config(), reg, spec))["attention"] == "sdpa"
    # but it is used when named
    assert names(resolve(config(attention={"name": "manual"}), reg, spec))["attention"] == "manual"


def test_auto_with_no_auto_candidates_names_the_registered_ones(spec):
    reg = PluginRegistry(entry_points=False, modules=[
        *(importlib.import_module(f"tessellm.plugins.{m}") for m in BUILTIN_MODULES if m != "attention.sdpa"),
        plugin_module("manual", attention=[ranked_attention("manual", None)])])
    message = error_of(config(), reg, spec)
    assert "attention.name" in message and "auto" in message and "manual" in message


def test_auto_with_nothing_registered_is_an_error(spec):
    reg = PluginRegistry(entry_points=False)
    message = error_of(config(), reg, spec)
    assert ".name" in message and "(none registered)" in message


def test_auto_skips_a_higher_priority_plugin_that_cannot_serve(spec):
    reg = registry_with(plugin_module("cudaonly", attention=[CudaOnlyAttention]))
    assert reg.auto_order("attention")[0].name == "cudaonly"
    assert names(resolve(config(), reg, spec))["attention"] == "sdpa"


# ---------------------------------------------------------------------------- unknown names


@pytest.mark.parametrize("kind,bad,valid", [
    ("attention", "flash", ["auto", "sdpa"]),
    ("cache", "paged", ["auto", "contiguous"]),
    ("scheduler", "continuous", ["auto", "static"]),
    ("decoding", "beam", ["auto", "greedy", "sample"]),
    ("quant", "int8", ["auto", "none"]),
])
def test_unknown_plugin_name(registry, spec, kind, bad, valid):
    message = error_of(config(**{kind: {"name": bad}}), registry, spec)
    assert message.startswith(f"{kind}.name:")
    assert repr(bad) in message
    assert "valid choices: " + ", ".join(valid) in message


def test_unknown_plugin_name_mentions_its_load_failure(spec):
    reg = registry_with()
    future = type("FlashAttention", (SdpaAttention,), {"name": "flash", "api_version": "2.0"})
    reg.add_module(plugin_module("flashpkg.plugin", attention=[future]), package="flashpkg", source="attention.flash")
    assert [f.package for f in reg.failures] == ["flashpkg"]
    message = error_of(config(attention={"name": "flash"}), reg, spec)
    assert "attention.name" in message and "'flash'" in message
    assert "flashpkg" in message and "2.0" in message  # why it is missing


def test_unrelated_load_failure_is_not_mentioned(spec):
    reg = registry_with()
    reg.failures.append(LoadFailure("attention.other", "otherpkg", "ImportError: nope"))
    message = error_of(config(attention={"name": "flash"}), reg, spec)
    assert "otherpkg" not in message


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize("kind,name,bad_key,allowed", [
    ("cache", "contiguous", "max_seq", "max_seqs"),
    ("attention", "sdpa", "batch_decoding", "batch_decode"),
    ("scheduler", "static", "max_batch", "max_batch_size"),
])
def test_unknown_option_key(registry, spec, kind, name, bad_key, allowed):
    message = error_of(config(**{kind: {"name": name, "options": {bad_key: 4}}}), registry, spec)
    assert f"{kind}.options.{bad_key}" in message
    assert f"'{name}' has no such option" in message
    assert f"allowed: {allowed}" in message


def test_unknown_option_of_a_plugin_without_options(registry, spec):
    message = error_of(config(quant={"name": "none", "options": {"bits": 4}}), registry, spec)
    assert "quant.options.bits" in message and "'none' has no such option" in message


def test_unknown_option_key_with_auto(registry, spec):
    message = error_of(config(cache={"name": "auto", "options": {"max_seq": 4}}), registry, spec)
    assert "cache.options.max_seq" in message and "allowed: max_seqs" in message


def test_options_apply_to_the_auto_choice(registry, spec):
    resolved = resolve(config(cache={"options": {"max_seqs": 4}}), registry, spec)
    assert names(resolved)["cache"] == "contiguous"
    assert resolved.choices["cache"].options.max_seqs == 4


@pytest.mark.parametrize("options,field,value", [
    ({"max_seqs": "many"}, "cache.options.max_seqs", "'many'"),
    ({"max_seqs": 0}, "cache.options.max_seqs", "0"),
    ({"max_seqs": 100000}, "cache.options.max_seqs", "100000"),
    ({"max_seqs": 2.5}, "cache.options.max_seqs", "2.5"),
    ({"max_seqs": [4]}, "cache.options.max_seqs", "[4]"),
])
@pytest.mark.parametrize("name", ["contiguous", "auto"])
def test_wrong_option_type(registry, spec, options, field, value, name):
    message = error_of(config(cache={"name": name, "options": options}), registry, spec)
    assert f"{field}:" in message and f"(got {value})" in message


def test_wrong_option_type_bool(registry, spec):
    message = error_of(config(attention={"name": "sdpa", "options": {"batch_decode": "sometimes"}}), registry, spec)
    assert "attention.options.batch_decode" in message and "'sometimes'" in message


# ---------------------------------------------------------------------------- explicit never falls back


def test_explicit_attention_that_cannot_read_the_cache_fails_without_fallback(spec):
    reg = registry_with(plugin_module("mla", cache=[LatentCache], attention=[LatentAttention]))
    cfg = config(cache={"name": "latentcache"}, attention={"name": "sdpa"})
    message = error_of(cfg, reg, spec)
    assert message.startswith("attention.name:")
    assert "'sdpa' cannot serve" in message
    assert "'latent'" in message and "kv" in message
    assert "mla" not in message


def test_auto_attention_picks_the_capable_backend(spec):
    reg = registry_with(plugin_module("mla", cache=[LatentCache], attention=[LatentAttention]))
    # sdpa ranks first (10 > 1) but cannot read the latent format
    assert [e.name for e in reg.auto_order("attention")] == ["sdpa", "mla"]
    resolved = resolve(config(cache={"name": "latentcache"}), reg, spec)
    assert names(resolved)["attention"] == "mla"
    assert resolved.kv_layout.format == "latent"
    # with the ordinary cache, sdpa still wins on priority
    assert names(resolve(config(), reg, spec))["attention"] == "sdpa"


class PlainAttention(SdpaAttention):
    """A backend ranked above sdpa that serves no layer feature (written before plugin API 1.8
    would have served the model-wide window; this one declines even that)."""

    name = "plain"
    api_version = "1.8"
    auto_priority = 50
    layer_features = frozenset()


def test_auto_passes_over_a_backend_lacking_a_layer_feature():
    """A model whose layers need windows of their own and softcaps (Gemma 2's): auto skips the
    higher-ranked backend that serves neither; named, it fails naming each feature and the
    layers that need it. A model without layer features still gets it."""
    reg = registry_with(plugin_module("plain", attention=[PlainAttention]))
    gemma = ModelSpec.from_hf_config(transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=MAX_POS))
    assert names(resolve(config(), reg, gemma))["attention"] == "sdpa"
    assert names(resolve(config(), reg, tiny_spec()))["attention"] == "plain"
    message = error_of(config(attention={"name": "plain"}), reg, gemma)
    assert "does not serve sliding windows on some layers only (layer feature 'per_layer_window'), which " \
           "'gemma2' needs on layers 0, 2" in message
    assert "attention logit softcapping (layer feature 'softcap'), which 'gemma2' needs on layers 0, 1, 2, 3" \
           in message


def test_auto_finding_nothing_lists_every_candidates_reasons(spec):
    reg = registry_with(plugin_module("odd", cache=[LatentCache], attention=[OddHeadAttention]))
    message = error_of(config(cache={"name": "latentcache"}), reg, spec)
    assert message.startswith("attention.name: auto found no attention plugin")
    assert "sdpa: reads cache formats ['kv'], but the cache stores 'latent'" in message
    assert "oddhead: " in message
    assert "head dims [999]" in message and "16" in message  # oddhead's second reason, the model's head dim


def test_explicit_cache_that_cannot_serve_fails_without_fallback(spec):
    reg = registry_with(plugin_module("cudacache", cache=[CudaOnlyCache]))
    message = error_of(config(cache={"name": "cudacache"}), reg, spec)
    assert message.startswith("cache.name: 'cudacache' cannot serve this pipeline")
    assert "runs on cuda" in message and "'cpu'" in message
    assert "contiguous" not in message


def test_explicit_attention_on_wrong_device_fails_without_fallback(spec):
    reg = registry_with(plugin_module("cudaonly", attention=[CudaOnlyAttention]))
    message = error_of(config(attention={"name": "cudaonly"}), reg, spec)
    assert "attention.name: 'cudaonly' cannot serve" in message and "'cpu'" in message


def test_auto_cache_adapts_to_an_explicit_attention(spec):
    """auto picks the first plugin that works *given the other choices*: a higher-priority
    cache whose layout the named attention backend cannot read is passed over."""
    reg = registry_with(plugin_module("eager", cache=[EagerLatentCache], attention=[LatentAttention]))
    assert reg.auto_order("cache")[0].name == "eagerlatent"
    resolved = resolve(config(attention={"name": "sdpa"}), reg, spec)
    assert names(resolved)["cache"] == "contiguous"
    assert resolved.kv_layout.format == "kv"
    # left to auto, the pair that works at the highest cache priority wins
    resolved = resolve(config(), reg, spec)
    assert names(resolved)["cache"] == "eagerlatent" and names(resolved)["attention"] == "mla"


def test_attention_sees_the_chosen_cache_layout_and_choices(spec):
    seen = []

    class SpyAttention(SdpaAttention):
        name = "spy"
        api_version = "1.0"

        @classmethod
        def unsupported_reasons(cls, ctx):
            seen.append(ctx)
            return super().unsupported_reasons(ctx)

    reg = registry_with(plugin_module("spy", attention=[SpyAttention]))
    resolve(config(attention={"name": "spy"}, cache={"name": "contiguous", "options": {"max_seqs": 2}},
                   max_model_len=64), reg, spec)
    [ctx] = seen
    assert ctx.kv_layout == KVLayout("kv", 64, torch.float32)
    assert set(ctx.chosen) == {"quant", "cache"}
    assert ctx.chosen["cache"][0] is ContiguousCache and ctx.chosen["cache"][1].max_seqs == 2
    assert ctx.model is spec and ctx.max_model_len == 64 and ctx.device.type == "cpu"


@pytest.mark.skipif(_physical_memory() is None, reason="physical memory size unknown on this OS")
def test_real_cache_refuses_a_pipeline_larger_than_memory(registry):
    huge = tiny_spec(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=80,
                     max_position_embeddings=131072)
    cfg = config(dtype="float32", cache={"name": "contiguous", "options": {"max_seqs": 4096}})
    message = error_of(cfg, registry, huge)
    assert message.startswith("cache.name: 'contiguous' cannot serve")
    assert "max_seqs=4096" in message and "GiB" in message
    auto = error_of(config(dtype="float32", cache={"options": {"max_seqs": 4096}}), registry, huge)
    assert auto.startswith("cache.name: auto found no cache plugin") and "contiguous: " in auto


# ---------------------------------------------------------------------------- device and length


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_config_error(registry, spec, device):
    message = error_of(config(device=device), registry, spec)
    assert message.startswith("device:") and repr(device) in message and "CUDA" in message


def test_auto_device(registry, spec):
    resolved = resolve(config(device="auto"), registry, spec)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolved.device.type == expected
    assert resolved.dtype == (torch.bfloat16 if expected == "cuda" else torch.float32)


@pytest.mark.parametrize("dtype,expected", [("float32", torch.float32), ("float16", torch.float16),
                                            ("bfloat16", torch.bfloat16), ("float64", torch.float64)])
def test_explicit_dtype(registry, spec, dtype, expected):
    assert resolve(config(dtype=dtype), registry, spec).dtype == expected


@pytest.mark.parametrize("length", [MAX_POS + 1, 4 * MAX_POS])
def test_max_model_len_over_the_models_limit(registry, spec, length):
    message = error_of(config(max_model_len=length), registry, spec)
    assert message.startswith("max_model_len:")
    assert str(length) in message and str(MAX_POS) in message and "max_position_embeddings" in message


@pytest.mark.parametrize("length", [1, 100, MAX_POS])
def test_max_model_len_within_the_limit(registry, spec, length):
    resolved = resolve(config(max_model_len=length), registry, spec)
    assert resolved.max_model_len == length
    assert resolved.kv_layout.block_size == length  # contiguous: one region of max_model_len


def test_resolve_does_not_mutate_the_config(registry, spec):
    cfg = config(cache={"name": "auto", "options": {"max_seqs": 4}})
    before = cfg.model_dump()
    resolve(cfg, registry, spec)
    assert cfg.model_dump() == before


def test_a_quantizer_runs_first_and_is_seen_by_later_kinds(spec):
    seen = []

    class PickyQuant(Quantizer):
        name = "picky"
        api_version = "1.0"
        auto_priority = 50

    class NeedsPicky(SdpaAttention):
        name = "needspicky"
        api_version = "1.0"
        auto_priority = 60

        @classmethod
        def unsupported_reasons(cls, ctx):
            seen.append(ctx.chosen["quant"][0].name)
            return [] if ctx.chosen["quant"][0] is PickyQuant else ["needs quant picky"]

    reg = registry_with(plugin_module("picky", quant=[PickyQuant], attention=[NeedsPicky]))
    assert names(resolve(config(quant={"name": "auto"}), reg, spec))["attention"] == "needspicky"
    assert names(resolve(config(quant={"name": "none"}), reg, spec))["attention"] == "sdpa"
    assert seen == ["picky", "none"]
