"""Attention `sdpa`: torch's scaled_dot_product_attention over K/V gathered from the cache.

The reference backend every other one is checked against, and the one that runs anywhere
torch does. ``plan`` turns the step's block tables into gather indices and masks once; each
layer then stores its new K/V, gathers the context and calls SDPA:

- decode tokens (query length 1) run as padded SDPA calls, one per power-of-two bucket of
  context length;
- every other sequence (a prompt, a prefill chunk, a speculative verification) runs alone,
  with ``is_causal`` when it has no earlier context and an explicit mask when it has.

A layer that attends both ways (an encoder's, ``LayerAttention.causal`` False) drops the
causal part of those masks: each query sees every key of its sequence (within a symmetric
window where the layer has one). An encoder's steps are whole prompts: those of like
lengths (power-of-two buckets, as decodes) share one padded call, fewer and larger calls
than one per prompt, and one alone over plain storage reads its keys and values from the
step's own rows (what the cache stored, bit for bit) rather than gathering them back.

For a model whose images attend within themselves both ways (Gemma 3), the mask of a query
that reaches an image also lets each of the image's queries see all of its keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pydantic import Field

import tessellm
from tessellm.core.interfaces.attention import AttentionBackend
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.kv import DenseKVStorage, KVStorage
from tessellm.core.plugin import PluginOptions


class SdpaOptions(PluginOptions):
    """Options of the `sdpa` attention backend."""

    batch_decode: bool = Field(True)
    """Run decode tokens as padded SDPA calls, one per power-of-two bucket of context length
    (else one call per sequence)."""


@dataclass
class _Group:
    """Sequences attended in one SDPA call.

    rows [B, Q]: packed query rows (padding repeats a valid row and is discarded);
    slots [B, L]: cache slots of each sequence's context (padding re-reads its first token, masked);
    mask [B, 1, Q, L] bool or None with ``causal`` set (query i sees keys 0..i).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    valid_rows: torch.Tensor | None  # [B, Q] bool, None when there is no query padding
    q_pos: torch.Tensor | None = None  # [B, 1, Q, 1] each query's position (with ``mask``)
    windowed: dict = field(default_factory=dict)  # window -> ``mask`` cut to it (made once a step)
    all_rows: bool = False  # rows are the step's rows 0..T-1 in order: q and out need no gather/scatter
    span: tuple[int, int] | None = None  # one sequence whose whole context is the step's rows [a, b)

    def mask_for(self, window: int | None, causal: bool = True) -> torch.Tensor | None:
        """The group's mask for a layer with sliding ``window`` (None: the whole context);
        ``causal`` False: every key of the sequence, within ``window`` both ways (an encoder's
        layer). None where SDPA needs none (``causal`` then says whether it is causal)."""
        if self.mask is None or (causal and window is None):
            return self.mask
        if (window, causal) not in self.windowed:
            # the union over a sequence's queries is its keys: the last query sees every one
            mask = self.mask if causal else self.mask.any(dim=-2, keepdim=True).expand_as(self.mask)
            if window is not None:
                distance = self.q_pos - torch.arange(self.mask.shape[-1], device=self.mask.device)
                mask = mask & ((distance < window) if causal else (distance.abs() < window))
            self.windowed[(window, causal)] = mask
        return self.windowed[(window, causal)]


@dataclass
class SdpaPlan:
    """The step's groups plus the slot mapping every layer stores through."""

    slot_mapping: torch.Tensor
    groups: list  # _Group, or a subclass's group with an ``attend(q, kv, scale, out)`` method


