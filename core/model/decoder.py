"""The building blocks of a decoder-only transformer over packed batches, and the decoder
they make: RMSNorm and LayerNorm, rotary embeddings (whole or partial), attention through the
configured backend (with an optional per-head q/k norm), the MLP (gated or plain), a pre-norm
layer (sequential, or with a parallel residual) that takes the MoE block where the spec says
so, and ``DecoderForCausalLM``: Llama's architecture by default, which model plugins
(plugins/model/) use as it is, set through the spec, or change a block of.

Module and parameter names follow Hugging Face's Llama, so such a checkpoint's state dict
loads as is (a model plugin maps other names). There is no padding: activations are
[num_tokens, hidden]; attention goes through the configured backend, which reads and writes
the cache.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessellm.core.interfaces.attention import AttentionBackend
from tessellm.core.interfaces.batch import LayerPlans
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.model.contract import checked_call
from tessellm.core.model.mlp import ACTIVATIONS, MLP, _stacked  # noqa: F401 (MLP and ACTIVATIONS: their old home)
from tessellm.core.model.moe import MoE
from tessellm.core.interfaces.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":  # one call, the same bits as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()  # normalise in float32 whatever the compute dtype, as transformers does
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * weight + bias (``bias``
    False: none), in the input's dtype as torch's and transformers' ``nn.LayerNorm`` compute
    it (GPT-NeoX, Phi-2, Falcon). Parameters ``weight`` and ``bias``, as checkpoints name them."""

    def __init__(self, size: int, eps: float, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


NORMS = {"rms_norm": RMSNorm, "layer_norm": LayerNorm}
"""The norm block of each ``ModelSpec.norm``."""


def make_norm(spec: ModelSpec, size: int | None = None) -> nn.Module:
    """The spec's norm (``spec.norm``: RMSNorm or LayerNorm, epsilon ``spec.rms_norm_eps``)
    over ``size`` values (default the hidden size): what ``DecoderLayer`` and the final norm use."""
    if spec.norm not in NORMS:
        raise ValueError(f"ModelSpec.norm {spec.norm!r} is not a norm core builds; allowed: {', '.join(NORMS)}")
    return NORMS[spec.norm](size or spec.hidden_size, spec.rms_norm_eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the batch's positions (RoPE, with the model's scaling type; ``table``
    one of the spec's rotary tables where layers differ)."""

    def __init__(self, spec: ModelSpec, table: str = "default"):
        super().__init__()
        inv_freq, self.scaling = spec.inv_freq(table)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, H, D] with cos, sin [T, 1, R]: the first R dims rotate (halves paired,
    as in Llama), the rest pass through (partial rotary, R < D)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class Attention(nn.Module):
    """q/k/v projections, RoPE and the backend's attention, then ``o_proj``. With
    ``spec.qk_norm`` each head's query and key go through an RMSNorm over the head dim
    (``q_norm``, ``k_norm``) before RoPE (Qwen3, OLMo-style per-head norms). The layer's
    ``LayerAttention`` decides whether RoPE applies (cos None: not on this layer) and
    whether it has per-head ``sinks`` (a parameter, handed to the backend)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.layer = layer
        self.features = spec.attention_of(layer)
        if self.features.sinks:
            self.sinks = nn.Parameter(torch.zeros(spec.num_heads))
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        h = spec.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.qkv_proj: nn.Linear | None = None
        self.backend_checked = False  # whether the attention backend's output has met its contract once

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj by one ``qkv_proj`` (their weights stacked): one GEMM, not three.
        A subclass with its own ``forward`` (which may read q_proj) keeps them apart."""
        if self.qkv_proj is not None or type(self).forward is not Attention.forward:
            return
        stacked = _stacked(q_proj=self.q_proj, k_proj=self.k_proj, v_proj=self.v_proj)
        if stacked is not None:  # else parts no stack joins stay apart
            self.qkv_proj = stacked
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, cache: CacheManager, plan: Any, fused: bool = False) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None and not (fused or self.qk_norm or cos is None):
            return self.o_proj(self._attend_stacked(self.qkv_proj(x), cos, sin, backend, cache, plan).reshape(t, -1))
        if self.qkv_proj is not None:  # views into one [T, (Hq + 2 Hkv) D] output
            q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                              self.num_kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attend(q, k, v, cos, sin, backend, cache, plan, fused).reshape(t, -1))

    def _attend_stacked(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                        cache: CacheManager, plan: Any) -> torch.Tensor:
        """``attend`` from the stacked projection's output [T, (Hq + 2 Hkv) D], q and k rotated
        in one pass over their adjacent heads (half the small operations of rotating each)."""
        t, hq, hkv = qkv.shape[0], self.num_heads, self.num_kv_heads
        heads = qkv.view(t, hq + 2 * hkv, self.head_dim)
        qk = apply_rotary(heads[:, :hq + hkv], cos[:, None, :], sin[:, None, :])
        q, k = qk[:, :hq], qk[:, hq:]
        if t > 1:  # backends get q and k whole, as rotating them apart gives them
            q, k = q.contiguous(), k.contiguous()
        return self.attend(q, k, heads[:, hq + hkv:], None, None, backend, cache, plan)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
               sin: torch.Tensor | None, backend: AttentionBackend, cache: CacheManager, plan: Any,
               fused: bool = False) -> torch.Tensor:
        """RoPE (unless cos is None) and the backend's attention: q [T, Hq, D], k, v [T, Hkv,
        D] -> [T, Hq, D]. Family modules that make their own q, k, v call this."""
        if not fused and cos is not None:
            cos, sin = cos[:, None, :], sin[:, None, :]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.backend_checked:
            out = self._attend(backend, fused, q, k, v, cos, sin, cache, plan)
        else:  # the backend's first call: a broken plugin is named here, not deep in a step
            out = checked_call(backend, "forward_rotary" if fused else "forward", q,
                               lambda: self._attend(backend, fused, q, k, v, cos, sin, cache, plan))
            self.backend_checked = True
        return out

    def _attend(self, backend: AttentionBackend, fused: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, cache: CacheManager, plan: Any) -> torch.Tensor:
        if type(plan) is LayerPlans:  # a plan per block table: this layer's group's
            plan = plan.for_layer(self.layer)
        # only a layer with sinks passes them: a backend that serves none takes no such argument
        extra = {"sinks": self.sinks.to(torch.promote_types(self.sinks.dtype, torch.float32))} \
            if self.features.sinks else {}
        if fused:  # the backend rotates q and k (with the KV store, where it can fuse them)
            return backend.forward_rotary(self.layer, q, k, v, cos, sin, cache.layer(self.layer), plan, **extra)
        return backend.forward(self.layer, q, k, v, cache.layer(self.layer), plan, **extra)  # [T, Hq, D]


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP (or MoE), each added to the residual; or, with
    ``spec.parallel_residual``, both from the same residual and added together,
    x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x)) (GPT-NeoX). The norms are
    ``make_norm(spec)``'s (RMSNorm, or LayerNorm with bias); subclasses choose attention and
    MLP (``make_attention``, ``make_mlp``)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.self_attn = self.make_attention(spec, layer)
        self.mlp = self.make_mlp(spec, layer)
        self.input_layernorm = make_norm(spec)
        self.post_attention_layernorm = make_norm(spec)
        self.parallel_residual = spec.parallel_residual
        self.tp: Any = None  # tensor parallel: attention and MLP outputs are partial sums over ranks

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.all_reduce(x)

    def make_attention(self, spec: ModelSpec, layer: int) -> nn.Module:
        return Attention(spec, layer)

    def make_mlp(self, spec: ModelSpec, layer: int) -> nn.Module:
        """The gated MLP, or the mixture of experts on the layers ``spec.moe`` makes sparse."""
        if spec.moe is not None and spec.moe.is_sparse(layer):
            return MoE(spec)
        return MLP(spec)

    def forward(self, x, cos, sin, backend, cache, plan):
        if self.parallel_residual:  # one reduction for both branches' partial sums
            attn = self.self_attn(self.input_layernorm(x), cos, sin, backend, cache, plan)
            return x + self._reduce(attn + self.mlp(self.post_attention_layernorm(x)))
        x = x + self._reduce(self.self_attn(self.input_layernorm(x), cos, sin, backend, cache, plan))
        return x + self._reduce(self.mlp(self.post_attention_layernorm(x)))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, backend, cache,
                      plan) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the residual adds folded into the norms after them (fused
        kernels): takes and returns (output not yet added, running residual)."""
        from tessellm.core.model.fused_ops import add_rmsnorm

        norm = self.input_layernorm
        h, residual = add_rmsnorm(x, residual, norm.weight, norm.eps)
        h = self._reduce(self.self_attn(h, cos, sin, backend, cache, plan, fused=True))
        norm = self.post_attention_layernorm
        h, residual = add_rmsnorm(h, residual, norm.weight, norm.eps)
        return self._reduce(self.mlp(h, fused=True)), residual


class HeldElsewhere(nn.Module):
    """A part of the model another pipeline stage holds (a decoder layer, the embedding, the
    final norm or the LM head): no weights here, never run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this part of the model is held by another pipeline stage")


