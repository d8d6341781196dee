"""Attention `flash`: a Triton FlashAttention-2 forward over packed varlen batches, reading
K/V straight from the paged cache through the block tables (no gather).

Prefills and prefill chunks after cached context run through the prefill kernel
(prefill.py), single-token decodes through the split-K decode kernel (decode.py); GQA/MQA map query heads onto their KV head; head dims
up to 256 (padded to a power of two); causal, with every layer feature (plugin API 1.8) each
layer asks for: a sliding window (its own per layer), a logit softcap and attention sinks,
each a compile-time switch of the kernels, so a layer without them runs the same code as before.

On CUDA this is the fast path. On a CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before the first kernel call): slow, but it lets the kernels be
tested, and whole pipelines be run, on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from tessellm.core.interfaces.attention import AttentionBackend
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.kv import KVStorage
from tessellm.core.model.spec import LayerAttention
from tessellm.core.model.triton_support import triton_device_reasons
from tessellm.core.plugin import PluginOptions, SelectionContext


class FlashOptions(PluginOptions):
    """Options of the `flash` attention backend (tile sizes: powers of two, at least 16)."""

    block_m: int | None = Field(None, ge=16, le=256)
    """Query rows per prefill program (None: the tuned default for the head dim and device)."""
    block_n: int | None = Field(None, ge=16, le=256)
    """Keys per inner-loop step of both kernels (None: the tuned default)."""
    split_decode: bool = True
    """Run decodes (query length 1) through the split-K flash-decoding kernel."""
    decode_splits: int | None = Field(None, ge=1, le=64)
    """Splits of each decode's context (None: enough programs to fill the GPU)."""
    packed_prefill: bool = True
    """Read a prefill's own new keys and values from the step's packed K/V rows through TMA
    descriptors (contiguous rows, no block-table gather) where the shapes allow it (a
    power-of-two head dim, a layer without a sliding window); earlier context still comes from
    the cache.
    Same results as the gather, and faster on a GPU (bench/kernels.py --sweep; docs/benchmarks.md,
    "Prefill")."""


