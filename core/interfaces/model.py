"""The model-architecture kind: a plugin that turns a Hugging Face config and checkpoint of
the ``model_type``s it declares into the module the runner runs.

A model plugin says three things and may override a fourth:

- ``spec(hf_config)``: the model's ``ModelSpec`` (layers, heads, KV shape, RoPE, window, MoE,
  MLA, per-head norms), or a ``ModelLoadError`` naming what it cannot serve and what it can;
- ``build(spec)``: the module, made from core/model's blocks (``DecoderForCausalLM`` and its
  layers, norms, rotary embeddings, the gated MLP, ``MoE``, ``LatentAttention``), called on
  the meta device; its ``forward`` keeps ``DecoderForCausalLM``'s contract;
- ``checkpoint_name(name)``: the module parameter a checkpoint tensor loads into (None:
  skip the tensor); the default keeps the name. Experts stacked as 3-D tensors are split
  per expert before names are mapped (``tessellm.core.model.moe.unstack_experts``);
- ``after_load(model, device, dtype)``: switch to fast paths once weights are in place (the
  default stacks q/k/v and gate/up projections on every device but for float64, and runs
  the fused kernels and stacks experts on CUDA).

And it may declare ``tiny_config``: the shapes of the tiny checkpoints its conformance suite
builds per model_type (plugin API 1.15).

A model that takes images (plugin API 1.19) says so in its spec (``ModelSpec.vision``), builds
a module that also implements ``VisionModule`` (``encode_images``: the vision encoder and
projector; ``rope_positions`` for M-RoPE), loads the encoder's weights by name like the rest,
and returns its ``ImageProcessor`` (transformers' processor of the checkpoint, run where
prompts are tokenized) from ``image_processor``. The engine writes the encoder's embeddings
over the image placeholders' input embeddings before the decoder runs
(``DecoderForCausalLM.merge_images``).

Selection: a config's ``architecture`` section names a model plugin, or ``auto`` (the
default) takes the plugin with the highest ``auto_priority`` among those whose
``model_types`` hold the checkpoint's ``model_type``. A plugin that sets ``any_model_type``
(plugin API 1.17; the built-in ``transformers``) serves the types no plugin declares, after
every one that does, and may be named for any checkpoint.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import torch
from torch import nn

from tessellm.core.interfaces.spec import ModelSpec
from tessellm.core.plugin import Plugin, PluginOptions


class ModelArchitecture(Plugin):
    """Base of model plugins. Subclasses set ``name``, ``api_version``, ``model_types`` and
    implement ``spec`` and ``build``."""

    kind = "model"
    model_types: ClassVar[tuple[str, ...]] = ()
    """The Hugging Face ``model_type`` values this plugin builds."""
    auto_priority: ClassVar[int | None] = 0
    any_model_type: ClassVar[bool] = False
    """Whether this plugin tries any ``model_type`` (plugin API 1.17): under ``auto`` it takes a
    checkpoint no plugin declaring its type serves (none declares it, or the one that does
    refuses this variant), after all of them; named, it takes any checkpoint. Its ``spec``
    refuses what it cannot serve, naming why."""
    expert_layout: ClassVar[str] = "concatenated"
    """How the checkpoint stacks MoE experts as 3-D tensors (core/model/moe.py
    ``EXPERT_LAYOUTS``): the loader splits them per expert into Linear weights (and biases)
    before ``checkpoint_name`` maps the names (plugin API 1.8)."""
    tiny_config: ClassVar[dict[str, dict[str, Any]]] = {}
    """Per model_type, Hugging Face config fields of the tiny random checkpoint the model
    conformance suite builds for it (plugin API 1.15), e.g. ``{"gpt_neox": {"hidden_size":
    64, "num_attention_heads": 4, "rotary_pct": 0.5}}``: what the family needs to show its
    features in a few layers. Fields left out take transformers' defaults with every size
    capped small (``tessellm.testing.models.tiny_fields``); a suite's ``shapes`` override
    these."""
    required: ClassVar[tuple[str, ...]] = ("spec", "build")
    """Methods a model plugin must implement; the registry refuses to load one without them."""

    def __init__(self, options: PluginOptions | None = None):
        self.options = options if options is not None else self.Options()

    def spec(self, hf_config: Any) -> ModelSpec:
        """The model's shapes and numerics from its Hugging Face config (``transformers``'
        ``PretrainedConfig``); a ModelLoadError for a variant this plugin cannot serve."""
        raise NotImplementedError

    def build(self, spec: ModelSpec) -> nn.Module:
        """The module for ``spec``, made on the current (meta) device; parameters are
        loaded after by name (``checkpoint_name``)."""
        raise NotImplementedError

    def load_spec(self, hf_config: Any) -> ModelSpec:
        """``spec(hf_config)`` checked and stamped with this plugin's name (what the engine
        calls; override ``spec``)."""
        import dataclasses

        from tessellm.core.errors import PluginCallError

        spec = self.spec(hf_config)
        if not isinstance(spec, ModelSpec):
            raise PluginCallError(f"model plugin {self.name!r} (module {type(self).__module__}): spec returned "
                                  f"{type(spec).__name__}, not a tessellm ModelSpec")
        return dataclasses.replace(spec, architecture=self.name)

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter name checkpoint tensor ``name`` loads into (None: not used)."""
        return name

    def checkpoint_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under the module's parameter names (plugin API 1.17): by
        default experts stacked as 3-D tensors split per expert (``expert_layout``), then each
        name mapped by ``checkpoint_name`` (None: dropped). A plugin whose module joins or
        splits stored tensors (transformers' checkpoint conversions) overrides it."""
        from tessellm.core.model.moe import unstack_experts

        named: dict[str, torch.Tensor] = {}
        for name, tensor in unstack_experts(state, self.expert_layout).items():
            target = self.checkpoint_name(name)
            if target is not None:
                named[target] = tensor
        return named
    def image_processor(self, model_dir: Any, hf_config: Any) -> Any:
        """For a model whose spec has ``vision``: the ``ImageProcessor`` of the checkpoint in
        ``model_dir`` (``hf_config``: ``VisionSpec.hf_config``), which turns a prompt's text
        and images into token ids and processed images (plugin API 1.19). None: the model
        takes no images."""
        return None

    def shard_rule(self, name: str, spec: ModelSpec, shard: Any) -> Any:
        """How a tensor-parallel rank reads parameter ``name`` (after ``checkpoint_name``),
        where the family's differs from core's rules (core/parallel/shard.py ``slice_rule``):
        ``(dim, lo, hi)``, a list of dim-0 slices, "zero" or "whole"; None: core's rule
        (plugin API 1.8)."""
        return None

    def after_load(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """Fast paths once the weights are loaded. Outside float64 (the exact reference) q/k/v
        and gate/up become one GEMM each where the module's blocks read them stacked (fewer,
        larger products: on a CPU each saved call is a dispatch and, for int4, an activation
        conversion). On CUDA also the fused norm/RoPE/SwiGLU kernels where the module
        supports them, and MoE experts as batched products."""
        exact = dtype == torch.float64
        fast = device.type == "cuda" and not exact
        model.fused = fast and getattr(model, "supports_fused", False) and \
            importlib.util.find_spec("triton") is not None
        if not exact and hasattr(model, "fuse_projections"):
            model.fuse_projections()
        if fast and hasattr(model, "stack_experts"):
            model.stack_experts()

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {**super().describe(), "model_types": list(cls.model_types) or (["any"] if cls.any_model_type else [])}