class NoLMHead(nn.Module):
    """The LM head of a pooling pipeline whose pooler reads none (``drop_lm_head``): no
    weights (a base-model checkpoint, Qwen3Model's, has none to load), never run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this pipeline pools hidden states and keeps no LM head")


class DecoderBody(nn.Module):
    def __init__(self, spec: ModelSpec, layer_cls: type[DecoderLayer] = DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layer_cls(spec, i) for i in range(spec.num_layers))
        self.norm = make_norm(spec)


class DecoderForCausalLM(nn.Module):
    """The whole decoder. ``forward`` returns float32 logits (float64 in a float64 pipeline)
    for the requested rows only. With ``fused`` set (on CUDA, by ``build_model``) the norms,
    residual adds, RoPE and SwiGLU run as fused Triton kernels (core/fused_ops.py).

    Model plugins for other decoder-only families change ``layer_cls``; whether the fused
    path applies is found from what they override (``supports_fused``)."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    @property
    def supports_fused(self) -> bool:
        """Whether the fused kernels run this model as its own forward would: the fused path
        replaces ``DecoderLayer.forward`` (norms and residual adds) and calls its blocks with
        ``fused`` (RoPE, SwiGLU), so it applies only where every layer keeps that forward and
        core's attention and MLP (or MoE) forwards, rotates whole heads, and has RMSNorms and
        sequential layers. A family that overrides any of them runs its own forward on every
        device, CUDA included."""
        spec = self.spec
        if None in self.layer_rope or spec.rope_dim != spec.head_dim or spec.norm != "rms_norm" or \
                spec.parallel_residual:  # the fused path folds residual adds into RMSNorms of sequential layers
            return False
        for layer in self.held_layers():
            if type(layer).forward is not DecoderLayer.forward or type(layer).forward_fused is not \
                    DecoderLayer.forward_fused or type(layer.self_attn).forward is not Attention.forward or \
                    type(layer.mlp).forward not in (MLP.forward, MoE.forward):
                return False
        return True

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.fused = False
        self.model = DecoderBody(spec, self.layer_cls)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_rotary(None)
        self.layer_rope = [spec.attention_of(i).rope for i in range(spec.num_layers)]

    def reset_rotary(self, device: torch.device | None) -> None:
        """(Re)make the rotary tables on ``device`` (their buffers are not in the checkpoint,
        so the loader calls this once the module leaves the meta device): ``rotary`` the
        default table, ``rotaries`` every table some layer uses."""
        names = self.spec.rope_table_names() or ["default"]
        self.rotaries = {name: RotaryEmbedding(self.spec, name).to(device) for name in names}
        self.rotary = self.rotaries.get("default") or RotaryEmbedding(self.spec).to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of ``input_ids`` [T] -> [T, hidden] (families that scale it
        override this)."""
        return self.model.embed_tokens(input_ids)

    def merge_images(self, x: torch.Tensor, positions: torch.Tensor, images: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The input embeddings with the step's image embeddings written over their placeholder
        rows, and the positions to rotate by (an M-RoPE model's 3-D ones where the batch has
        them): x [T, hidden], images a ``MultimodalBatch``."""
        if images.rows.numel():
            x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        return x, positions if images.positions is None else images.positions

    adjusts_logits = False
    """Whether ``adjust_logits`` changes the LM head's output (a family's softcap or scale)."""

    def adjust_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output as the family's logits (Gemma 2's final softcap, Granite's
        logits_scaling); identity here."""
        return logits

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list:
        """(cos, sin) per layer for the batch's positions, each table computed once; (None,
        None) for a layer without RoPE."""
        tables = {name: rotary(positions, dtype) for name, rotary in self.rotaries.items()}
        return [tables[name] if name is not None else (None, None) for name in self.layer_rope]

    def tie_weights(self) -> None:
        """The LM head shares the input embedding's matrix (tie_word_embeddings)."""
        if not isinstance(self.lm_head, (HeldElsewhere, NoLMHead)):
            self.lm_head.weight = self.model.embed_tokens.weight

    def drop_lm_head(self) -> None:
        """Keep no LM head (on the meta device, before loading): a pooling pipeline whose
        pooler reads hidden states only (``forward(..., hidden_states=True)``)."""
        self.lm_head = NoLMHead()

    def lm_head_rows(self, token_ids: list[int]) -> torch.Tensor:
        """Rows ``token_ids`` of the LM head's weight, [n, hidden] (a yes/no reranker's two)."""
        if not isinstance(self.lm_head, nn.Linear):
            raise RuntimeError(f"the LM head is a {type(self.lm_head).__name__}, whose rows cannot be read")
        return self.lm_head.weight[token_ids]

    stage: Any = None
    """The pipeline stage this module runs (``hold_stage``); None: the whole model."""

    def hold_stage(self, stage: Any) -> None:
        """Keep only what pipeline stage ``stage`` (a ``PipelineStage``) runs, on the meta
        device before loading: its decoder layers, the embedding on the first stage (and on
        the last where the LM head shares it), the final norm and LM head on the last. The
        rest become ``HeldElsewhere``; layers keep their indices (and checkpoint names)."""
        self.stage = stage
        lo, hi = stage.layers
        for i in range(len(self.model.layers)):
            if not lo <= i < hi:
                self.model.layers[i] = HeldElsewhere()
        if not stage.holds("model.embed_tokens.weight", self.spec.tie_word_embeddings):
            self.model.embed_tokens = HeldElsewhere()
        if not stage.last:
            self.model.norm = HeldElsewhere()
            self.lm_head = HeldElsewhere()

    def held_layers(self) -> list[nn.Module]:
        """The decoder layers this module holds (every one, unless it runs a pipeline stage)."""
        return [layer for layer in self.model.layers if not isinstance(layer, HeldElsewhere)]

    def set_tensor_parallel(self, tp: Any) -> None:
        """Sum each layer's attention and MLP outputs over the ranks of ``tp`` (a
        ``TensorParallel``): this model holds one rank's share of the heads and columns."""
        for layer in self.held_layers():
            layer.tp = tp

    def fuse_projections(self) -> None:
        """Stack each layer's q/k/v and gate/up projections into one GEMM each (fewer, larger
        launches; the module names change, so do this after loading the checkpoint). An MoE
        layer's experts stay apart (``stack_experts`` batches them)."""
        for layer in self.held_layers():
            if isinstance(layer.self_attn, Attention):
                layer.self_attn.fuse_projections()
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse_projections()

    def cuda_graphs_unsupported(self) -> str | None:
        """Why this module's decode forward cannot be captured in a CUDA graph (None: it can):
        an MoE block sizes its work by the tokens each expert got, read on the host."""
        if self.moe_layers():
            return "the model's mixture-of-experts layers size their work on the host (decode steps run eagerly)"
        return None

    def moe_layers(self) -> list[MoE]:
        """The mixture-of-experts blocks, in layer order."""

        return [layer.mlp for layer in self.held_layers() if isinstance(layer.mlp, MoE)]

    def stack_experts(self) -> None:
        """Switch every MoE block to its grouped path (stacked expert weights)."""
        for moe in self.moe_layers():
            moe.stack_experts()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                backend: AttentionBackend, cache: CacheManager, plan: Any,
                layers: Sequence[int] | None = None, logits_out: torch.Tensor | None = None,
                native_logits: bool = False, hidden_states: bool = False, images: Any = None) -> torch.Tensor:
        """input_ids, positions [T] -> logits [len(logits_indices), vocab], float32 (float64
        in a float64 model) or, with ``native_logits``, in the LM head's own dtype (bfloat16
        in a bfloat16 model: no float32 copy, for callers that only rank them). A pipeline
        stage other than the last sends its hidden states on and returns None. With
        ``hidden_states`` (a pooling pipeline): those rows' final hidden states (after the
        final norm), [len(logits_indices), hidden] in the model's dtype, and no LM head.

        ``layers`` runs a subset of the decoder layers (self-drafting by layer skipping);
        ``logits_out`` receives the logits, which are then returned (a captured graph's
        static output); in the LM head's dtype, the GEMM writes it directly. ``images``: a
        step's image inputs (a ``MultimodalBatch``, for a model that takes images; None: none),
        written over their rows' input embeddings (``merge_images``)."""
        stage = self.stage
        if stage is None or stage.first:
            x = self.embed(input_ids)  # [T, hidden]
        else:  # the stage before ran the layers up to ours
            x = stage.receive(input_ids.shape[0], self.spec.hidden_size)
        if images is not None:
            x, positions = self.merge_images(x, positions, images)
        rope = self._rope(positions, x.dtype)
        order = range(len(self.model.layers)) if layers is None else layers
        if stage is not None:
            order = [i for i in order if stage.layers[0] <= i < stage.layers[1]]
        if self.fused:
            from tessellm.core.model.fused_ops import add_rmsnorm

            residual = None
            for i in order:
                x, residual = self.model.layers[i].forward_fused(x, residual, *rope[i], backend, cache, plan)
            if stage is not None and not stage.last:
                stage.send(x if residual is None else x + residual)  # the next stage's first layer adds nothing
                return None
            if residual is not None:  # norm is per row: select first, then add and normalise
                x, _ = add_rmsnorm(x[logits_indices], residual[logits_indices], self.model.norm.weight,
                                   self.model.norm.eps)
            else:
                x = self.model.norm(x[logits_indices])
        else:
            for i in order:
                x = self.model.layers[i](x, *rope[i], backend, cache, plan)
            if stage is not None and not stage.last:
                stage.send(x)
                return None
            x = self.model.norm(x[logits_indices])  # norm is per row: select first, then normalise
        if hidden_states:
            return x
        head = self.lm_head
        if logits_out is not None and type(head) is nn.Linear and head.bias is None and \
                logits_out.dtype == head.weight.dtype == x.dtype and not self.adjusts_logits:
            return torch.mm(x, head.weight.t(), out=logits_out)  # no [rows, vocab] temporary to copy
        logits = self.adjust_logits(head(x))
        if logits_out is not None:
            return logits_out.copy_(logits)
        if native_logits or logits.dtype == torch.float64:  # float64 stays exact
            return logits
        return logits.float()


LlamaForCausalLM = DecoderForCausalLM
"""Llama's architecture is the plain decoder (the name older code imports)."""
