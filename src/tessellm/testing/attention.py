"""Plain-torch attention reference and random packed batches, for every attention
backend's tests: tessellm's own kernels and third-party ones are checked against it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch

from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.attention import LatentProjection
from tessellm.core.interfaces.kv import DenseKVStorage, KVLayout, LatentKVStorage
from tessellm.core.model.spec import LayerAttention, ModelSpec


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v for ONE sequence, in float64.

    q [Q, Hq, D] are the last Q of the L positions whose keys/values are k, v [L, Hkv, D];
    query i sits at position L - Q + i and sees keys j <= that position (and, with a window
    W, only those with position - j < W). ``softcap``: the scaled scores s become
    softcap * tanh(s / softcap) before masking (Gemma 2). ``sinks`` [Hq]: one logit per query
    head added to each of its softmax denominators, attending no value (GPT-OSS); a row's
    weights then sum to less than one. ``causal`` False (an encoder's layer, plugin API 1.18):
    every query sees every key, within a window both ways (|position - j| < W). Returns
    [Q, Hq, D] float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)  # GQA: each KV head serves hq // hkv query heads
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Q, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(n_k - n_q, n_k)[:, None]
    k_pos = torch.arange(n_k)[None, :]
    allowed = k_pos <= q_pos if causal else torch.ones(n_q, n_k, dtype=torch.bool)
    if window is not None:
        allowed &= (q_pos - k_pos < window) if causal else ((q_pos - k_pos).abs() < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # the sink is one more logit in the softmax, with no value
        sink = sinks.double().cpu()[:, None, None].expand(hq, n_q, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        weights = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


class ReferenceKeyBoundsStorage(DenseKVStorage):
    """``DenseKVStorage`` with the "key_bounds" extra computed by brute force: per page
    (``layout.bounds_page``), the minimum and maximum over every slot written so far. The reference for backends that read
    key bounds (QUEST), and for caches that keep them incrementally."""

    def __init__(self, layout: KVLayout, num_slots: int, num_kv_heads: int, head_dim: int, device: torch.device):
        super().__init__(layout, num_slots, num_kv_heads, head_dim, device)
        self.written = torch.zeros(num_slots, dtype=torch.bool, device=device)

    def store(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        super().store(k, v, slot_mapping)
        self.written[slot_mapping] = True

    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        page = self.layout.bounds_page
        keys = self.k.view(-1, page, *self.k.shape[1:])
        unwritten = ~self.written.view(keys.shape[0], -1)[:, :, None, None]
        return (keys.masked_fill(unwritten, float("inf")).amin(dim=1),
                keys.masked_fill(unwritten, float("-inf")).amax(dim=1))


@dataclass
class PackedCase:
    """A random packed batch: per-sequence full K/V, query lengths, and a scattered cache."""

    q: torch.Tensor  # [T, Hq, D] packed queries
    k_new: torch.Tensor  # [T, Hkv, D] the new tokens' keys
    v_new: torch.Tensor
    k_full: list[torch.Tensor]  # per sequence [L, Hkv, D]
    v_full: list[torch.Tensor]
    q_lens: list[int]
    kv_lens: list[int]
    batch: BatchMetadata
    storage: DenseKVStorage


def make_case(kv_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, seed: int, shared_blocks: int = 0,
              extras: frozenset[str] = frozenset(), page_size: int | None = None) -> PackedCase:
    """Sequences of context ``kv_lens`` whose last ``q_lens`` tokens are this step's queries;
    earlier tokens are already in a cache whose blocks are scattered at random.

    ``shared_blocks``: every sequence whose cached context covers that many whole blocks
    starts with the same blocks (the same physical ids and K/V), as prefix caching and
    parallel sampling leave them. ``extras``: layout extras the storage keeps ("key_bounds":
    ``ReferenceKeyBoundsStorage``, per page of ``page_size`` tokens; None: per block)."""
    g = torch.Generator().manual_seed(seed)
    tables, sharing, num_blocks = _scattered_tables(kv_lens, q_lens, block_size, shared_blocks, g)
    prefix = shared_blocks * block_size
    prefix_k = torch.randn(prefix, num_kv_heads, head_dim, generator=g).to(dtype)
    prefix_v = torch.randn(prefix, num_kv_heads, head_dim, generator=g).to(dtype)
    layout = KVLayout("kv", block_size, dtype, frozenset(extras), page_size)
    storage_cls = ReferenceKeyBoundsStorage if "key_bounds" in extras else DenseKVStorage
    storage = storage_cls(layout, num_blocks * block_size, num_kv_heads, head_dim, torch.device("cpu"))
    storage.k.fill_(float("nan"))  # unwritten slots must never be read, not even masked
    storage.v.fill_(float("nan"))
    k_full, v_full, qs, k_new, v_new, slots, positions = [], [], [], [], [], [], []
    for n_kv, n_q, table, shares in zip(kv_lens, q_lens, tables, sharing):
        k = torch.randn(n_kv, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n_kv, num_kv_heads, head_dim, generator=g).to(dtype)
        if shares:
            k[:prefix], v[:prefix] = prefix_k, prefix_v
        k_full.append(k)
        v_full.append(v)
        qs.append(torch.randn(n_q, num_heads, head_dim, generator=g).to(dtype))
        seq_slots = _slots(table, n_kv, block_size)
        past = n_kv - n_q
        storage.store(k[:past], v[:past], seq_slots[:past])  # context cached by earlier steps
        k_new.append(k[past:])
        v_new.append(v[past:])
        slots.append(seq_slots[past:])
        positions.append(torch.arange(past, n_kv))
    batch = _packed_batch(kv_lens, q_lens, tables, slots, positions, block_size)
    return PackedCase(torch.cat(qs), torch.cat(k_new), torch.cat(v_new), k_full, v_full, list(q_lens),
                      list(kv_lens), batch, storage)


def _scattered_tables(kv_lens: list[int], q_lens: list[int], block_size: int, shared_blocks: int,
                      g: torch.Generator) -> tuple[list[list[int]], list[bool], int]:
    """Block tables drawn at random from a pool a few blocks larger than needed (so tables are
    not a plain range), the first ``shared_blocks`` the same for every sequence whose cached
    context covers them; returns (tables, which sequences share, pool size)."""
    blocks_per_seq = [math.ceil(n / block_size) for n in kv_lens]
    sharing = [n - q >= shared_blocks * block_size > 0 for n, q in zip(kv_lens, q_lens)]
    num_blocks = sum(blocks_per_seq) + shared_blocks + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    shared, start = perm[:shared_blocks], shared_blocks
    tables = []
    for n, shares in zip(blocks_per_seq, sharing):
        own = n - shared_blocks if shares else n
        tables.append((shared if shares else []) + perm[start:start + own])
        start += own
    return tables, sharing, num_blocks


def _slots(table: list[int], length: int, block_size: int) -> torch.Tensor:
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)],
                        dtype=torch.long)


def _packed_batch(kv_lens: list[int], q_lens: list[int], tables: list[list[int]], slots: list[torch.Tensor],
                  positions: list[torch.Tensor], block_size: int) -> BatchMetadata:
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    return BatchMetadata(
        input_ids=torch.zeros(qsl[-1], dtype=torch.long), positions=torch.cat(positions),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        slot_mapping=torch.cat(slots), block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables]),
        logits_indices=torch.tensor([e - 1 for e in qsl[1:]]), query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(kv_lens), block_tables_cpu=tables, block_size=block_size, seqs=[], samples=[])


@dataclass
class LatentCase:
    """A random packed batch for multi-head latent attention: each sequence's latents (its
    compressed ``c`` then its rope key, [L, kv_lora_rank + rope_dim]), the step's queries in
    two parts, the layer's up-projection, and a scattered latent cache holding the context
    before this step (NaN everywhere else)."""

    q_nope: torch.Tensor  # [T, H, nope]
    q_pe: torch.Tensor  # [T, H, rope]
    latent_new: torch.Tensor  # [T, latent_dim] the new tokens' latents
    latent_full: list[torch.Tensor]  # per sequence [L, latent_dim]
    up: LatentProjection
    q_lens: list[int]
    kv_lens: list[int]
    batch: BatchMetadata
    storage: LatentKVStorage
    scale: float


def make_latent_case(kv_lens: list[int], q_lens: list[int], num_heads: int, kv_lora_rank: int, rope_dim: int,
                     nope_dim: int, v_dim: int, block_size: int, dtype: torch.dtype, seed: int,
                     shared_blocks: int = 0) -> LatentCase:
    """``make_case`` for MLA: sequences of context ``kv_lens`` whose last ``q_lens`` tokens
    are this step's queries, with random up-projections scaled so keys and values have unit
    variance."""
    g = torch.Generator().manual_seed(seed)
    tables, sharing, num_blocks = _scattered_tables(kv_lens, q_lens, block_size, shared_blocks, g)
    latent_dim = kv_lora_rank + rope_dim
    prefix = torch.randn(shared_blocks * block_size, latent_dim, generator=g).to(dtype)
    up = LatentProjection(
        w_uk=(torch.randn(num_heads, nope_dim, kv_lora_rank, generator=g) / kv_lora_rank ** 0.5).to(dtype),
        w_uv=(torch.randn(num_heads, v_dim, kv_lora_rank, generator=g) / kv_lora_rank ** 0.5).to(dtype))
    storage = LatentKVStorage(KVLayout("latent", block_size, dtype), num_blocks * block_size, latent_dim,
                              torch.device("cpu"))
    storage.c.fill_(float("nan"))  # unwritten slots must never be read, not even masked
    full, q_nope, q_pe, new, slots, positions = [], [], [], [], [], []
    for n_kv, n_q, table, shares in zip(kv_lens, q_lens, tables, sharing):
        lat = torch.randn(n_kv, latent_dim, generator=g).to(dtype)
        if shares:
            lat[:len(prefix)] = prefix
        full.append(lat)
        q_nope.append(torch.randn(n_q, num_heads, nope_dim, generator=g).to(dtype))
        q_pe.append(torch.randn(n_q, num_heads, rope_dim, generator=g).to(dtype))
        seq_slots = _slots(table, n_kv, block_size)
        past = n_kv - n_q
        storage.store(lat[:past, None], None, seq_slots[:past])
        new.append(lat[past:])
        slots.append(seq_slots[past:])
        positions.append(torch.arange(past, n_kv))
    batch = _packed_batch(kv_lens, q_lens, tables, slots, positions, block_size)
    return LatentCase(torch.cat(q_nope), torch.cat(q_pe), torch.cat(new), full, up, list(q_lens), list(kv_lens),
                      batch, storage, (nope_dim + rope_dim) ** -0.5)


def reference_latent_attention(case: LatentCase) -> torch.Tensor:
    """MLA's result for ``case`` in float64 from first principles: every sequence's context
    up-projected to per-head keys and values, then causal attention. [T, H, v_dim]."""
    outs, start = [], 0
    w_uk, w_uv = case.up.w_uk.double(), case.up.w_uv.double()
    r = case.up.kv_lora_rank
    for lat, n_q in zip(case.latent_full, case.q_lens):
        lat = lat.double()
        c, k_pe = lat[:, :r], lat[:, r:]
        keys = torch.cat((torch.einsum("lr,hnr->lhn", c, w_uk),
                          k_pe[:, None].expand(-1, w_uk.shape[0], -1)), dim=-1)
        values = torch.einsum("lr,hvr->lhv", c, w_uv)
        q = torch.cat((case.q_nope[start:start + n_q], case.q_pe[start:start + n_q]), dim=-1)
        outs.append(reference_attention(q, keys, values, case.scale))
        start += n_q
    return torch.cat(outs)


def batch_to(batch: BatchMetadata, device: torch.device | str) -> BatchMetadata:
    """``batch`` with every tensor field on ``device`` (the host lists stay as they are)."""
    import dataclasses

    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


def case_to(case: PackedCase, device: torch.device | str) -> PackedCase:
    """The case with the kernel's inputs on ``device``: queries, new keys and values, the
    batch's tensors and every tensor the storage holds (moved in place; ``k_full``/``v_full``,
    which the float64 reference reads, stay where they are)."""
    import dataclasses

    for name, value in vars(case.storage).items():
        if isinstance(value, torch.Tensor):
            setattr(case.storage, name, value.to(device))
    return dataclasses.replace(case, q=case.q.to(device), k_new=case.k_new.to(device), v_new=case.v_new.to(device),
                               batch=batch_to(case.batch, device))


def int8_case(case: PackedCase, key_bounds: bool = False) -> PackedCase:
    """The same batch over the `paged` cache's int8 storage (with key bounds if asked): the
    cached context stored quantized, the scales of unwritten slots NaN (a kernel that reads
    one fails), and ``k_full``/``v_full`` what the cache holds (each token's quantize-
    dequantize round trip), so the float64 reference reads what the backend reads."""
    import dataclasses

    from tessellm.plugins.cache.paged.int8_kv import Int8KVStorage
    from tessellm.plugins.cache.paged.key_bounds import BoundedInt8KVStorage

    slots, heads, dim = case.storage.k.shape
    bs = case.batch.block_size
    extras = frozenset({"key_bounds"}) if key_bounds else frozenset()
    cls = BoundedInt8KVStorage if key_bounds else Int8KVStorage
    storage = cls(KVLayout("kv", bs, torch.int8, extras), slots, heads, dim, torch.device("cpu"), case.q.dtype)
    storage.k_scale.fill_(float("nan"))
    storage.v_scale.fill_(float("nan"))
    for table, n_kv, n_q, k, v in zip(case.batch.block_tables_cpu, case.kv_lens, case.q_lens, case.k_full, case.v_full):
        past = torch.arange(n_kv - n_q)
        storage.store(k[past], v[past], torch.tensor(table, dtype=torch.long)[past // bs] * bs + past % bs)
    return dataclasses.replace(case, storage=storage, k_full=[storage.stored_value(k) for k in case.k_full],
                               v_full=[storage.stored_value(v) for v in case.v_full])


def reference_packed(case: PackedCase, scale: float, window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """The float64 reference for every packed query row of ``case``: [T, Hq, D]; ``softcap``,
    ``sinks`` [Hq] and ``causal`` as in ``reference_attention``."""
    outs, start = [], 0
    for k, v, n_q in zip(case.k_full, case.v_full, case.q_lens):
        outs.append(reference_attention(case.q[start:start + n_q], k, v, scale, window, softcap, sinks, causal))
        start += n_q
    return torch.cat(outs)


def assert_stored(case: PackedCase, what: str = "forward") -> None:
    """Assert that the backend's forward stored the step's new K and V at the batch's slot
    mapping, bit for bit: a backend that attends over ``k``/``v`` directly and never stores
    them matches the reference in this step, yet every later step would read stale slots."""
    k_back, v_back = case.storage.gather(case.batch.slot_mapping)
    assert torch.equal(k_back, case.k_new.to(k_back.dtype)) and torch.equal(v_back, case.v_new.to(v_back.dtype)), \
        f"{what}: forward did not store the step's new K/V at the slot mapping"


def model_stub(head_dim: int, window: int | None = None,
               layers: Sequence[LayerAttention] = ()) -> SimpleNamespace:
    """The ModelSpec facts an attention backend reads: its scale, head dim, model-wide
    window and (plugin API 1.8) what each layer computes. ``layers``: one ``LayerAttention``
    per layer (windows, softcaps, sinks); empty: one layer with the model-wide ``window``.
    ``attention_of`` and ``attention_features`` are ModelSpec's own."""
    stub = SimpleNamespace(attention_scale=head_dim ** -0.5, sliding_window=window, head_dim=head_dim,
                           model_type="stub", num_layers=max(len(layers), 1), layer_attention=tuple(layers),
                           vision=None)
    stub.attention_of = partial(ModelSpec.attention_of, stub)
    stub.attention_features = partial(ModelSpec.attention_features, stub)
    return stub