@dataclass
class _Seqs:
    """Kernel arguments for a subset of the step's sequences (int32 tensors on the device)."""

    query_start: torch.Tensor  # [B] first packed row
    query_lens: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] context length after this step
    block_tables: torch.Tensor  # [B, max_blocks]
    max_query_len: int
    max_seq_len: int

    @classmethod
    def of(cls, batch: BatchMetadata, index: list[int], qsl: list[int]) -> "_Seqs":
        device = batch.input_ids.device
        # one upload from pinned memory, not blocking: a plain copy would wait for the GPU to
        # finish the step in flight (async scheduling plans this one while it runs). Rows are
        # padded to 16 bytes: Triton compiles another variant for a pointer that is not aligned
        n = len(index)
        host = torch.zeros(3, -(-n // 4) * 4, dtype=torch.int32)
        host[0, :n] = torch.tensor([qsl[i] for i in index], dtype=torch.int32)
        host[1, :n] = torch.tensor([batch.query_lens_cpu[i] for i in index], dtype=torch.int32)
        host[2, :n] = torch.tensor(index, dtype=torch.int32)
        starts, lens, pick = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)[:, :n]
        return cls(starts, lens,
                   batch.seq_lens.index_select(0, pick), batch.block_tables.index_select(0, pick).to(torch.int32),
                   max((batch.query_lens_cpu[i] for i in index), default=0),
                   max((batch.seq_lens_cpu[i] for i in index), default=0))


@dataclass
class FlashPlan:
    """Per-step kernel arguments shared by every layer: decodes (query length 1) go to the
    split-K decode kernel, everything else to the varlen prefill kernel."""

    slot_mapping: torch.Tensor
    decodes: _Seqs | None
    others: _Seqs | None
    block_size: int
    decode_splits: int | None = None
    """Fixed split count of the decode kernel (a captured graph); None: per step."""


def _scales(kv: KVStorage) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An int8 storage's K and V scales, (None, None) for a floating-point one."""
    return kv.kv_scales() if kv.layout.dtype == torch.int8 else (None, None)


class FlashAttention(AttentionBackend):
    """Triton varlen FlashAttention over the paged cache's raw K/V tensors.

    Reads "kv" storage in float16/bfloat16/float32 or int8 with per-token scales (the
    `paged` cache's ``kv_dtype: int8``; dequantized tile by tile inside the kernels, the
    packed prefill off so every key is read as stored). Tested against the
    float64 reference (``tessellm.testing.attention``) under the Triton interpreter on CPU and
    compiled on a GPU. ``auto`` picks it on CUDA (it beats SDPA's flash backend there, see
    docs/benchmarks.md), never on a CPU, where it only runs interpreted. Supports CUDA graphs
    (a plan serves every layer: the layer features are arguments of each layer's launch).

    Serves every layer feature but a window on a bidirectional layer: each forward reads its
    layer's ``LayerAttention`` (window, softcap, causal) and takes the layer's ``sinks``; the
    kernels apply the cap to the scaled scores inside the tile loop and fold the sinks into
    the final normalisation (the split-K decode's merge, once); an encoder's layer runs the
    prefill kernel with every row seeing the whole context.
    """

    name = "flash"
    api_version = "1.19"
    description = "Triton FlashAttention over packed varlen batches, K/V read through block tables"
    Options = FlashOptions
    auto_priority = 30
    cache_formats = frozenset({"kv"})
    cache_dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.int8})
    head_dims = None
    supports_cuda_graphs = True
    layer_features = frozenset({"sliding_window", "per_layer_window", "softcap", "sinks", "bidirectional"})

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx) + triton_device_reasons(ctx)
        if ctx.model.head_dim > 256:
            reasons.append(f"supports head dims up to 256, the model has {ctx.model.head_dim}")
        for name in ("block_m", "block_n"):
            value = getattr(ctx.options, name)
            if value is not None and value & (value - 1):
                reasons.append(f"{name} must be a power of two, not {value}")
        return reasons

    def plan(self, batch: BatchMetadata, cache: CacheManager) -> FlashPlan:
        return self.plan_members(batch, range(batch.num_seqs))

    def plan_members(self, batch: BatchMetadata, members) -> FlashPlan:
        """The plan for the batch's sequences ``members`` only: ``attend`` then writes their
        rows alone (for a backend, such as `quest`, that attends the others itself)."""
        qsl = batch.query_starts_cpu
        split = self.options.split_decode
        lens = batch.query_lens_cpu
        decodes = [i for i in members if lens[i] == 1 and split]
        others = [i for i in members if not (lens[i] == 1 and split)]
        return FlashPlan(batch.slot_mapping, _Seqs.of(batch, decodes, qsl) if decodes else None,
                         _Seqs.of(batch, others, qsl) if others else None, batch.block_size)

    def graph_plan(self, batch: BatchMetadata, cache: CacheManager, max_seq_len: int) -> FlashPlan:
        """Every row through the split-K decode kernel, its split count fixed for the longest
        context (a split past a shorter context's end does no work)."""
        from tessellm.plugins.attention.flash.decode import decode_config, default_num_splits

        n = batch.num_seqs
        seqs = _Seqs(batch.query_start_loc[:n], torch.ones_like(batch.seq_lens), batch.seq_lens,
                     batch.block_tables, 1, max_seq_len)
        splits = self.options.decode_splits or default_num_splits(
            n, self.model.num_kv_heads, max_seq_len, decode_config(self.model.head_dim, self.device,
                                                                   self.options.block_n).block_n)
        return FlashPlan(batch.slot_mapping, seqs, None, batch.block_size, splits)

    def warm_up_shapes(self, max_step_tokens: int, max_model_len: int) -> list[list[tuple[int, int]]]:
        """Besides the runner's full prefill step (the prefill kernel) and short decode (the
        decode kernel in one split, no merge): a prefill chunk beside a decode over the longest
        context, which splits the decode and launches the merge kernel."""
        chunk = min(2, max_model_len)
        return [[(chunk, chunk), (1, max_model_len)]]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVStorage, plan: FlashPlan, sinks: torch.Tensor | None = None) -> torch.Tensor:
        kv.store(k, v, plan.slot_mapping)
        return self.attend(q.contiguous(), k, v, kv, plan, attention=self.layer_attention(layer), sinks=sinks)

    def forward_rotary(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, kv: KVStorage, plan: FlashPlan,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE and the KV store in one kernel (``rope_store``), which also leaves q contiguous
        and k rotated in place for the packed prefill."""
        from tessellm.plugins.attention.flash.rope_store import rope_store

        k_cache, v_cache = kv.kv_tensors()
        q = rope_store(q, k, v, cos, sin, k_cache, v_cache, plan.slot_mapping, *_scales(kv))
        return self.attend(q, k, v, kv, plan, attention=self.layer_attention(layer), sinks=sinks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVStorage, plan: FlashPlan,
               out: torch.Tensor | None = None, attention: LayerAttention | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the cache for the plan's sequences, the step's k, v already stored;
        q contiguous. Their rows are written into ``out`` (a new tensor if None), others'
        rows are left as they are. ``attention``: the layer's window and softcap (None: the
        model-wide window, no cap); ``sinks`` [Hq]: the layer's sink logits."""
        # late: Triton reads TRITON_INTERPRET when the kernels are defined
        from tessellm.plugins.attention.flash.decode import paged_decode_attention
        from tessellm.plugins.attention.flash.prefill import paged_flash_attention

        out = torch.empty_like(q) if out is None else out
        o = self.options
        window = self.sliding_window if attention is None else attention.sliding_window
        softcap = None if attention is None else attention.softcap
        k_cache, v_cache = kv.kv_tensors()
        k_scale, v_scale = _scales(kv)
        if plan.others is not None:
            s = plan.others
            packed = o.packed_prefill and k.dtype == k_cache.dtype  # the cache may store another dtype
            paged_flash_attention(q, k_cache, v_cache, out, s.block_tables, s.query_start, s.query_lens, s.seq_lens,
                                  s.max_query_len, self.scale, plan.block_size, window, o.block_m, o.block_n,
                                  k_new=k if packed else None, v_new=v if packed else None, k_scale=k_scale,
                                  v_scale=v_scale, softcap=softcap, sinks=sinks,
                                  causal=attention is None or attention.causal)
        if plan.decodes is not None:
            s = plan.decodes
            paged_decode_attention(q, k_cache, v_cache, out, s.query_start, s.block_tables, s.seq_lens, s.max_seq_len,
                                   self.scale, plan.block_size, window, plan.decode_splits or o.decode_splits,
                                   o.block_n, k_scale=k_scale, v_scale=v_scale, softcap=softcap, sinks=sinks)
        return out
