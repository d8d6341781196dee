"""Plugin API 1.x stays compatible: a plugin written against tessellm 0.1's docs (plugin API
1.0) installs and runs unchanged. ``frozen_plugin_example/`` is a verbatim copy of the example
package as 0.1 shipped it: it imports from ``tessellm.core.batch``, ``tessellm.core.cache``,
``tessellm.core.plugin`` and subclasses ``sdpa``, and its tests build a
``SelectionContext(config=...)``. Every old import path works and warns (DeprecationWarning)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tessellm
from tessellm import LLM
from tessellm.core import compat
from tessellm.core import registry as registry_module
from tessellm.core.registry import PluginRegistry

FROZEN = Path(__file__).resolve().parent / "frozen_plugin_example"


def test_frozen_example_loads_selects_and_generates(monkeypatch, install_plugin_folder, tiny_model, cpu_config):
    install_plugin_folder(FROZEN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = PluginRegistry()
    assert registry.failures == []
    entry = registry.get("attention", "example-logging")
    assert entry is not None and entry.cls.api_version == "1.0"
    moved = {str(w.message).split(" ")[0] for w in caught if issubclass(w.category, DeprecationWarning)}
    assert {"tessellm.core.batch", "tessellm.core.cache"} <= moved  # its old imports, each named
    monkeypatch.setattr(registry_module, "_default", registry)

    folder = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = {"max_tokens": 5, "ignore_eos": True}
    example = LLM(cpu_config(folder, dtype="float64", attention={"name": "example-logging"}))
    reference = LLM(cpu_config(folder, dtype="float64", attention={"name": "sdpa"}))
    assert [o.token_ids for o in example.generate(prompts, params)] == \
        [o.token_ids for o in reference.generate(prompts, params)]
    assert example.pipeline.attention.layer_calls > 0


@pytest.mark.extended
def test_frozen_examples_own_tests_pass():
    """Its tests build ``SelectionContext(config=PipelineConfig(), ...)`` and import from the
    old paths: run as its author would, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FROZEN), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                           "always::DeprecationWarning", str(FROZEN / "tests")], capture_output=True, text=True,
                          cwd=FROZEN, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "7 passed" in done.stdout and "DeprecationWarning" in done.stdout


