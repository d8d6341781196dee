"""A model plugin whose forward takes a fixed time and returns fixed logits: everything around
the model (scheduling, batching, sampling, serving) measured as if a device ran the forward.

``architecture.name: stub`` serves any Llama-shaped ``config.json`` (it is never picked by
``auto``); its options set the time a forward takes (``step_ms``, slept, so the GIL is free
meanwhile, as while a GPU runs) and the logits: row ``i`` of a step prefers token
``(position * 7919 + 13) % vocab_size`` (a fixed, varied text; ``ignore_eos`` keeps every
request to its ``max_tokens``). It stores zeros as every layer's K/V, so the engine's
contract checks hold. The model's own weights are never read: ``make_stub_model`` writes a
folder with one tiny tensor and a real tokenizer's files.

Load it where the pipeline is built, in any process, by module name:
``TESSELLM_PLUGINS=tessellm.testing.stub_model`` (core/registry.py), or register it by hand.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import nn

import tessellm
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.spec import ModelSpec, decoder_spec
from tessellm.core.plugin import PluginOptions
from tessellm.core.version import PLUGIN_API_VERSION

MODULE = __name__
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class StubOptions(PluginOptions):
    """Options of the `stub` model."""

    step_ms: float = Field(2.5, ge=0.0, le=10_000.0)
    """Milliseconds each forward takes (slept)."""


class StubModel(nn.Module):
    """Sleeps ``step_ms``, stores zero K/V in every layer, returns one-hot-like logits."""

    def __init__(self, spec: ModelSpec, step_s: float):
        super().__init__()
        self.spec, self.step_s = spec, step_s
        self.fused = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                backend: Any, cache: Any, plan: Any, layers: Any = None, *, native_logits: bool = False) -> torch.Tensor:
        start = time.perf_counter()
        slots = getattr(plan, "slot_mapping", None)
        if slots is not None:  # zeros as every layer's new K/V (the engine checks the first forward stores them)
            shape = self.spec.kv_shape
            zeros = torch.zeros(slots.shape[0], shape.num_heads, shape.head_dim, dtype=cache.layout.dtype)
            for layer in range(self.spec.num_layers):
                cache.layer(layer).store(zeros, zeros, slots)
        vocab = self.spec.vocab_size
        rows = positions.index_select(0, logits_indices)
        logits = torch.zeros(rows.shape[0], vocab)  # small vocabularies: a GPU would hold these
        logits[torch.arange(rows.shape[0]), (rows * 7919 + 13) % vocab] = 1.0
        left = self.step_s - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return logits


class StubArchitecture(ModelArchitecture):
    """A stand-in for a model: a fixed time per forward, fixed logits."""

    name = "stub"
    api_version = PLUGIN_API_VERSION
    description = "a forward of fixed time and fixed logits, for measuring everything around the model"
    model_types = ("llama",)
    auto_priority = None
    Options = StubOptions

    def spec(self, hf_config: Any) -> ModelSpec:
        return decoder_spec(hf_config)

    def build(self, spec: ModelSpec) -> nn.Module:
        return StubModel(spec, self.options.step_ms / 1000.0)

    def checkpoint_name(self, name: str) -> str | None:
        return None  # no weights


def make_stub_model(target: Path, tokenizer_dir: Path, vocab_size: int = 4096, max_len: int = 4096) -> Path:
    """A Llama-shaped folder for the stub (one layer, one KV head of 8) with the tokenizer of
    ``tokenizer_dir``: ``architecture.name: stub`` serves it."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
              "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
              "num_key_value_heads": 1, "max_position_embeddings": max_len, "rms_norm_eps": 1e-5,
              "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "torch_dtype": "float32"}
    (target / "config.json").write_text(json.dumps(config))
    save_file({"unused": torch.zeros(1)}, target / "model.safetensors")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, target / name)
    return target


def stub_config(folder: Path, step_ms: float = 2.5, max_seqs: int = 512, num_blocks: int = 16384,
                **overrides: Any) -> dict[str, Any]:
    """A CPU pipeline config over the stub: paged cache, continuous batching of ``max_seqs``,
    greedy decoding."""
    config = {"model": str(folder), "device": "cpu", "dtype": "float32",
              "architecture": {"name": "stub", "options": {"step_ms": step_ms}},
              "attention": {"name": "sdpa"},
              "cache": {"name": "paged", "options": {"block_size": 16, "num_blocks": num_blocks}},
              "scheduler": {"name": "continuous", "options": {"max_num_seqs": max_seqs,
                                                              "max_num_batched_tokens": max(8192, max_seqs)}},
              "decoding": {"name": "greedy"}}
    config.update(overrides)
    return config


@tessellm.hookimpl
def register_model(register):
    register(StubArchitecture)