class SdpaAttention(AttentionBackend):
    """Reference attention: any "kv" cache (read through ``KVStorage.gather``, so quantized
    storage too), any head size, GQA, and every layer feature: sliding windows (per layer),
    logit softcapping, attention sinks (explicit scores where SDPA cannot do them) and
    bidirectional (encoder) layers, windowed or not.

    Exact up to SDPA's own rounding; float64 works too, which the tests use as ground truth.
    """

    name = "sdpa"
    api_version = "1.19"
    description = "torch scaled_dot_product_attention over the KV cache (reference, CPU and CUDA)"
    Options = SdpaOptions
    auto_priority = 10
    cache_formats = frozenset({"kv"})
    cache_dtypes = None  # reads through KVStorage.gather, which dequantizes: any storage dtype
    layer_features = frozenset({"sliding_window", "per_layer_window", "softcap", "sinks", "bidirectional",
                                "bidirectional_window", "bidirectional_images"})

    # ---------------------------------------------------------------- per step

    def plan(self, batch: BatchMetadata, cache: CacheManager) -> SdpaPlan:
        qsl = batch.query_starts_cpu
        return SdpaPlan(batch.slot_mapping, self._groups(batch, list(range(batch.num_seqs)), qsl))

    def _groups(self, batch: BatchMetadata, members: list[int], qsl: list[int]) -> list:
        """The SDPA calls for sequences ``members`` of the batch (``qsl``: its query starts)."""
        device = batch.input_ids.device
        decodes = [i for i in members if batch.query_lens_cpu[i] == 1] if self.options.batch_decode else []
        batched = set(decodes)
        groups = self._decode_groups(batch, decodes, qsl, device)
        if self._both_ways:  # an encoder's step: whole prompts of like lengths share a padded call
            prompts = [i for i in members if i not in batched and batch.query_lens_cpu[i] == batch.seq_lens_cpu[i]]
            if len(prompts) > 1:
                groups += SdpaAttention._decode_groups(self, batch, prompts, qsl, device)
                batched.update(prompts)
        for i in members:
            if i not in batched:
                groups.append(self._group(batch, [i], qsl, batch.block_size, device))
        return groups

    def _decode_groups(self, batch: BatchMetadata, decodes: list[int], qsl: list[int],
                       device: torch.device) -> list:
        # decodes of similar context length share a call: padding every sequence to the
        # longest context in the step would gather (and attend over) mostly padding when
        # lengths are long-tailed; power-of-two buckets bound the padding to under 2x
        buckets: dict[int, list[int]] = {}
        for i in decodes:
            buckets.setdefault((batch.seq_lens_cpu[i] - 1).bit_length(), []).append(i)
        return [self._group(batch, members, qsl, batch.block_size, device) for members in buckets.values()]

    def _group(self, batch: BatchMetadata, seqs: list[int], qsl: list[int], bs: int,
               device: torch.device) -> _Group:
        q_lens = [batch.query_lens_cpu[i] for i in seqs]
        kv_lens = [batch.seq_lens_cpu[i] for i in seqs]
        q_max, kv_max = max(q_lens), max(kv_lens)
        tables = batch.padded_tables(seqs, -(-kv_max // bs))  # [B, blocks]
        pos = torch.arange(kv_max)
        slots = tables[:, pos // bs] * bs + pos % bs  # [B, L]
        # padding must not read unwritten slots: they may hold NaN, and a masked score's zero
        # weight times NaN is still NaN; point it at the sequence's own first token instead
        slots = torch.where(pos[None, :] < torch.tensor(kv_lens)[:, None], slots, slots[:, :1])
        q_idx = torch.arange(q_max)
        rows = torch.tensor([qsl[i] for i in seqs])[:, None] + torch.minimum(
            q_idx[None, :], torch.tensor(q_lens)[:, None] - 1)  # [B, Q]; padding repeats the last row
        spans = self._image_spans(batch, seqs)
        alone_causal = len(seqs) == 1 and q_lens[0] == kv_lens[0] and not self._windowed and not spans
        # decodes of one context length see every key: no mask (a window would need one)
        unmasked = q_max == 1 and min(kv_lens) == kv_max and not self._windowed and not spans
        mask = valid = q_pos = None
        if not (alone_causal or unmasked):
            q_len = torch.tensor(q_lens)[:, None, None]
            kv_len = torch.tensor(kv_lens)[:, None, None]
            q_pos = kv_len - q_len + q_idx[None, :, None]  # [B, Q, 1] absolute position of each query
            k_pos = pos[None, None, :]  # [1, 1, L]
            visible = k_pos <= q_pos
            for member, first, end in spans:  # an image's queries see every key of the image
                q_in = (q_pos[member] >= first) & (q_pos[member] < end)  # [Q, 1]
                visible[member] |= q_in & (k_pos[0] >= first) & (k_pos[0] < end)
            mask = (visible & (k_pos < kv_len))[:, None].to(device)  # [B, 1, Q, L]
            q_pos = q_pos[:, None].to(device)
            if q_max > min(q_lens):
                valid = (q_idx[None, :] < torch.tensor(q_lens)[:, None]).to(device)
        all_rows = valid is None and len(seqs) * q_max == qsl[-1] and \
            [qsl[i] + j for i, n in zip(seqs, q_lens) for j in range(n)] == list(range(qsl[-1]))
        span = (qsl[seqs[0]], qsl[seqs[0]] + q_lens[0]) if len(seqs) == 1 and q_lens[0] == kv_lens[0] else None
        return _Group(rows.to(device), slots.to(device), mask, alone_causal, valid, q_pos, all_rows=all_rows,
                      span=span)

    @property
    def _both_ways(self) -> bool:
        """Whether some layer attends both ways (an encoder: every step is whole prompts)."""
        if not hasattr(self, "_any_both_ways"):
            self._any_both_ways = any(not self.layer_attention(i).causal for i in range(self.model.num_layers))
        return self._any_both_ways

    def _image_spans(self, batch: BatchMetadata, seqs: list[int]) -> list[tuple[int, int, int]]:
        """(member index in ``seqs``, first position, end) of each image the members' queries
        reach, for a model whose images attend within themselves both ways; else none."""
        images = batch.images
        vision = getattr(self.model, "vision", None)
        if images is None or not images.spans or vision is None or not vision.whole_images:
            return []
        member = {seq: j for j, seq in enumerate(seqs)}
        return [(member[i], first, end) for i, first, end in images.spans if i in member]

    @property
    def _windowed(self) -> bool:
        """Whether some layer has a sliding window (its groups then need explicit masks)."""
        if not hasattr(self, "_any_window"):
            self._any_window = any(self.layer_attention(i).sliding_window is not None
                                   for i in range(self.model.num_layers))
        return self._any_window

    # ---------------------------------------------------------------- per layer

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVStorage, plan: SdpaPlan, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        kv.store(k, v, plan.slot_mapping)
        out = None
        features = self.layer_attention(layer)
        # an encoder's step over plain storage (k and v kept as they are): a whole prompt's keys
        # are read from them, not gathered back (a decoder's prompts keep the one path they had)
        stored_as_given = self._both_ways and isinstance(kv, DenseKVStorage) and kv.layout.dtype == k.dtype
        for g in plan.groups:
            if not isinstance(g, _Group):
                out = torch.empty_like(q) if out is None else out
                g.attend(q, kv, self.scale, out)  # a subclass's own kind of group
                continue
            if g.span is not None and stored_as_given:  # a whole prompt: its K/V are this step's rows, as stored
                a, b = g.span
                keys, values, query = k[a:b][None], v[a:b][None], q[a:b][None]  # views: [1, L, H, D]
            else:
                keys, values = kv.gather(g.slots)  # [B, L, Hkv, D]
                query = q.view(*g.rows.shape, *q.shape[1:]) if g.all_rows else q[g.rows]  # [B, Q, Hq, D]
            mask = g.mask_for(features.sliding_window, features.causal)
            if features.softcap is not None or sinks is not None:
                if mask is None and not features.causal:  # every key (explicit_attention reads None as causal)
                    mask = torch.ones(1, 1, query.shape[1], keys.shape[1], dtype=torch.bool, device=q.device)
                o = explicit_attention(query, keys, values, mask, self.scale, features.softcap, sinks)
            else:
                o = F.scaled_dot_product_attention(
                    query.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
                    attn_mask=mask, is_causal=g.causal and features.causal, scale=self.scale,
                    enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)  # [B, Q, Hq, D]
            if g.all_rows:  # the step's only group, its rows in order
                return o.reshape(q.shape)
            out = torch.empty_like(q) if out is None else out
            if g.span is not None:
                out[g.span[0]:g.span[1]] = o[0]
            elif g.valid_rows is None:
                out[g.rows.reshape(-1)] = o.reshape(-1, *o.shape[2:])
            else:
                out[g.rows[g.valid_rows]] = o[g.valid_rows]
        return torch.empty_like(q) if out is None else out  # (no groups: a step of no rows)


def explicit_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with what SDPA cannot do: scores capped as softcap * tanh(s / softcap) and
    sink logits in each softmax's denominator. query [B, Q, Hq, D], keys, values [B, L, Hkv,
    D], mask [B, 1, Q, L] bool (None: causal over the last Q keys), sinks [Hq] or None ->
    [B, Q, Hq, D] in query's dtype; computed in float32 (float64 for float64)."""
    acc = torch.promote_types(query.dtype, torch.float32)
    group = query.shape[2] // keys.shape[2]
    qh = query.to(acc).transpose(1, 2)  # [B, Hq, Q, D]
    kh = keys.to(acc).transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, L, D]
    vh = values.to(acc).transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [B, Hq, Q, L]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is None:
        q_len, k_len = s.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=s.device).tril(k_len - q_len)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc)[None, :, None, None].expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vh).transpose(1, 2).to(query.dtype)


@tessellm.hookimpl
def register_attention(register):
    register(SdpaAttention)
