"""QUEST's page scoring, top-K selection and sparse attention over the chosen pages, in
plain torch (the CPU path, and the reference the GPU kernels are held to).

A page is what the cache keeps key bounds for (``KVLayout.bounds_page`` tokens, a cache block
or a part of one). Its score for a query q is the sum over channels of max(q_i * max_i,
q_i * min_i), with the page's elementwise key minimum and maximum: an upper bound of q . k
for every key k in the page. It splits into two matmuls, since the larger product takes the
maximum where q_i > 0 and the minimum where q_i < 0: score = relu(q) . max - relu(-q) . min.

A decode (one query row) takes ``num_picks`` pages by score, the first always among them,
then the newest: ``decode_page_scores``, ``pick_pages`` (torch's top-K) and
``decode_page_tables``, the steps kernels.py runs on a GPU, with static shapes and nothing
read back on the host, so the step can be captured in a CUDA graph. Several query rows (a
speculative verification) go through ``block_scores`` and ``select_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessellm.core.interfaces.kv import KVStorage


def block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q . k per block and query head: q [B, R, Hkv, G, D] (R query
    positions, G query heads per KV head), kmin, kmax [B, N, Hkv, D] (the bounds of each
    sequence's N blocks) -> [B, R, Hkv, G, N], in float32 or wider."""
    acc = torch.promote_types(q.dtype, torch.float32)
    qh = q.to(acc).permute(0, 2, 1, 3, 4)  # [B, Hkv, R, G, D]
    b, hkv, r, g, d = qh.shape
    qh = qh.reshape(b, hkv, r * g, d)
    hi = kmax.to(acc).permute(0, 2, 3, 1)  # [B, Hkv, D, N]
    lo = kmin.to(acc).permute(0, 2, 3, 1)
    scores = torch.matmul(qh.clamp(min=0), hi) - torch.matmul((-qh).clamp(min=0), lo)  # [B, Hkv, R*G, N]
    return scores.view(b, hkv, r, g, -1).permute(0, 2, 1, 3, 4)


