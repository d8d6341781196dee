"""Toyformer in transformers: the reference implementation its tessellm plugin is checked
against, and what saves its checkpoints. Importing this module registers the config and the
model with transformers' Auto classes (model_type "toyformer")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class ToyformerConfig(PretrainedConfig):
    model_type = "toyformer"

    def __init__(self, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                 max_position_embeddings=512, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.rms_norm_eps, self.rope_theta = num_key_value_heads, rms_norm_eps, rope_theta
        self.max_position_embeddings = max_position_embeddings
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE over the head dim's two halves; x [B, H, S, D]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [S, D/2]
    cos, sin = torch.cat((angles, angles), -1).cos().to(x.dtype), torch.cat((angles, angles), -1).sin().to(x.dtype)
    rotated = torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)
    return x * cos + rotated * sin


class ToyformerLayer(nn.Module):
    """x + attention(norm(x)) + mlp(norm(x)): one norm, both branches in parallel."""

    def __init__(self, config: ToyformerConfig):
        super().__init__()
        h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = heads, kv, h // heads
        self.eps, self.theta = config.rms_norm_eps, config.rope_theta
        self.ln = nn.Parameter(torch.ones(h))
        self.wq, self.wk = nn.Linear(h, h, bias=False), nn.Linear(h, kv * self.head_dim, bias=False)
        self.wv, self.wo = nn.Linear(h, kv * self.head_dim, bias=False), nn.Linear(h, h, bias=False)
        self.w_gate = nn.Linear(h, config.intermediate_size, bias=False)
        self.w_up = nn.Linear(h, config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = _rms_norm(x, self.ln, self.eps)
        positions = torch.arange(s)
        q = _rotate(self.wq(h).view(b, s, self.heads, -1).transpose(1, 2), positions, self.theta)
        k = _rotate(self.wk(h).view(b, s, self.kv_heads, -1).transpose(1, 2), positions, self.theta)
        v = self.wv(h).view(b, s, self.kv_heads, -1).transpose(1, 2)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim ** 0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        return x + self.wo(attn) + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class ToyformerForCausalLM(PreTrainedModel):
    config_class = ToyformerConfig
    base_model_prefix = "toy"

    def __init__(self, config: ToyformerConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(ToyformerLayer(config) for _ in range(config.num_hidden_layers))
        self.final_ln = nn.Parameter(torch.ones(config.hidden_size))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> CausalLMOutput:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return CausalLMOutput(logits=self.head(_rms_norm(x, self.final_ln, self.config.rms_norm_eps)))


AutoConfig.register("toyformer", ToyformerConfig, exist_ok=True)
AutoModelForCausalLM.register(ToyformerConfig, ToyformerForCausalLM, exist_ok=True)