def test_every_old_import_path_resolves_and_warns():
    """In a fresh process: each old module imports with a DeprecationWarning naming where its
    names went, and the names docs/plugins.md 0.1 used resolve to today's objects."""
    probe = """
import importlib, json, warnings
from tessellm.core import compat
out = {}
for old in compat.MOVED:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(old)
    out[old] = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    warned = json.loads(done.stdout)
    for old, homes in compat.MOVED.items():
        assert any(old in m and homes[0] in m for m in warned[old]), (old, warned[old])

    from tessellm.core.attention import AttentionBackend
    from tessellm.core.batch import BatchMetadata, build_batch
    from tessellm.core.cache import CacheManager, KVLayout, KVStorage
    from tessellm.core.decoding import Decoder
    from tessellm.core.fused_ops import rope_store, rotary_
    from tessellm.core.kv_storage import DenseKVStorage
    from tessellm.core.quant import Quantizer
    from tessellm.core.scheduler import QueueScheduler, Scheduler
    from tessellm.plugins.cache.block_pool import BlockPool

    assert (AttentionBackend, BatchMetadata, CacheManager, KVLayout, KVStorage, Decoder, DenseKVStorage, Quantizer,
            Scheduler, QueueScheduler) == (tessellm.AttentionBackend, tessellm.BatchMetadata, tessellm.CacheManager,
                                           tessellm.KVLayout, tessellm.KVStorage, tessellm.Decoder,
                                           tessellm.DenseKVStorage, tessellm.Quantizer, tessellm.Scheduler,
                                           tessellm.QueueScheduler)
    from tessellm.core.engine.batch_builder import build_batch as new_build_batch
    from tessellm.plugins.attention.flash.rope_store import rope_store as new_rope_store
    from tessellm.plugins.cache.paged import BlockPool as NewBlockPool

    assert (build_batch, rope_store, BlockPool) == (new_build_batch, new_rope_store, NewBlockPool)
    assert callable(rotary_)
    with pytest.raises(ImportError, match="NoSuchName"):
        from tessellm.core.attention import NoSuchName  # noqa: F401


def test_old_module_names_of_the_engine_and_model_packages_warn():
    from tessellm.core.engine.engine import Engine
    from tessellm.core.model.llama import LlamaForCausalLM

    for package, name, value in (("tessellm.core.engine", "EngineStats", None), ("tessellm.core.engine", "Engine", Engine),
                                 ("tessellm.core.model", "LlamaForCausalLM", LlamaForCausalLM)):
        module = sys.modules[package]
        module.__dict__.pop(name, None)  # a lookup an earlier test cached
        with pytest.warns(DeprecationWarning, match=f"{package}.{name} is deprecated"):
            found = getattr(module, name)
        assert value is None or found is value


def test_selection_context_config_still_reads_and_warns():
    config = tessellm.PipelineConfig()
    ctx = tessellm.SelectionContext(config=config, device=torch.device("cpu"), dtype=torch.float32, model=None,
                                    options=tessellm.PluginOptions(), max_model_len=64)
    with pytest.warns(DeprecationWarning, match="ctx.auto"):
        assert ctx.config is config
    assert not ctx.auto and ctx.chosen == {}


class _LegacyDecoder(tessellm.Decoder):
    """A 1.0 decoder: it takes what it needs in ``bind(pipeline)``."""

    name = "legacy-bind"
    api_version = "1.0"

    def bind(self, pipeline):
        self.bound = (pipeline.runner, pipeline.cache, pipeline.resolved.max_model_len)

    def decode(self, logits, batch):
        return [[t] for t in tessellm.slot_logits(logits, batch).argmax(-1).tolist()]


def test_a_decoder_overriding_bind_still_gets_the_pipeline(tiny_model, cpu_config):
    registry = PluginRegistry()
    registry._plugins["decoding"]["legacy-bind"] = registry_module.PluginEntry(_LegacyDecoder, "tests")
    config = cpu_config(tiny_model("llama"), decoding={"name": "legacy-bind"})
    with pytest.warns(DeprecationWarning, match="attach"):
        llm = LLM(pipeline=tessellm.Pipeline.from_config(config, registry=registry))
    runner, cache, max_len = llm.pipeline.decoder.bound
    assert runner is llm.pipeline.runner and cache is llm.pipeline.cache and max_len == 256
    greedy = LLM(cpu_config(tiny_model("llama"), decoding={"name": "greedy"}))
    prompts, params = [[5, 6, 7]], {"max_tokens": 4, "ignore_eos": True}
    assert llm.generate(prompts, params)[0].token_ids == greedy.generate(prompts, params)[0].token_ids


class _LegacyTopK(tessellm.Decoder):
    """A 1.0 sampler: temperature and top-k; it knows nothing of min_p (plugin API 1.1)."""

    name = "legacy-top-k"
    api_version = "1.0"

    def decode(self, logits, batch):
        rows = tessellm.slot_logits(logits, batch)
        return [[int(row.argmax())] for row in rows]


class _LegacyTopKThatLearnedMinP(_LegacyTopK):
    name = "legacy-top-k-min-p"
    api_version = "1.0"
    request_fields = frozenset({"temperature", "top_k", "top_p", "seed", "n", "min_p"})


@pytest.mark.parametrize("decoder", [_LegacyTopK, _LegacyTopKThatLearnedMinP])
def test_a_request_field_newer_than_a_decoder_is_refused_unless_it_declares_it(decoder, tiny_model, cpu_config):
    registry = PluginRegistry()
    registry._plugins["decoding"][decoder.name] = registry_module.PluginEntry(decoder, "tests")
    llm = LLM(pipeline=tessellm.Pipeline.from_config(cpu_config(tiny_model("llama"), decoding={"name": decoder.name}),
                                                     registry=registry))
    prompts = [[5, 6, 7]]
    assert llm.generate(prompts, {"max_tokens": 2, "min_p": 0.0})  # at its default: nothing to ignore
    if decoder is _LegacyTopK:
        with pytest.raises(tessellm.InvalidRequestError,
                           match=r"^decoding plugin 'legacy-top-k' \(written for plugin API 1.0\) does not honour "
                                 r"SamplingParams.min_p, added in plugin API 1.1, and would ignore it; leave min_p "
                                 r"at 0.0 "):
            llm.generate(prompts, {"max_tokens": 2, "min_p": 0.1})
        assert not llm.engine.requests
    else:
        assert len(llm.generate(prompts, {"max_tokens": 2, "min_p": 0.1})[0].token_ids) == 2


def test_built_in_decoders_declare_every_field_they_honour():
    from tessellm.core.interfaces.decoder import DECODER_FIELDS, honoured_fields

    registry = PluginRegistry()
    for name in ("greedy", "sample", "speculative"):
        cls = registry.get("decoding", name).cls
        assert cls.request_fields is not None and honoured_fields(cls) == set(DECODER_FIELDS), name
