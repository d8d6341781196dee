"""GPT-OSS (openai/gpt-oss-20b, -120b): Llama's decoder with what differs, as transformers
computes it (models/gpt_oss/modeling_gpt_oss.py):

- attention with biases on q, k, v and o, and a learned sink logit per query head on every
  layer (``self_attn.sinks``: each softmax's denominator gains exp(sink), no value), which the
  attention backend applies (layer feature "sinks"; quest and mla decline it);
- sliding-window and full layers alternating as ``layer_types`` says (a window of
  ``sliding_window`` tokens on the sliding ones), YaRN RoPE (core's rope path, transformers'
  own initialiser, ``truncate`` included);
- every MLP a mixture of experts: a router with a bias picks the top k logits and weights them
  by a softmax over those k alone; each expert is a clamped SwiGLU with biases: gate clamped
  above at ``swiglu_limit``, up clamped to +-limit, out = down((up + 1) * gate *
  sigmoid(alpha * gate)), alpha ``swiglu_alpha`` (1.702);
- RMSNorm casting after the scaling (as Gemma), which only matters below float32.

The checkpoint stacks each layer's experts: ``experts.gate_up_proj`` [E, hidden, 2I] with
gate and up interleaved (gate the even columns), ``experts.down_proj`` [E, I, hidden], both
transposed against nn.Linear, and their biases stacked beside them (``expert_layout``
"interleaved_transposed": the loader splits them per expert). The experts here are one
nn.Linear per projection, with its bias (quantizers replace them one by one; tensor
parallelism splits each expert's columns as for any MoE).

MXFP4 checkpoints (the released ones) are refused with the way out: dequantize to bfloat16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import DecoderForCausalLM, DecoderLayer
from tessellm.core.model.spec import LayerAttention, ModelSpec, MoESpec, decoder_spec, refuse_quantized

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The ``layer_types`` this plugin serves."""

MXFP4_REFUSAL = ("gpt_oss checkpoint quantized with 'mxfp4' (MXFP4 expert weights) is not supported yet; "
                 "dequantize it to bfloat16 first: load it with transformers' AutoModelForCausalLM.from_pretrained("
                 "path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16) and save_pretrained "
                 "the result (or use a published bf16 conversion)")


class GptOssRMSNorm(nn.Module):
    """RMSNorm in float32, scaled, then cast to the input's dtype (transformers' order; the
    core RMSNorm casts before scaling, which differs only in bfloat16 and float16)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)  # a float64 weight keeps the product in float64


class GptOssRouter(nn.Module):
    """The router: logits = x W^T + b [T, E] in the model's dtype (as transformers and vLLM
    choose), the ``top_k`` largest per token, weighted by a softmax over those k alone (in
    float32 at least). Not an nn.Linear, so weight quantizers leave it in float."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.top_k = spec.moe.top_k
        self.weight = nn.Parameter(torch.empty(spec.moe.num_experts, spec.hidden_size))
        self.bias = nn.Parameter(torch.empty(spec.moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k] int64, weights [T, k], float32 or float64)."""
        logits = nn.functional.linear(x, self.weight, self.bias)  # [T, E]
        top, ids = logits.topk(self.top_k, dim=-1)
        return ids, top.to(torch.promote_types(top.dtype, torch.float32)).softmax(dim=-1)


class GptOssExpert(nn.Module):
    """One expert's projections, with biases."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width)
        self.up_proj = nn.Linear(hidden, width)
        self.down_proj = nn.Linear(width, hidden)


class GptOssExperts(nn.ModuleList):
    """The ``num_experts`` experts; ``run(e, x)`` is expert e's clamped SwiGLU."""

    def __init__(self, spec: ModelSpec):
        moe, config = spec.moe, spec.hf_config
        super().__init__(GptOssExpert(spec.hidden_size, moe.intermediate_size) for _ in range(moe.num_experts))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x [N, hidden] -> [N, hidden]."""
        expert = self[e]
        gate = expert.gate_proj(x).clamp(max=self.limit)
        up = expert.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return expert.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoE(nn.Module):
    """The MLP of every GPT-OSS layer: ``router`` then the weighted sum of the chosen
    ``experts``, each run once over the tokens routed to it (transformers' eager order)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.router = GptOssRouter(spec)
        self.experts = GptOssExperts(spec)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        ids, weights = self.router(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, pick = torch.where(ids == e)
            y = self.experts.run(e, x[token]) * weights[token, pick, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class GptOssDecoderLayer(DecoderLayer):
    """Pre-norm attention (biases, sinks: core's Attention as the spec says) then the MoE."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        self.input_layernorm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def make_mlp(self, spec: ModelSpec, layer: int) -> nn.Module:
        return GptOssMoE(spec)


class GptOssForCausalLM(DecoderForCausalLM):
    """GptOssForCausalLM: the decoder's contract around GPT-OSS layers. The fused CUDA
    kernels compute neither sinks nor the clamped SwiGLU, so they stay off."""

    layer_cls = GptOssDecoderLayer

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.model.norm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def cuda_graphs_unsupported(self) -> str | None:
        return "the model's mixture-of-experts layers size their work on the host (decode steps run eagerly)"


class GptOssArchitecture(ModelArchitecture):
    """GPT-OSS in bfloat16/float32 weights; MXFP4 checkpoints refused with the way out."""

    name = "gpt-oss"
    api_version = "1.19"
    model_types = ("gpt_oss",)
    expert_layout = "interleaved_transposed"

    def spec(self, hf_config: Any) -> ModelSpec:
        quant = getattr(hf_config, "quantization_config", None)
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if method == "mxfp4":
            raise ModelLoadError(MXFP4_REFUSAL)
        refuse_quantized(hf_config, "unquantized (bfloat16/float32) weights")
        layers = _layer_attention(hf_config)
        windows = {a.sliding_window for a in layers}
        moe = MoESpec(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                      intermediate_size=hf_config.intermediate_size,
                      sparse_layers=frozenset(range(hf_config.num_hidden_layers)), softmax_after_topk=True)
        bias = bool(getattr(hf_config, "attention_bias", True))
        return decoder_spec(hf_config, qkv_bias=bias, o_bias=bias, moe=moe, layer_attention=layers,
                            sliding_window=windows.pop() if len(windows) == 1 else None)

    def build(self, spec: ModelSpec) -> nn.Module:
        return GptOssForCausalLM(spec)


def _layer_attention(config: Any) -> tuple[LayerAttention, ...]:
    """One LayerAttention per layer from ``layer_types``, every one with sinks: a window of
    ``sliding_window`` tokens on the sliding layers (none where the config has no window)."""
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ModelLoadError(f"gpt_oss layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    if len(types) != config.num_hidden_layers:
        raise ModelLoadError(f"gpt_oss layer_types lists {len(types)} layers, but num_hidden_layers is "
                             f"{config.num_hidden_layers}; give one type per layer")
    window = getattr(config, "sliding_window", None)
    return tuple(LayerAttention(sliding_window=window if t == "sliding_attention" else None, sinks=True)
                 for t in types)


@tessellm.hookimpl
def register_model(register):
    register(GptOssArchitecture)
