"""Model plugin ``transformers``: any decoder-only checkpoint whose transformers model code
computes attention through transformers' ``AttentionInterface``, run by that code with
tessellm's attention backend and paged KV cache (the way vLLM's "Transformers modeling
backend" runs models it has no implementation of).

Under ``auto`` it serves the ``model_type``s no other model plugin declares (and a variant
the declaring plugin refuses), after all of them: native plugins keep priority. Named
(``architecture: transformers``) it serves any checkpoint, so ``tessellm ab --a
architecture.name=llama --b architecture.name=transformers`` compares the two on one model.

- ``spec`` builds the model on the meta device with the ``tessellm`` attention
  implementation and runs it once there (probe.py): every layer's attention call gives the
  head counts and sizes, the scale, the window, the softcap and sinks (a ``LayerAttention``
  each); anything else (a layer that mixes tokens without attention, chunked or
  bidirectional masks, per-layer cache shapes) is a one-line refusal naming why.
- ``build`` makes the model on the meta device, its class swapped so its forward keeps
  tessellm's contract (module.py); weights load through tessellm's loader after transformers'
  checkpoint conversions (checkpoint.py); ``after_load`` computes the buffers the model makes
  for itself (rotary tables) in the pipeline's dtype.
- Everything the engine does runs unchanged: continuous batching, chunked prefill,
  preemption, prefix caching, speculative decoding, logits processors, structured outputs,
  beams; quantizers replace its ``nn.Linear`` layers and LoRA wraps its projections where
  they carry Llama's names; tensor parallelism follows the model's tensor-parallel plan
  (parallel.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.spec import LayerAttention, ModelSpec, quantization_config
from tessellm.core.parallel.shard import slice_rule
from tessellm.core.plugin import PluginOptions

from .attention import AttentionLayout, install_attention
from .checkpoint import convert_checkpoint
from .module import adopt, build_causal_lm, fill_buffers
from .parallel import check_rule, local_config, tp_plan
from .probe import probe_attention, refusal, rope_types_of, structural_refusal

log = logging.getLogger(__name__)


class TransformersOptions(PluginOptions):
    experts_implementation: Literal["auto", "eager", "batched_mm", "grouped_mm"] = "auto"
    """How transformers computes mixture-of-experts layers: ``auto`` is ``grouped_mm`` on CUDA
    in bfloat16 or float16 and ``eager`` (a loop over the experts hit) otherwise."""
    cuda_graphs: bool = False
    """Let decode steps replay from captured CUDA graphs (the pipeline's ``cuda_graphs`` on,
    a model without mixture-of-experts layers). Off by default: transformers' model code is
    not checked for capture (host reads, dynamic shapes) family by family."""
    probe_tokens: int = Field(16, ge=2, le=256, strict=True)
    """Tokens of the meta-device forward that reads what the layers ask of attention (enough
    for a layer that adds keys of its own every few tokens to show it)."""


class TransformersArchitecture(ModelArchitecture):
    """transformers' own model code with tessellm's attention and KV cache, for any decoder-only
    model whose attention goes through transformers' AttentionInterface."""

    name = "transformers"
    api_version = "1.19"
    model_types = ()
    any_model_type = True
    auto_priority = 0
    Options = TransformersOptions

    def __init__(self, options: TransformersOptions | None = None):
        super().__init__(options)
        install_attention()
        self._layout: tuple[Any, AttentionLayout, ModelSpec] | None = None  # (config, its probe's layout and spec)
        self._built: nn.Module | None = None  # the module last built, whose names checkpoints map to
        self._row_parallel: set[str] = set()  # modules a tensor-parallel rank holds rows of

    def spec(self, hf_config: Any) -> ModelSpec:
        try:
            quant = quantization_config(hf_config)
            if quant is not None:
                raise ModelLoadError(f"it is a pre-quantized checkpoint ({quant.get('quant_method', '?')!r}); the "
                                     f"native model plugins load those (a float checkpoint here can be quantized at "
                                     f"load: quant.name int8-weight or int4-weight)")
            spec, layout = self._probe(hf_config)
        except ModelLoadError as exc:
            raise ModelLoadError(f"model plugin 'transformers' cannot serve model_type "
                                 f"{getattr(hf_config, 'model_type', None)!r}: {exc}") from None
        self._layout = (hf_config, layout, spec)
        return spec

    def _probe(self, hf_config: Any) -> tuple[ModelSpec, AttentionLayout]:
        if getattr(hf_config, "is_encoder_decoder", False):
            raise ModelLoadError("it is an encoder-decoder model; tessellm serves decoder-only models")
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        with torch.device("meta"):
            model = build_causal_lm(hf_config, experts="batched_mm")  # batched_mm runs on the meta device
        why = structural_refusal(model)
        if why:
            raise ModelLoadError(why)
        rope_types = rope_types_of(model)
        probe = probe_attention(model, text.num_hidden_layers, self.options.probe_tokens)
        why = refusal(probe, getattr(text, "layer_types", None))
        if why:
            raise ModelLoadError(why)
        spec = _spec_from_probe(hf_config, text, model, probe.calls)
        if "longrope" in rope_types:  # the long factors switch on past the original length, batch-wide
            spec = dataclasses.replace(spec, max_position_embeddings=_original_positions(text, spec))
        first = probe.calls[0]
        layout = AttentionLayout(spec.head_dim, first.qk_dim, first.value_dim, spec.attention_scale, first.sink_kwarg)
        return spec, layout

    def build(self, spec: ModelSpec) -> nn.Module:
        if self._layout is None or self._layout[0] is not spec.hf_config:
            whole, layout = self._probe(spec.hf_config)
            self._layout = (spec.hf_config, layout, whole)
        _, layout, whole = self._layout
        config = spec.hf_config
        if (spec.num_heads, spec.num_kv_heads, spec.intermediate_size) != \
                (whole.num_heads, whole.num_kv_heads, whole.intermediate_size):
            config = local_config(config, spec)  # a tensor-parallel rank's share
        model = adopt(build_causal_lm(config), layout, spec.num_layers)
        model.tessellm.row_parallel = tuple(sorted(self._row_parallel))
        model.tessellm.cuda_graphs = self.options.cuda_graphs
        self._built = model
        return model

    def shard_rule(self, name: str, spec: ModelSpec, shard: Any) -> Any:
        """Core's rule for ``name``, where the model's tensor-parallel plan splits it alike
        (parallel.py); a ConfigError where the model declares no plan or splits otherwise."""
        rule = slice_rule(name, spec, shard)
        check_rule(name, rule, tp_plan(spec.hf_config), spec.model_type)
        if isinstance(rule, tuple) and rule[0] == 1:
            self._row_parallel.add(name.rsplit(".", 1)[0])
        return rule

    def checkpoint_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' own conversions of the checkpoint (checkpoint.py), to the names of the
        module this plugin built last."""
        if self._built is None:
            raise ModelLoadError("model plugin 'transformers': checkpoint_tensors called before build")
        return convert_checkpoint(self._built, state)

    def after_load(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """The buffers the model computes for itself, in ``dtype`` on ``device``; its experts'
        implementation for the device."""
        model.config.dtype = dtype
        fill_buffers(model, model.config, device, dtype)
        experts = self.options.experts_implementation
        if experts == "auto":
            fast = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            experts = "grouped_mm" if fast else "eager"
        if model._can_set_experts_implementation():
            model.set_experts_implementation(experts)
        elif self.options.experts_implementation != "auto":
            log.info("architecture.options.experts_implementation=%s: this model has no experts, nothing to set",
                     self.options.experts_implementation)


def _spec_from_probe(config: Any, text: Any, model: nn.Module, calls: tuple) -> ModelSpec:
    """The ModelSpec of what the probe saw: one LayerAttention per layer, the cache's head size
    the larger of the q/k and value head sizes, the first layer's scale (others rescale q)."""
    first = calls[0]
    head = model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or text.vocab_size
    inputs = model.get_input_embeddings()
    tied = head is not None and inputs is not None and getattr(head, "weight", None) is getattr(inputs, "weight", 0)
    windows = {c.sliding_window for c in calls}
    hidden = text.hidden_size
    return ModelSpec(
        model_type=config.model_type, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden, num_layers=len(calls),
        num_heads=first.heads, num_kv_heads=first.kv_heads, head_dim=max(first.qk_dim, first.value_dim),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6),
        max_position_embeddings=_max_positions(text), tie_word_embeddings=tied, qkv_bias=False, o_bias=False,
        mlp_bias=False, sliding_window=next(iter(windows)) if len(windows) == 1 else None, rope_type="default",
        hf_config=config, scale=first.scaling if first.scaling is not None else first.qk_dim ** -0.5,
        layer_attention=tuple(LayerAttention(sliding_window=c.sliding_window, softcap=c.softcap,
                                             sinks=c.sink_kwarg is not None, rope=None) for c in calls))


def _original_positions(text: Any, spec: ModelSpec) -> int:
    """LongRoPE's original context (past it transformers switches the frequencies of a whole
    forward to the long factors, which would make cached keys depend on how a sequence was
    cut into steps): the longest context served."""
    params = getattr(text, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings",
                                                                         None)
    if not original:
        raise ModelLoadError("rope_type 'longrope' without original_max_position_embeddings")
    log.info("%s: LongRoPE serves contexts up to its original %d positions (of %d)", spec.model_type, original,
             spec.max_position_embeddings)
    return min(int(original), spec.max_position_embeddings)


def _max_positions(text: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelLoadError("its config gives no maximum sequence length (max_position_embeddings)")


@tessellm.hookimpl
def register_model(register):
    register(TransformersArchitecture)