def select_blocks(scores: torch.Tensor, block_ok: torch.Tensor, forced: torch.Tensor,
                  num_chosen: torch.Tensor, max_chosen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each (sequence, KV head) attends: ``forced`` ones always, then the best
    scored, ``num_chosen[b]`` in all for sequence b (never more than it has).

    scores [B, R, Hkv, G, N]; block_ok, forced [B, N] bool; num_chosen [B] int. A KV head's
    block score is the largest over its query positions and query heads (a block any of them
    may need is kept). Returns (index [B, Hkv, K] block columns in ascending order, chosen_ok
    [B, Hkv, K]) with K = min(max(num_chosen), N); a column past what a sequence chose or
    has comes back with chosen_ok False. ``max_chosen``: the largest of ``num_chosen`` where
    the caller knows it (else it is read back, a host synchronisation on a GPU).
    """
    per_head = scores.amax(dim=(1, 3))  # [B, Hkv, N]
    per_head = per_head.masked_fill(forced[:, None, :], float("inf"))
    per_head = per_head.masked_fill(~block_ok[:, None, :], float("-inf"))
    k = min(int(num_chosen.max()) if max_chosen is None else max_chosen, per_head.shape[-1])
    ranked = per_head.topk(k, dim=-1).indices  # best first: the forced (+inf) lead
    ok = block_ok[:, None, :].expand_as(per_head).gather(-1, ranked)
    ok &= torch.arange(k, device=ranked.device) < num_chosen[:, None, None]
    index, order = ranked.sort(dim=-1)
    return index, ok.gather(-1, order)


def gather_heads(kv: KVStorage, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each KV head at its own slots: slots [B, Hkv, S] -> [B, Hkv, S, D] each, in
    ``dtype`` (the compute dtype), read in place through ``kv_tensors`` (and ``kv_scales``
    for int8, dequantized as ``gather`` does)."""
    k_all, v_all = kv.kv_tensors()
    hkv = k_all.shape[1]
    # rows of [slots * Hkv, D]: index_select copies whole rows (advanced indexing with a
    # slot and a head index goes element by element, several times slower on a CPU)
    rows = (slots * hkv + torch.arange(slots.shape[1], device=slots.device)[None, :, None]).flatten()

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1]).index_select(0, rows).view(*slots.shape, t.shape[-1])

    k, v = pick(k_all), pick(v_all)
    if k_all.dtype == torch.int8:
        k_scale, v_scale = kv.kv_scales()
        k = (k.float() * pick(k_scale).float()).to(dtype)
        v = (v.float() * pick(v_scale).float()).to(dtype)
    return k.to(dtype), v.to(dtype)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pos: torch.Tensor,
                     key_ok: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [B, R, Hkv, G, D] over each KV head's own keys k, v [B, Hkv, S, D]
    at positions key_pos [B, Hkv, S] (``key_ok`` [B, Hkv, S] marks real ones); query r sits at
    q_pos [B, R] and sees keys at or before it. -> [B, R, Hkv, G, D]."""
    acc = torch.promote_types(q.dtype, torch.float32)
    b, r, hkv, g, d = q.shape
    qh = q.to(acc).permute(0, 2, 1, 3, 4).reshape(b, hkv, r * g, d)
    s = torch.matmul(qh, k.to(acc).transpose(-1, -2)) * scale  # [B, Hkv, R*G, S]
    seen = key_ok[:, :, None, :] & (key_pos[:, :, None, :] <= q_pos[:, None, :, None])  # [B, Hkv, R, S]
    seen = seen[:, :, :, None, :].expand(b, hkv, r, g, seen.shape[-1]).reshape(b, hkv, r * g, -1)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    o = torch.matmul(p, v.to(acc))  # [B, Hkv, R*G, D]
    return o.view(b, hkv, r, g, d).permute(0, 2, 1, 3, 4)


def page_ids(tables: torch.Tensor, cols: torch.Tensor, per_block: int) -> torch.Tensor:
    """Page ids of columns ``cols`` [B, ...] (a sequence's pages in position order) through
    block tables [B, W]: block * per_block + the page within it; columns past the table read
    its last block (callers mask them)."""
    b = tables.shape[0]
    index = (cols // per_block).clamp(max=tables.shape[1] - 1).reshape(b, -1)
    blocks = tables.long().gather(1, index).view(cols.shape)
    return blocks * per_block + cols % per_block


@dataclass
class DecodePages:
    """What every layer of a step's torch decode path shares, made once a step (``of``): each
    sequence's page ids in position order, table [B, N] (0 past its pages); its page count
    and context, num_pages, seq_lens [B] int64; the columns scored -inf, past [B, 1, N] (its
    newest page and beyond)."""

    table: torch.Tensor
    num_pages: torch.Tensor
    seq_lens: torch.Tensor
    past: torch.Tensor
    page: int

    @classmethod
    def of(cls, tables: torch.Tensor, seq_lens: torch.Tensor, page: int, per_block: int,
           num_cols: int) -> "DecodePages":
        """From block tables [B, W] of ``per_block`` pages of ``page`` tokens, and seq_lens [B]."""
        b = tables.shape[0]
        cols = torch.arange(num_cols, device=tables.device)
        seq_lens = seq_lens.long()
        num_pages = (seq_lens + page - 1) // page
        past = cols[None, :] >= num_pages[:, None] - 1
        table = page_ids(tables, cols.expand(b, -1), per_block).masked_fill(cols[None, :] >= num_pages[:, None], 0)
        return cls(table, num_pages, seq_lens, past[:, None, :], page)


def decode_page_scores(q: torch.Tensor, rows: torch.Tensor, pages: DecodePages, kmin: torch.Tensor,
                       kmax: torch.Tensor) -> torch.Tensor:
    """What ``_score_kernel`` computes: scores [B, Hkv, N] of each sequence's pages for its
    decoding row ``rows[b]`` of q [T, Hq, D]; +inf for the first page, -inf for the newest and
    for columns past the sequence's pages."""
    b, num_cols = pages.table.shape
    hkv = kmin.shape[1]
    query = q.index_select(0, rows.long()).view(b, 1, hkv, -1, q.shape[-1])
    flat = pages.table.flatten()
    lo, hi = (t.index_select(0, flat).view(b, num_cols, *t.shape[1:]) for t in (kmin, kmax))
    scores = block_scores(query, lo, hi).amax(dim=(1, 3))  # [B, Hkv, N]
    scores[..., 0] = float("inf")
    return scores.masked_fill(pages.past, float("-inf"))


def pick_pages(scores: torch.Tensor, num_picks: int) -> torch.Tensor:
    """The ``num_picks`` best-scored columns of each (sequence, KV head), in no particular
    order: scores [B, Hkv, N] -> [B, Hkv, num_picks] int64 (num_picks < N)."""
    return scores.topk(num_picks, dim=-1, sorted=False).indices


def decode_page_tables(picks: torch.Tensor, pages: DecodePages) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``_table_kernel`` computes: from picks [B, Hkv, P] (columns), each KV head's pages
    [B, Hkv, P + 1] int64 (the picks, then the newest page) and their token count [B, Hkv];
    a sequence of at most P + 1 pages gets all of them in position order. Entries past a
    head's tokens are page 0, never read."""
    b, hkv, num_picks = picks.shape
    page = pages.page
    dense = (pages.num_pages <= num_picks + 1)[:, None, None]
    newest = (pages.num_pages - 1)[:, None, None].expand(b, hkv, 1)
    k = torch.arange(num_picks + 1, device=picks.device).expand(b, hkv, -1)
    cols = torch.where(dense, k, torch.cat([picks, newest], dim=-1)).clamp(max=pages.table.shape[1] - 1)
    ids = pages.table.gather(1, cols.reshape(b, -1)).view(b, hkv, -1)  # 0 past the sequence's pages
    extra = torch.where(dense[..., 0], 0, num_picks * page - (pages.num_pages[:, None] - 1) * page)
    return ids, (pages.seq_lens[:, None] + extra).expand(b, hkv)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ok: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query row per sequence over each KV head's own keys: q [B, Hkv, G, D], k, v [B,
    Hkv, S, D], key_ok [B, Hkv, S] (every key is at or before the query) -> [B, Hkv, G, D]."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    p = torch.softmax(s.masked_fill(~key_ok[:, :, None, :], float("-inf")), dim=-1)
    return torch.matmul(p, v.to(acc))
