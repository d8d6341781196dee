"""Attention `quest`: query-aware sparse attention for long-context decode (Tang et al., ICML
2024), over the `paged` cache's per-page key bounds.

A page is what the cache keeps key bounds for: ``KVLayout.bounds_page`` tokens, a block or
a part of one (the `paged` cache's ``bounds_page_size``, 4 by default).

Per step and layer:
- prompts and prompt chunks (however short), query runs longer than ``max_query_len`` and
  every sequence whose context fits the token budget run dense, exactly, through
  ``dense_backend``: `sdpa` (which this backend extends) or `flash`'s Triton kernels; the
  only extra work of a prompt is the cache's bounds upkeep as it stores K/V (one pass over
  the new tokens' pages);
- the first ``dense_layers`` layers run dense for every sequence;
- a decode beyond the budget attends sparsely: every page of its context is scored per KV
  head by the upper bound of q . k its key bounds give, top-K keeps the best (the first page
  always), the newest page is added, ``token_budget // page`` pages in all, and each KV
  head attends over its own pages only (select.py; kernels.py and `flash`'s split-K decode
  on CUDA). The plan is O(batch) host work; no step reads a device value back, so decode
  steps are captured as CUDA graphs like `flash`'s;
- any other sequence past its prompt (a speculative verification of k drafts, the
  recomputed outputs of a resumed sequence in runs of at most ``max_query_len``) attends
  sparsely in torch: all query rows of one sequence see the same chosen pages, scored by the
  largest bound over those rows and the KV head's query heads, each row under its causal
  mask, the pages of every query position kept: it attends as its last position's decode
  would, plus the pages its earlier positions rank highest.
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
from tessellm.plugins.attention.quest.select import (DecodePages, block_scores, decode_attention,
                                                     decode_page_scores, decode_page_tables, gather_heads, page_ids,
                                                     pick_pages, select_blocks, sparse_attention)
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions, SdpaPlan


class QuestOptions(SdpaOptions):
    """Options of the `quest` attention backend."""

    token_budget: int = Field(2048, ge=1)
    """Tokens each sparse query attends: ``token_budget // page`` whole pages (the cache's
    key-bounds pages; the first and the newest always among them, even where they alone
    exceed the budget). A context of at most this many tokens runs dense, exactly."""
    kernel: Literal["auto", "torch", "triton"] = "auto"
    """Decodes (one query row) in Triton: page scoring (kernels.py), torch's top-K, then
    `flash`'s split-K decode kernel with each KV head reading only its chosen pages
    ("triton"; on a CPU only under TRITON_INTERPRET=1); or all in torch ("torch"); auto:
    triton on CUDA, torch elsewhere. Speculative verification (several rows) runs in torch.
    CUDA graphs capture decode steps with triton here and flash as ``dense_backend``."""
    dense_backend: Literal["auto", "sdpa", "flash"] = "auto"
    """What attends densely (prompts, contexts within the budget, the first layers): `sdpa`,
    or `flash`'s Triton kernels (on a CPU only under TRITON_INTERPRET=1); auto: flash on
    CUDA, sdpa elsewhere."""
    dense_layers: int = Field(2, ge=0)
    """The first layers, which attend densely (QUEST's own default keeps two)."""
    max_query_len: int = Field(16, ge=1)
    """Sequences past their prompt with at most this many query rows in a step (decodes,
    speculative verification) attend sparsely; longer runs attend densely."""


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the step in flight: through
    pinned memory, not blocking, on CUDA (a plain copy would synchronise with the stream)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _member_tensors(batch: BatchMetadata, members: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [B] int32, each member's first packed query row; seq_lens [B] int32; block
    tables [B, W] int32) on the batch's device, from one upload of O(B) host integers (rows
    padded to 16 bytes: Triton compiles another variant for an unaligned pointer)."""
    n, qsl = len(members), batch.query_starts_cpu
    host = torch.zeros(2, -(-n // 4) * 4, dtype=torch.int32)
    host[0, :n] = torch.tensor([qsl[i] for i in members], dtype=torch.int32)
    host[1, :n] = torch.tensor(members, dtype=torch.int32)
    rows, pick = _upload(host, batch.input_ids.device)[:, :n]
    return rows, batch.seq_lens.index_select(0, pick), batch.block_tables.index_select(0, pick).to(torch.int32)


@dataclass
class _DecodeGroup:
    """Decodes (one query row each) attended sparsely, every tensor on the device, every
    size fixed on the host: the plan of an eager step (the sparse members) and of a CUDA
    graph (every row of the padded batch, ``num_cols`` the longest context's pages).

    Per layer: every page of a sequence is scored from its bounds (``score_pages``), top-K
    keeps the ``num_picks`` best (the first page scores +inf), the newest page is appended
    (``page_tables``), and each KV head attends over its own pages only. A sequence of at
    most ``num_picks + 1`` pages (a padding row, a short context in a graph) attends all of
    them: dense."""

    rows: torch.Tensor  # [B] int32 packed query row
    seq_lens: torch.Tensor  # [B] int32
    tables: torch.Tensor  # [B, W] int32 cache blocks
    num_cols: int  # pages scored per sequence
    num_picks: int  # pages top-K keeps (the first among them); the newest comes on top
    page: int  # tokens per page
    per_block: int  # pages per cache block
    kernel: bool  # Triton (scores, tables, `flash`'s split-K decode) or torch
    splits: int | None = None  # the decode kernel's split count (fixed in a graph; None: per step)
    pages: DecodePages | None = None  # the torch path's page layout, made by the first layer
    seqs: list = field(default_factory=list)  # the member sequences, for an observer
    observer: Any = None
    layer: int = -1

    def attend(self, q: torch.Tensor, kv: KVStorage, scale: float, out: torch.Tensor) -> None:
        kmin, kmax = kv.key_bounds()
        if self.kernel:
            from tessellm.plugins.attention.quest.kernels import page_tables, score_pages

            q = q if q.is_contiguous() else q.contiguous()
            scores = score_pages(q, self.rows, self.tables, self.seq_lens, kmin, kmax, self.page, self.per_block,
                                 self.num_cols)
            picks = pick_pages(scores, self.num_picks)
            pages, lengths = page_tables(picks, self.tables, self.seq_lens, self.page, self.per_block)
            self._attend_kernel(q, kv, scale, out, pages, lengths)
        else:
            if self.pages is None:  # the step's page layout, shared by its layers
                self.pages = DecodePages.of(self.tables, self.seq_lens, self.page, self.per_block, self.num_cols)
            picks = pick_pages(decode_page_scores(q, self.rows, self.pages, kmin, kmax), self.num_picks)
            pages, lengths = decode_page_tables(picks, self.pages)
            self._attend_torch(q, kv, scale, out, pages, lengths)
        if self.observer is not None:
            self._report(picks, lengths)

    def _attend_kernel(self, q: torch.Tensor, kv: KVStorage, scale: float, out: torch.Tensor,
                       pages: torch.Tensor, lengths: torch.Tensor) -> None:
        """`flash`'s split-K decode, each KV head reading its own pages only."""
        from tessellm.plugins.attention.flash.decode import paged_decode_attention

        k_cache, v_cache = kv.kv_tensors()
        k_scale, v_scale = kv.kv_scales() if k_cache.dtype == torch.int8 else (None, None)
        paged_decode_attention(q, k_cache, v_cache, out, self.rows, pages, lengths, pages.shape[-1] * self.page,
                               scale, self.page, num_splits=self.splits, k_scale=k_scale, v_scale=v_scale)

    def _attend_torch(self, q: torch.Tensor, kv: KVStorage, scale: float, out: torch.Tensor,
                      pages: torch.Tensor, lengths: torch.Tensor) -> None:
        b, hkv, _ = pages.shape
        offs = torch.arange(self.page, device=q.device)
        slots = (pages.long()[..., None] * self.page + offs).flatten(2)  # [B, Hkv, S]
        key_ok = torch.arange(slots.shape[-1], device=q.device) < lengths[..., None]
        slots = torch.where(key_ok, slots, slots[..., :1])  # a slot past the context may hold NaN
        k, v = gather_heads(kv, slots, q.dtype)
        rows = self.rows.long()
        o = decode_attention(q.index_select(0, rows).view(b, hkv, -1, q.shape[-1]), k, v, key_ok, scale)
        out.index_copy_(0, rows, o.reshape(b, -1, q.shape[-1]).to(out.dtype))

    def _report(self, picks: torch.Tensor, lengths: torch.Tensor) -> None:
        """Each member's pages per KV head as columns (position // page): the picks and the
        newest, or every page of a short context."""
        num_pages = [-(-int(n) // self.page) for n in self.seq_lens.tolist()]
        chosen = [[list(range(n)) if n <= self.num_picks + 1 else sorted(head) + [n - 1] for head in heads]
                  for n, heads in zip(num_pages, picks.tolist())]
        self.observer(self.layer, self.seqs, chosen)


@dataclass
class _VerifyGroup:
    """Sequences attended sparsely with several query rows (a speculative verification, the
    recomputed outputs of a resumed sequence), in torch, padded to R rows: all rows of a
    sequence see the same chosen pages, scored by the largest bound over its rows and the
    KV head's query heads, and the pages of every query position are always kept.

    rows, q_pos [B, R] (padding repeats the last row); out_rows, out_index [sum of the
    members' rows]: each real row's packed row and its index among the B * R; seq_lens [B];
    tables [B, W] cache blocks; first_query_page, num_chosen [B]."""

    rows: torch.Tensor
    q_pos: torch.Tensor
    out_rows: torch.Tensor
    out_index: torch.Tensor
    seq_lens: torch.Tensor
    tables: torch.Tensor
    first_query_page: torch.Tensor
    num_chosen: torch.Tensor
    num_cols: int  # the longest member's pages
    max_chosen: int  # the largest of num_chosen
    page: int
    per_block: int
    seqs: list = field(default_factory=list)
    observer: Any = None
    layer: int = -1

    def attend(self, q: torch.Tensor, kv: KVStorage, scale: float, out: torch.Tensor) -> None:
        b, r = self.rows.shape
        kmin, kmax = kv.key_bounds()
        hkv, ps = kmin.shape[1], self.page
        col = torch.arange(self.num_cols, device=q.device)
        num_pages = (self.seq_lens.long() + ps - 1) // ps
        block_ok = col[None, :] < num_pages[:, None]
        forced = block_ok & ((col == 0)[None, :] | (col[None, :] >= self.first_query_page[:, None]))
        pages = torch.where(block_ok, page_ids(self.tables, col.expand(b, -1), self.per_block), 0)
        query = q[self.rows].view(b, r, hkv, -1, q.shape[-1])  # [B, R, Hkv, G, D]
        lo, hi = (t.index_select(0, pages.flatten()).view(b, self.num_cols, *t.shape[1:]) for t in (kmin, kmax))
        scores = block_scores(query, lo, hi)
        index, chosen_ok = select_blocks(scores, block_ok, forced, self.num_chosen, self.max_chosen)
        if self.observer is not None:
            self.observer(self.layer, self.seqs, [[[c for c, ok in zip(cols, oks) if ok] for cols, oks in zip(h, o)]
                                                  for h, o in zip(index.tolist(), chosen_ok.tolist())])
        offs = torch.arange(ps, device=q.device)
        chosen = pages[:, None, :].expand(b, hkv, -1).gather(-1, index)  # [B, Hkv, K] page ids
        slots = (chosen[..., None] * ps + offs).flatten(2)  # [B, Hkv, K*ps]
        key_pos = (index[..., None] * ps + offs).flatten(2)
        key_ok = chosen_ok[..., None].expand(-1, -1, -1, ps).flatten(2) & (key_pos < self.seq_lens[:, None, None])
        slots = torch.where(key_ok, slots, slots[..., :1])  # a slot past the context may hold NaN
        k, v = gather_heads(kv, slots, q.dtype)
        o = sparse_attention(query, k, v, key_pos, key_ok, self.q_pos, scale)  # [B, R, Hkv, G, D]
        out[self.out_rows] = o.reshape(b * r, -1, q.shape[-1])[self.out_index].to(out.dtype)


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
    """The step's dense plan (the first ``dense_layers`` layers, and every layer where no
    sequence is sparse) and the sparse layers' plan: with `sdpa` attending densely,
    ``sparse`` (an `sdpa` plan whose groups include the sparse ones); with `flash`, ``rest``
    (its plan for the sequences the sparse groups leave; None: none) beside ``groups``."""

    dense: Any
    sparse: SdpaPlan | None = None
    rest: Any = None
    groups: list = field(default_factory=list)  # _DecodeGroup, _VerifyGroup


class QuestAttention(SdpaAttention):
    """QUEST sparse decode attention over per-page key bounds; dense attention elsewhere.

    Contract: for every sequence whose context fits ``token_budget``, for prompts, for runs
    longer than ``max_query_len`` and in the first ``dense_layers`` layers it equals its
    dense backend (`sdpa` or `flash`: exact in an eager step; a decode step replayed from a
    CUDA graph attends a short context through the sparse kernels over all its pages, equal
    to dense up to the summation order); otherwise it is approximate by design: each query
    attends only its chosen pages, and equals the reference attention restricted to them.
    Needs the cache's "key_bounds" (the `paged` cache keeps them when this backend is
    named). No layer features: no sliding windows (a window already bounds the context), no
    softcaps, no sinks.

    Decode steps can be captured as CUDA graphs where `flash` attends densely and the sparse
    path runs in Triton (the defaults on CUDA): nothing in a decode step depends on a value
    read back from the device, and every shape is fixed by the padded batch size and
    ``max_model_len``.
    """

    name = "quest"
    api_version = "1.19"
    description = "QUEST query-aware sparse decode attention: top-K pages by key-bound scores"
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
            from tessellm.plugins.attention.quest.kernels import MAX_SCORE_PROGRAMS, SCORE_TILE

            pages = -(-ctx.max_model_len // layout.bounds_page)
            if -(-pages // SCORE_TILE) > MAX_SCORE_PROGRAMS:
                reasons.append(f"kernel: triton scores at most {MAX_SCORE_PROGRAMS * SCORE_TILE} pages per sequence "
                               f"(a CUDA grid's limit); max_model_len {ctx.max_model_len} at pages of "
                               f"{layout.bounds_page} tokens makes {pages} (raise the cache's bounds_page_size, or "
                               f"set kernel: torch)")
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
        # a decode step is capturable when both of its paths are kernels that read only the
        # batch's device tensors: `flash` densely, the Triton scores and tables sparsely
        self.supports_cuda_graphs = self.flash is not None and self._use_kernel()

    def plan(self, batch: BatchMetadata, cache: CacheManager) -> QuestPlan:
        page = _page(batch, cache)
        decodes, verifies = self._sparse_members(batch, page)
        groups = ([self._decode_group(batch, decodes, page)] if decodes else []) + \
            ([self._verify_group(batch, verifies, page)] if verifies else [])
        sparse = set(decodes) | set(verifies)
        others = [i for i in range(batch.num_seqs) if i not in sparse]
        if self.flash is not None:
            dense = self.flash.plan(batch, cache)
            rest = self.flash.plan_members(batch, others) if groups and others else None
            return QuestPlan(dense, rest=rest, groups=groups)
        if not groups:
            dense = super().plan(batch, cache)
            return QuestPlan(dense, dense)
        # the whole-context gather indices of the dense plan only where dense layers use them
        dense = super().plan(batch, cache) if self.options.dense_layers else None
        rest = self._groups(batch, others, batch.query_starts_cpu)
        return QuestPlan(dense, SdpaPlan(batch.slot_mapping, [*groups, *rest]), groups=groups)

    def graph_plan(self, batch: BatchMetadata, cache: CacheManager, max_seq_len: int) -> QuestPlan:
        """A decode batch replayed from a CUDA graph: `flash`'s graph plan in the dense layers,
        and in the others every row through the sparse kernels, over ``max_seq_len``'s pages
        (a short context attends all its pages); the split count fixed for the table's
        tokens. Reads only the batch's tensors (the static buffers a replay refills)."""
        if not self.supports_cuda_graphs:
            raise NotImplementedError("quest captures decode steps only with dense_backend flash and kernel triton")
        from tessellm.plugins.attention.flash.decode import decode_config, default_num_splits

        dense = self.flash.graph_plan(batch, cache, max_seq_len)
        page = _page(batch, cache)
        n, num_cols, table = batch.num_seqs, -(-max_seq_len // page), self._table_pages(page)
        if num_cols <= table:  # every context fits the budget: dense in every layer
            return QuestPlan(dense)
        splits = default_num_splits(n, self.model.num_kv_heads, table * page,
                                    decode_config(self.model.head_dim, self.device).block_n)
        group = _DecodeGroup(batch.query_start_loc[:n], batch.seq_lens, batch.block_tables, num_cols, table - 1, page,
                             batch.block_size // page, True, splits)
        return QuestPlan(dense, groups=[group])

    def warm_up_shapes(self, max_step_tokens: int, max_model_len: int) -> list[list[tuple[int, int]]]:
        """`flash`'s own, and decodes over the longest context, which attend sparsely: one
        alone (the split-K decode over its pages, split and merged) and enough of them to
        fill the GPU in one split each (the single-split variant)."""
        shapes = self.flash.warm_up_shapes(max_step_tokens, max_model_len) if self.flash is not None else []
        if max_model_len <= self.options.token_budget:
            return shapes
        from tessellm.plugins.attention.flash.decode import DECODE_PROGRAMS

        many = -(-DECODE_PROGRAMS // max(getattr(self.model, "num_kv_heads", 1), 1))
        return shapes + [[(1, max_model_len)], [(1, max_model_len)] * many]

    def observe_selection(self, observer: Any) -> None:
        """Call ``observer(layer, seqs, pages)`` on every sparse attention of an eager step:
        ``pages[b][h]`` the logical pages (position // page) KV head h of ``seqs[b]`` attends
        in ``layer`` (evaluations: tessellm eval passkey); None stops. It costs a host copy
        of the selection a layer, so it is off unless asked for; a step replayed from a CUDA
        graph runs no Python, so an observer wants ``cuda_graphs: false``."""
        self._observer = observer

    def _budget_pages(self, page_size: int) -> int:
        """Pages each sparse query attends (before forced pages beyond the budget)."""
        return max(self.options.token_budget // page_size, 1)

    def _table_pages(self, page_size: int) -> int:
        """Pages a sparse decode attends: the budget's, at least the first and the newest."""
        return max(self._budget_pages(page_size), 2)

    def _sparse_members(self, batch: BatchMetadata, page_size: int) -> tuple[list[int], list[int]]:
        """The sequences that attend sparsely this step (past their prompt, a short query run,
        a context beyond the budget): the decodes (one query row) and the others."""
        budget = self._budget_pages(page_size)
        sparse = [i for i in range(batch.num_seqs)
                  if batch.query_lens_cpu[i] <= self.options.max_query_len and not _in_prompt(batch, i)
                  and -(-batch.seq_lens_cpu[i] // page_size) > budget
                  and batch.seq_lens_cpu[i] > self.options.token_budget]
        decodes = [i for i in sparse if batch.query_lens_cpu[i] == 1]
        return decodes, [i for i in sparse if batch.query_lens_cpu[i] > 1]

    def _decode_group(self, batch: BatchMetadata, members: list[int], page: int) -> _DecodeGroup:
        """The sparse decodes' device tensors: O(members) host work, one upload."""
        rows, seq_lens, tables = _member_tensors(batch, members)
        num_cols = max(-(-batch.seq_lens_cpu[i] // page) for i in members)
        return _DecodeGroup(rows, seq_lens, tables, num_cols, self._table_pages(page) - 1, page,
                            batch.block_size // page, self._use_kernel(),
                            seqs=[batch.seqs[i] for i in members] if self._observer is not None else [],
                            observer=self._observer)

    def _verify_group(self, batch: BatchMetadata, members: list[int], page: int) -> _VerifyGroup:
        """The sparse members with several rows: their rows, positions and forced pages from
        the host lists (O(rows) host work), their tables through the device."""
        device = batch.input_ids.device
        qsl = batch.query_starts_cpu
        q_lens = torch.tensor([batch.query_lens_cpu[i] for i in members])
        kv_lens = torch.tensor([batch.seq_lens_cpu[i] for i in members])
        r = torch.arange(int(q_lens.max()))[None, :]
        last = torch.minimum(r, q_lens[:, None] - 1)
        rows = torch.tensor([qsl[i] for i in members])[:, None] + last
        first_query_page = (kv_lens - q_lens) // page
        num_pages = -(-kv_lens // page)
        forced = torch.where(first_query_page > 0, 1 + num_pages - first_query_page, num_pages)
        chosen = forced.clamp(min=self._budget_pages(page))  # forced pages beyond the budget stay
        valid = (r < q_lens[:, None]).flatten()
        _, seq_lens, tables = _member_tensors(batch, members)
        return _VerifyGroup(_upload(rows, device), _upload((kv_lens - q_lens)[:, None] + last, device),
                            _upload(rows.flatten()[valid], device), _upload(valid.nonzero()[:, 0], device), seq_lens,
                            tables, _upload(first_query_page, device), _upload(chosen, device),
                            int(num_pages.max()), int(chosen.max()), page, batch.block_size // page,
                            [batch.seqs[i] for i in members] if self._observer is not None else [], self._observer)

    def _use_kernel(self) -> bool:
        return _kernel_is_triton(self.options, self.device)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVStorage, plan: QuestPlan) -> torch.Tensor:
        dense = layer < self.options.dense_layers
        for group in plan.groups:
            group.layer = layer
        if self.flash is None:
            return super().forward(layer, q, k, v, kv, plan.dense if dense or plan.sparse is None else plan.sparse)
        kv.store(k, v, plan.dense.slot_mapping)  # through the storage: it keeps the key bounds
        q = q.contiguous()
        if dense or not plan.groups:
            return self.flash.attend(q, k, v, kv, plan.dense)
        out = torch.empty_like(q)
        if plan.rest is not None:
            self.flash.attend(q, k, v, kv, plan.rest, out)
        for group in plan.groups:
            group.attend(q, kv, self.scale, out)
        return out
