"""Attention `quest`: query-aware sparse attention for long-context decode (Tang et al., ICML
2024), over the `paged` cache's per-page key bounds.

A page is what the cache keeps key bounds for: ``KVLayout.bounds_page`` tokens, a block or
a part of one (the `paged` cache's ``bounds_page_size``, 4 by default). Below, "blocks" are
these pages.

Per step and layer:
- prompts and prompt chunks (however short), query runs longer than ``max_query_len`` and
  every sequence whose context fits the token budget run dense, exactly, through
  ``dense_backend``: `sdpa` (which this backend extends) or `flash`'s Triton kernels;
- the first ``dense_layers`` layers run dense for every sequence;
- any other sequence (a decode, a speculative verification of k drafts, the recomputed
  outputs of a resumed sequence in runs of at most ``max_query_len``) attends sparsely: its
  blocks are scored per KV head by the upper bound of q . k that their key bounds give
  (select.py; kernels.py on CUDA), and each KV head attends over its own chosen blocks only:
  the first block, the blocks holding the step's query positions (the newest), and the
  best-scored others, ``token_budget // block_size`` blocks in all.

All query rows of one sequence see the same chosen blocks, scored by the largest bound over
those rows and the KV head's query heads, each row under its causal mask; a speculative
verification therefore attends as its last position's decode would, plus the blocks its
earlier positions rank highest.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field

from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.kv import KVStorage
from tessellm.core.plugin import SelectionContext
from tessellm.plugins.attention.quest.select import block_scores, gather_heads, select_blocks, sparse_attention
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions, SdpaPlan


class QuestOptions(SdpaOptions):
    """Options of the `quest` attention backend."""

    token_budget: int = Field(2048, ge=1)
    """Tokens each sparse query attends: ``token_budget // page`` whole pages (the cache's
    key-bounds pages; the first and the newest always among them, even where they alone
    exceed the budget). A context of at most this many tokens runs dense, exactly."""
    kernel: Literal["auto", "torch", "triton"] = "auto"
    """Decodes (one query row) in Triton: block scoring and top-K selection (kernels.py), then
    `flash`'s split-K decode kernel with each KV head reading only its chosen blocks
    ("triton"; on a CPU only under TRITON_INTERPRET=1); or all in torch ("torch"); auto:
    triton on CUDA, torch elsewhere. Speculative verification (several rows) runs in torch."""
    dense_backend: Literal["auto", "sdpa", "flash"] = "auto"
    """What attends densely (prompts, contexts within the budget, the first layers): `sdpa`,
    or `flash`'s Triton kernels (on a CPU only under TRITON_INTERPRET=1); auto: flash on
    CUDA, sdpa elsewhere."""
    dense_layers: int = Field(2, ge=0)
    """The first layers, which attend densely (QUEST's own default keeps two)."""
    max_query_len: int = Field(16, ge=1)
    """Sequences past their prompt with at most this many query rows in a step (decodes,
    speculative verification) attend sparsely; longer runs attend densely."""


@dataclass
class _QuestGroup:
    """Sequences attended sparsely, padded to R query rows and N blocks.

    rows [B, R] packed query rows (padding repeats the last); valid_rows [B, R]; q_pos [B, R]
    absolute positions; tables [B, N] block ids (padding repeats the first); block_ok,
    forced [B, N]; kv_lens [B]; num_chosen [B]."""

    rows: torch.Tensor
    valid_rows: torch.Tensor
    q_pos: torch.Tensor
    tables: torch.Tensor
    block_ok: torch.Tensor
    forced: torch.Tensor
    kv_lens: torch.Tensor
    block_size: int  # tokens per page: the tables hold page ids (slot // block_size)
    num_chosen: torch.Tensor  # [B] blocks each sequence attends
    max_chosen: int  # the largest of them
    num_blocks: torch.Tensor  # [B] int32 blocks each sequence has
    kernel: bool  # decodes through the Triton kernels
    seqs: list = field(default_factory=list)  # the member sequences, for an observer
    observer: Any = None  # observe_selection's callback, with ``layer`` the layer attending
    layer: int = -1

    def attend(self, q: torch.Tensor, kv: KVStorage, scale: float, out: torch.Tensor) -> None:
        b, r = self.rows.shape
        if self.kernel and r == 1:
            self._decode_kernel(q, kv, scale, out)
            return
        kmin, kmax = kv.key_bounds()
        hkv = kmin.shape[1]
        query = q[self.rows].view(b, r, hkv, -1, q.shape[-1])  # [B, R, Hkv, G, D]
        scores = block_scores(query, kmin[self.tables], kmax[self.tables])
        index, chosen_ok = select_blocks(scores, self.block_ok, self.forced, self.num_chosen)
        if self.observer is not None:
            self._report(index, chosen_ok)
        bs = self.block_size
        offs = torch.arange(bs, device=q.device)
        blocks = self.tables[:, None, :].expand(b, hkv, -1).gather(-1, index)  # [B, Hkv, K]
        slots = (blocks[..., None] * bs + offs).flatten(2)  # [B, Hkv, K*bs]
        key_pos = (index[..., None] * bs + offs).flatten(2)
        key_ok = chosen_ok[..., None].expand(-1, -1, -1, bs).flatten(2) & (key_pos < self.kv_lens[:, None, None])
        # a slot past the context (the newest block's tail) may hold NaN: read a real one instead
        slots = torch.where(key_ok, slots, slots[..., :1])
        k, v = gather_heads(kv, slots, q.dtype)
        o = sparse_attention(query, k, v, key_pos, key_ok, self.q_pos, scale)  # [B, R, Hkv, G, D]
        o = o.reshape(b, r, -1, q.shape[-1]).to(out.dtype)
        out[self.rows[self.valid_rows]] = o[self.valid_rows]

    def _decode_kernel(self, q: torch.Tensor, kv: KVStorage, scale: float, out: torch.Tensor) -> None:
        """One query row per sequence, all in Triton: score and choose blocks (kernels.py),
        then `flash`'s split-K decode over each KV head's chosen blocks, so only their K/V
        are read."""
        from tessellm.plugins.attention.flash.decode import paged_decode_attention
        from tessellm.plugins.attention.quest.kernels import select_decode_blocks

        kmin, kmax = kv.key_bounds()
        q = q if q.is_contiguous() else q.contiguous()
        rows = self.rows[:, 0].to(torch.int32)
        blocks, lengths = select_decode_blocks(q, rows, self.tables, self.num_blocks, self.kv_lens, self.num_chosen,
                                               self.max_chosen, kmin, kmax, self.block_size)
        k_cache, v_cache = kv.kv_tensors()
        k_scale, v_scale = kv.kv_scales() if k_cache.dtype == torch.int8 else (None, None)
        paged_decode_attention(q, k_cache, v_cache, out, rows, blocks, lengths, blocks.shape[-1] * self.block_size,
                               scale, self.block_size, k_scale=k_scale, v_scale=v_scale)
        if self.observer is not None:  # block ids back to columns of the table; -(-len // bs) chosen per head
            used = torch.arange(blocks.shape[-1], device=blocks.device) < -(-lengths[..., None] // self.block_size)
            column = (self.tables[:, None, None, :] == blocks[..., None]).int().argmax(dim=-1)
            self._report(column, used)

    def _report(self, index: torch.Tensor, chosen_ok: torch.Tensor) -> None:
        """Hand the observer each member's chosen blocks per KV head, as table columns
        (logical blocks: position // block_size)."""
        chosen = [[[c for c, ok in zip(cols, oks) if ok] for cols, oks in zip(heads, head_oks)]
                  for heads, head_oks in zip(index.tolist(), chosen_ok.tolist())]
        self.observer(self.layer, self.seqs, chosen)


def _dense_is_flash(options: QuestOptions, device: torch.device) -> bool:
    if options.dense_backend == "auto":
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    return options.dense_backend == "flash"


def _kernel_is_triton(options: QuestOptions, device: torch.device) -> bool:
    if options.kernel == "auto":
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    return options.kernel == "triton"


def _in_prompt(batch: BatchMetadata, i: int) -> bool:
    """Whether sequence ``i``'s query rows are (a chunk of) its prompt: prefill runs dense."""
    return bool(batch.seqs) and batch.seq_lens_cpu[i] <= batch.seqs[i].num_prompt_tokens


def _page(batch: BatchMetadata, cache: CacheManager | None) -> int:
    """Tokens per key-bounds page: the cache layout's (a plan made without a cache: the block)."""
    return cache.layout.bounds_page if cache is not None else batch.block_size


@dataclass
class QuestPlan:
    """The step's dense plan (the first ``dense_layers`` layers) and sparse plan (the rest).
    With `flash` attending densely, ``dense`` is its plan for the whole batch and ``rest``
    its plan for the sequences the sparse group leaves (None: none), beside ``group``."""

    dense: Any  # None when no layer attends densely while some sequence is sparse
    sparse: SdpaPlan | None = None
    rest: Any = None
    group: _QuestGroup | None = None


class QuestAttention(SdpaAttention):
    """QUEST sparse decode attention over per-block key bounds; dense attention elsewhere.

    Contract: for every sequence whose context fits ``token_budget``, for prompts, for runs
    longer than ``max_query_len`` and in the first ``dense_layers`` layers it equals its
    dense backend (`sdpa` or `flash`: exact); otherwise it is approximate by design: each
    query attends only its chosen blocks, and equals the reference attention restricted to
    them. Needs the cache's "key_bounds" (the `paged` cache keeps them when this backend is
    named). No layer features: no sliding windows (a window already bounds the context), no
    softcaps, no sinks.
    """

    name = "quest"
    api_version = "1.23"
    description = "QUEST query-aware sparse decode attention: top-K blocks by key-bound scores"
    Options = QuestOptions
    auto_priority = None  # approximate by design: only when named
    kv_extras = frozenset({"key_bounds"})
    layer_features = frozenset()  # a window already bounds each query's keys; no softcap or sinks
    cache_formats = frozenset({"kv"})
    cache_dtypes = None

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)
        if _dense_is_flash(ctx.options, ctx.device):
            from tessellm.plugins.attention.flash import FlashAttention, FlashOptions

            flash_ctx = SelectionContext(device=ctx.device, dtype=ctx.dtype, model=ctx.model, options=FlashOptions(),
                                         max_model_len=ctx.max_model_len, kv_layout=ctx.kv_layout)
            reasons += [f"dense_backend flash: {r}" for r in FlashAttention.unsupported_reasons(flash_ctx)]
        layout = ctx.kv_layout
        if layout is not None and _kernel_is_triton(ctx.options, ctx.device) and importlib.util.find_spec("triton"):
            from tessellm.plugins.attention.quest.kernels import MAX_BLOCKS

            if -(-ctx.max_model_len // layout.bounds_page) > MAX_BLOCKS:
                reasons.append(f"kernel: triton selects among at most {MAX_BLOCKS} pages per sequence; "
                               f"max_model_len {ctx.max_model_len} at pages of {layout.bounds_page} tokens makes "
                               f"more (raise the cache's bounds_page_size, or set kernel: torch)")
        if ctx.options.kernel == "triton":
            if importlib.util.find_spec("triton") is None:
                reasons.append("kernel: triton needs triton, which is not installed")
            elif ctx.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
                reasons.append("kernel: triton runs on a CPU only under TRITON_INTERPRET=1 (slow; for testing)")
        return reasons

    def __init__(self, options: QuestOptions, model, device: torch.device, dtype: torch.dtype):
        super().__init__(options, model, device, dtype)
        self._observer = None
        self.flash = None
        if _dense_is_flash(options, device):
            from tessellm.plugins.attention.flash import FlashAttention, FlashOptions

            self.flash = FlashAttention(FlashOptions(), model, device, dtype)

    def plan(self, batch: BatchMetadata, cache: CacheManager) -> QuestPlan:
        if self.flash is not None:
            return self._flash_plan(batch, cache)
        page = _page(batch, cache)
        sparse = self._sparse_members(batch, page)
        if not sparse:
            dense = super().plan(batch, cache)
            return QuestPlan(dense, dense)
        # the whole-context gather indices of the dense plan only where dense layers use them
        dense = super().plan(batch, cache) if self.options.dense_layers else None
        qsl = batch.query_starts_cpu
        chosen = set(sparse)
        rest = self._groups(batch, [i for i in range(batch.num_seqs) if i not in chosen], qsl)
        group = self._quest_group(batch, sparse, qsl, batch.input_ids.device, page)
        return QuestPlan(dense, SdpaPlan(batch.slot_mapping, [group, *rest]), group=group)

    def observe_selection(self, observer: Any) -> None:
        """Call ``observer(layer, seqs, blocks)`` on every sparse attention: ``blocks[b][h]``
        the logical blocks (position // block_size) KV head h of ``seqs[b]`` attends in
        ``layer`` (evaluations: tessellm eval passkey); None stops. It costs a host copy of
        the selection a layer, so it is off unless asked for."""
        self._observer = observer

    def _budget_pages(self, page_size: int) -> int:
        """Pages each sparse query attends (before forced pages beyond the budget)."""
        return max(self.options.token_budget // page_size, 1)

    def _sparse_members(self, batch: BatchMetadata, page_size: int) -> list[int]:
        """The sequences that attend sparsely this step (past their prompt, a short query run,
        a context beyond the budget)."""
        return [i for i in range(batch.num_seqs)
                if batch.query_lens_cpu[i] <= self.options.max_query_len and not _in_prompt(batch, i)
                and -(-batch.seq_lens_cpu[i] // page_size) > self._budget_pages(page_size)
                and batch.seq_lens_cpu[i] > self.options.token_budget]

    def _flash_plan(self, batch: BatchMetadata, cache: CacheManager) -> QuestPlan:
        dense = self.flash.plan(batch, cache)
        page = _page(batch, cache)
        sparse = self._sparse_members(batch, page)
        if not sparse:
            return QuestPlan(dense)
        qsl = batch.query_starts_cpu
        chosen = set(sparse)
        others = [i for i in range(batch.num_seqs) if i not in chosen]
        return QuestPlan(dense, None, self.flash.plan_members(batch, others) if others else None,
                         self._quest_group(batch, sparse, qsl, batch.input_ids.device, page))

    def _quest_group(self, batch: BatchMetadata, members: list[int], qsl: list[int],
                     device: torch.device, page: int) -> _QuestGroup:
        """The sparse members' page tables (a block's pages are its slots in runs of
        ``page``: page ids block * pages_per_block + j), forced and chosen pages."""
        per_block = batch.block_size // page
        q_lens = torch.tensor([batch.query_lens_cpu[i] for i in members])
        kv_lens = torch.tensor([batch.seq_lens_cpu[i] for i in members])
        num_pages = -(-kv_lens // page)
        width, rows_max = int(num_pages.max()), int(q_lens.max())
        blocks = batch.padded_tables(members, -(-width // per_block))
        tables = (blocks[:, :, None] * per_block + torch.arange(per_block)).flatten(1)[:, :width]
        col = torch.arange(width)[None, :]
        block_ok = col < num_pages[:, None]
        tables = torch.where(block_ok, tables, tables[:, :1])
        first_query_page = (kv_lens - q_lens) // page
        forced = block_ok & ((col == 0) | (col >= first_query_page[:, None]))
        chosen = forced.sum(dim=1).clamp(min=self._budget_pages(page))  # forced pages beyond the budget stay
        r = torch.arange(rows_max)[None, :]
        rows = torch.tensor([qsl[i] for i in members])[:, None] + torch.minimum(r, q_lens[:, None] - 1)
        q_pos = (kv_lens - q_lens)[:, None] + torch.minimum(r, q_lens[:, None] - 1)
        return _QuestGroup(rows.to(device), (r < q_lens[:, None]).to(device), q_pos.to(device), tables.to(device),
                           block_ok.to(device), forced.to(device), kv_lens.to(torch.int32).to(device), page,
                           chosen.to(torch.int32).to(device), int(chosen.max()),
                           num_pages.to(torch.int32).to(device), self._use_kernel(),
                           [batch.seqs[i] for i in members] if self._observer is not None else [], self._observer)

    def _use_kernel(self) -> bool:
        return _kernel_is_triton(self.options, self.device)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVStorage, plan: QuestPlan) -> torch.Tensor:
        dense = layer < self.options.dense_layers
        if plan.group is not None:
            plan.group.layer = layer
        if self.flash is None:
            return super().forward(layer, q, k, v, kv, plan.dense if dense or plan.sparse is None else plan.sparse)
        kv.store(k, v, plan.dense.slot_mapping)  # through the storage: it keeps the key bounds
        q = q.contiguous()
        if dense or plan.group is None:
            return self.flash.attend(q, k, v, kv, plan.dense)
        out = torch.empty_like(q)
        if plan.rest is not None:
            self.flash.attend(q, k, v, kv, plan.rest, out)
        plan.group.attend(q, kv, self.scale, out)
        return out

