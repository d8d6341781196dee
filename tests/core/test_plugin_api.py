"""The plugin-facing API: everything a plugin author needs comes from ``tessellm``, lazily;
the contracts a built-in relies on are declared on its interface (a storage's raw tensors, a
backend's warm-up shapes, what a decoder may use of its pipeline)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tessellm
from tessellm.core.engine.warm_up import warm_up

ROOT = Path(__file__).resolve().parents[2]
AUTHOR_NAMES = ["hookimpl", "AttentionBackend", "CacheManager", "Scheduler", "Decoder", "Quantizer", "PluginOptions",
                "SelectionContext", "BatchMetadata", "KVStorage", "KVLayout", "DenseKVStorage", "CacheSpec", "Sequence",
                "SamplingParams", "SchedulerOutput", "ScheduledSeq", "DecoderContext", "ModelSpec", "PluginRegistry",
                "LLM", "Pipeline", "PipelineConfig", "PLUGIN_API_VERSION"]


def test_every_public_name_resolves():
    for name in tessellm.__all__:
        assert getattr(tessellm, name) is not None, name
    assert set(AUTHOR_NAMES) <= set(tessellm.__all__) <= set(dir(tessellm))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        tessellm.Nope  # noqa: B018


def test_importing_tessellm_for_its_hook_marker_loads_no_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, tessellm; tessellm.hookimpl; "
                           "print(sorted(m for m in ('torch', 'transformers', 'tessellm.core.engine') if m in sys.modules))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_plugin_docs_import_only_from_tessellm():
    """docs/plugins.md's code imports the plugin API (``tessellm`` and its testing kit) and
    the plugin's own package, nothing from tessellm's modules."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    modules = [m for block in blocks for m in re.findall(r"^\s*(?:from|import) ([\w.]+)", block, re.M)]
    inner = [m for m in modules if m.startswith("tessellm.") and not m.startswith("tessellm.testing")]
    assert inner == []


def test_dense_storage_hands_out_its_tensors_and_others_say_they_have_none():
    layout = tessellm.KVLayout("kv", 4, torch.float32)
    storage = tessellm.DenseKVStorage(layout, 8, 2, 16, torch.device("cpu"))
    k, v = storage.kv_tensors()
    assert k.shape == v.shape == (8, 2, 16) and k is storage.k

    class Latent(tessellm.KVStorage):
        layout = tessellm.KVLayout("latent", 4, torch.float32)
        device = torch.device("cpu")

        def store(self, k, v, slot_mapping): ...

        def gather(self, slots): ...

    with pytest.raises(TypeError, match="Latent keeps no plain K/V tensors"):
        Latent().kv_tensors()


def test_warm_up_runs_the_backends_own_shapes(tiny_model, cpu_config, monkeypatch):
    llm = tessellm.LLM(cpu_config(tiny_model("llama"), attention={"name": "sdpa"}, max_model_len=64,
                                  cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 32}},
                                  scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 16}}))
    runner, seen = llm.pipeline.runner, []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda batch, *a, **k: seen.append(batch.query_lens_cpu) or forward(batch))
    monkeypatch.setattr(runner.backend, "warm_up_shapes", lambda tokens, max_len: [[(3, 9), (1, max_len)]])
    assert warm_up(runner, 16, 64) == 3
    assert seen == [[16], [1], [3, 1]]  # a full step, a decode, then the backend's shape
    assert llm.pipeline.cache.num_free_blocks == llm.pipeline.cache.num_blocks


class _Watcher(tessellm.Decoder):
    """Greedy, keeping the context it was attached with."""

    name = "watcher"
    api_version = tessellm.PLUGIN_API_VERSION

    def attach(self, ctx):
        self.ctx = ctx

    def decode(self, logits, batch):
        return [[t] for t in tessellm.slot_logits(logits, batch).argmax(-1).tolist()]


def test_a_decoder_is_attached_with_what_it_may_use(tiny_model, cpu_config):
    from tessellm.core.engine.batch_builder import build_batch

    registry = tessellm.PluginRegistry()
    registry._plugins["decoding"]["watcher"] = tessellm.core.registry.PluginEntry(_Watcher, "tests")
    pipeline = tessellm.Pipeline.from_config(cpu_config(tiny_model("llama"), decoding={"name": "watcher"},
                                                        max_model_len=128), registry=registry)
    ctx = pipeline.decoder.ctx
    assert isinstance(ctx, tessellm.DecoderContext)
    assert (ctx.model, ctx.device, ctx.max_model_len, ctx.cache) == (pipeline.spec, torch.device("cpu"), 128,
                                                                      pipeline.cache)
    assert ctx.vocab_size == len(pipeline.tokenizer) and ctx.num_parameters > 0
    assert ctx.config["decoding"]["name"] == "watcher" and ctx.tokens_left == pipeline.stop.tokens_left
    seq = tessellm.Sequence("probe", [5, 6, 7], tessellm.SamplingParams(max_tokens=4))
    pipeline.cache.reserve(seq, 3)
    items = [tessellm.ScheduledSeq(seq, 3)]
    expected = pipeline.runner.forward(build_batch(items, pipeline.cache, pipeline.runner.device))
    assert torch.equal(ctx.run(items), expected) and ctx.run(items, [0]).shape == expected.shape
    assert ctx.tokens_left(seq) == 4
    pipeline.cache.free(seq)
