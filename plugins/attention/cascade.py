"""Attention `cascade`: `sdpa`, plus shared-prefix (cascade) attention for decodes whose
block tables start with the same blocks.

With prefix caching or parallel sampling many decoding sequences read the same leading
blocks: a long system prompt, or the prompt of n samples. Gathering those blocks once per
sequence (what `sdpa` does) copies and reads the prefix B times per layer. Here the decodes
sharing a prefix attend in two parts, as FlashInfer's cascade inference and Hydragen do:

- the shared prefix once, for all their queries together: one [Hkv, B*G, P] score matmul;
- each sequence's own suffix, padded and masked as in `sdpa`;

and the two partial softmaxes are merged exactly by their log-sum-exps:
``o = (o1 * e^(lse1 - lse) + o2 * e^(lse2 - lse))`` with ``lse = logaddexp(lse1, lse2)``.
Everything else (prefills, chunks, decodes sharing nothing) runs through `sdpa` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

import tessellm
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.kv import KVStorage
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions


class CascadeOptions(SdpaOptions):
    """Options of the `cascade` attention backend."""

    min_shared_tokens: int = Field(64, ge=1)
    """Shared prefixes shorter than this run through plain `sdpa` (too short to pay off)."""


@dataclass
class _Cascade:
    """Decodes sharing ``prefix_slots``: rows [B] (packed query rows), prefix_slots [P],
    suffix_slots [B, S] (padding re-reads the sequence's first suffix token) and
    suffix_mask [B, 1, 1, S] (True for real suffix tokens)."""

    rows: torch.Tensor
    prefix_slots: torch.Tensor
    suffix_slots: torch.Tensor
    suffix_mask: torch.Tensor

    def attend(self, q: torch.Tensor, kv: KVStorage, scale: float, out: torch.Tensor) -> None:
        query = q[self.rows]  # [B, Hq, D]
        num_seqs, num_heads, head_dim = query.shape
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in >= float32
        kp, vp = kv.gather(self.prefix_slots)  # [P, Hkv, D]
        kv_heads = kp.shape[1]
        group = num_heads // kv_heads
        qh = query.to(acc).view(num_seqs, kv_heads, group, head_dim)  # [B, Hkv, G, D]
        # the prefix, once for every query of every sequence: [Hkv, B*G, P]
        q_flat = qh.permute(1, 0, 2, 3).reshape(kv_heads, num_seqs * group, head_dim)
        s1 = torch.matmul(q_flat, kp.to(acc).permute(1, 2, 0)) * scale
        lse1 = torch.logsumexp(s1, dim=-1)
        o1 = torch.matmul(torch.softmax(s1, dim=-1), vp.to(acc).transpose(0, 1))  # [Hkv, B*G, D]
        o1 = o1.view(kv_heads, num_seqs, group, head_dim).permute(1, 0, 2, 3)  # [B, Hkv, G, D]
        lse1 = lse1.view(kv_heads, num_seqs, group).permute(1, 0, 2)  # [B, Hkv, G]
        # each sequence's own tokens: [B, Hkv, G, S]
        ks, vs = kv.gather(self.suffix_slots)  # [B, S, Hkv, D]
        s2 = torch.matmul(qh, ks.to(acc).permute(0, 2, 3, 1)) * scale
        s2 = s2.masked_fill(~self.suffix_mask, float("-inf"))
        lse2 = torch.logsumexp(s2, dim=-1)
        o2 = torch.matmul(torch.softmax(s2, dim=-1), vs.to(acc).transpose(1, 2))  # [B, Hkv, G, D]
        lse = torch.logaddexp(lse1, lse2)
        o = o1 * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None]
        out[self.rows] = o.reshape(num_seqs, num_heads, head_dim).to(out.dtype)


class CascadeAttention(SdpaAttention):
    """`sdpa` with shared-prefix decodes attended as a cascade (prefix once, then suffixes).

    Exact up to rounding, like `sdpa` (the property tests hold it to the same float64
    reference). Models with layer features (sliding windows, softcaps, sinks) run plain
    `sdpa`: a window cuts the shared prefix differently for every sequence.
    """

    name = "cascade"
    api_version = "1.19"
    description = "sdpa + shared-prefix (cascade) decode attention: a common prefix is read once per step"
    Options = CascadeOptions
    auto_priority = 20

    def _decode_groups(self, batch: BatchMetadata, decodes: list[int], qsl: list[int],
                       device: torch.device) -> list:
        if self.model.attention_features():  # windows, softcaps, sinks: plain sdpa groups
            return super()._decode_groups(batch, decodes, qsl, device)
        bs = batch.block_size
        by_first: dict[int, list[int]] = {}
        for i in decodes:  # sequences sharing a prefix share its first block
            by_first.setdefault(batch.block_tables_cpu[i][0], []).append(i)
        groups: list = []
        rest: list[int] = []
        for members in by_first.values():
            shared = self._shared_blocks(batch, members)
            if len(members) < 2 or shared * bs < self.options.min_shared_tokens:
                rest += members
                continue
            groups.append(self._cascade(batch, members, shared, qsl, device))
        return groups + super()._decode_groups(batch, rest, qsl, device)

    @staticmethod
    def _shared_blocks(batch: BatchMetadata, members: list[int]) -> int:
        """Leading blocks every member's table holds, leaving each at least one own token."""
        tables = [batch.block_tables_cpu[i] for i in members]
        shared = 0
        for column in zip(*tables):
            if any(b != column[0] for b in column):
                break
            shared += 1
        shortest = min(batch.seq_lens_cpu[i] for i in members)
        return min(shared, (shortest - 1) // batch.block_size)

    @staticmethod
    def _cascade(batch: BatchMetadata, members: list[int], shared: int, qsl: list[int],
                 device: torch.device) -> _Cascade:
        bs = batch.block_size
        prefix = shared * bs
        table0 = torch.tensor(batch.block_tables_cpu[members[0]][:shared], dtype=torch.long)
        prefix_slots = (table0[:, None] * bs + torch.arange(bs)).reshape(-1)
        lens = torch.tensor([batch.seq_lens_cpu[i] - prefix for i in members])  # >= 1 each
        width = int(lens.max())
        pos = prefix + torch.arange(width)  # [S] absolute positions of suffix tokens
        need = -(-(prefix + width) // bs)
        tables = batch.padded_tables(members, need)
        slots = tables[:, pos // bs] * bs + pos % bs  # [B, S]
        valid = torch.arange(width)[None, :] < lens[:, None]
        slots = torch.where(valid, slots, slots[:, :1])  # never read an unwritten slot
        rows = torch.tensor([qsl[i] for i in members])
        return _Cascade(rows.to(device), prefix_slots.to(device), slots.to(device),
                        valid[:, None, None, :].to(device))


@tessellm.hookimpl
def register_attention(register):
    register(CascadeAttention)
