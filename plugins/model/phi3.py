"""Phi-3 and Phi-4 (model_type "phi3"): Llama's pre-norm block with the checkpoint's fused
projections (``qkv_proj``: q, k and v rows stacked; ``gate_up_proj``: gate rows, then up),
RoPE on the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75) and the config's
``sliding_window`` on every layer (transformers masks every layer with it).

LongRoPE (Phi-3-mini-128k, Phi-4-mini) is served as transformers serves it while a
sequence is at most ``original_max_position_embeddings`` long: the ``short_factor``
frequencies with LongRoPE's attention factor. Past that length transformers switches the
whole forward's frequencies to ``long_factor``, which depends on how the sequence was cut
into forwards (prompt at once, then a token at a time) and would make cached keys depend on
the prompt's length; the context is therefore limited to the original length (the spec's
``max_position_embeddings``), and a longer ``max_model_len`` is refused."""

from __future__ import annotations

import copy
import logging
from typing import Any

from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import MLP, Attention, DecoderForCausalLM, DecoderLayer
from tessellm.core.model.spec import ModelSpec, decoder_spec, refuse_quantized

log = logging.getLogger(__name__)


class Phi3Attention(Attention):
    """Attention whose q, k and v come from one ``qkv_proj`` (as the checkpoint has them):
    core's Attention already runs that layout once its projections are stacked."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        del self.q_proj, self.k_proj, self.v_proj
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, rows, bias=spec.qkv_bias)

    def fuse_projections(self) -> None:
        """Already fused."""


class Phi3MLP(MLP):
    """The gated MLP with gate and up in one ``gate_up_proj`` (gate rows first)."""

    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None):
        super().__init__(spec, intermediate_size)
        width = self.down_proj.in_features
        del self.gate_proj, self.up_proj
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * width, bias=spec.mlp_bias)

    def fuse_projections(self) -> None:
        """Already fused."""


class Phi3DecoderLayer(DecoderLayer):
    """Llama's pre-norm layer over the fused attention and MLP."""

    def make_attention(self, spec: ModelSpec, layer: int) -> nn.Module:
        return Phi3Attention(spec, layer)

    def make_mlp(self, spec: ModelSpec, layer: int) -> nn.Module:
        return Phi3MLP(spec)


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi3ForCausalLM: the plain decoder over fused projections (the CUDA fused path runs it
    where its rotary covers whole heads; partial rotary is not what its kernels rotate)."""

    layer_cls = Phi3DecoderLayer


class Phi3Architecture(ModelArchitecture):
    """Phi-3 / Phi-4: fused qkv and gate_up, partial rotary, a window on every layer;
    LongRoPE within its original context."""

    name = "phi3"
    api_version = "1.19"
    model_types = ("phi3",)

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0
        rotary = int(head_dim * factor)  # transformers' rounding (its init functions use the same)
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise ModelLoadError(f"phi3 partial_rotary_factor {factor} rotates {rotary} of {head_dim} head dims; "
                                 f"allowed: an even count between 2 and {head_dim}")
        fields = dict(rotary_dim=rotary if rotary < head_dim else None, qkv_bias=False, o_bias=False, mlp_bias=False)
        if (params.get("rope_type") or params.get("type")) == "longrope":
            return _longrope_spec(hf_config, params, fields)
        return decoder_spec(hf_config, **fields)

    def build(self, spec: ModelSpec) -> nn.Module:
        return Phi3ForCausalLM(spec)


def _longrope_spec(config: Any, params: dict, fields: dict) -> ModelSpec:
    """The spec of a LongRoPE checkpoint, limited to ``original_max_position_embeddings``
    tokens: below it transformers rotates by the short factors (what ``ModelSpec.inv_freq``
    computes from the config, LongRoPE's attention factor included), past it by the long
    ones for whole forwards at a time, which a paged, chunked, prefix-cached engine cannot
    reproduce. decoder_spec refuses the type, so it reads a copy whose RoPE says default,
    and the real config is put back."""
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                          None)
    for key in ("short_factor", "long_factor"):
        if not params.get(key):
            raise ModelLoadError(f"phi3 LongRoPE config lacks rope_parameters[{key!r}]; a longrope checkpoint "
                                 f"lists short_factor and long_factor")
    if not original:
        raise ModelLoadError("phi3 LongRoPE config lacks original_max_position_embeddings (the context the short "
                             "factors serve)")
    limit = min(int(original), config.max_position_embeddings)
    if limit < config.max_position_embeddings:
        log.warning("phi3 LongRoPE: context limited to original_max_position_embeddings=%d (of %d): past it "
                    "transformers switches every position to long_factor frequencies per forward, which tessellm "
                    "does not reproduce", limit, config.max_position_embeddings)
    shadow = copy.copy(config)
    shadow.rope_parameters = {**params, "rope_type": "default"}
    return decoder_spec(shadow, hf_config=config, rope_type="longrope", max_position_embeddings=limit, **fields)


@tessellm.hookimpl
def register_model(register):
    register(Phi3Architecture)
