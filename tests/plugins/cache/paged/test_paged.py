"""`paged`: a hypothesis state machine plays the engine's part (match a prefix, reserve,
compute, commit, grow, fork, roll back, free, reset) on a PagedCache built without a model,
with prompts from a tiny vocabulary so prefixes repeat. Every computed token is stored as
``token_id * 10_000 + position``, so reading a sequence back proves that copy-on-write and
prefix sharing never hand anyone a slot someone else overwrote."""

from __future__ import annotations

import pydantic
import pytest
import torch
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.plugins.cache.paged import PagedCache, PagedOptions, block_key, bytes_per_block

VOCAB = [1, 2, 3]
# prompts are a prefix of one of these plus a short random tail, so full blocks repeat often
BASES = [[1] * 64, [1, 2] * 32, [(i * i) % 3 + 1 for i in range(64)]]
SALTS = [None, "a", "b"]
MAX_LIVE = 6


def make_cache(block_size: int, num_blocks: int | None, prefix_caching: bool = True, **options) -> PagedCache:
    opts = PagedOptions(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching, **options)
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float64, device=torch.device("cpu"),
                     max_model_len=4096)
    return PagedCache(opts, spec, KVLayout("kv", block_size, torch.float64))


def new_seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def value(token: int, pos: int) -> float:
    """What a token's K and V hold: its id and position, so a stale or foreign slot shows."""
    return float(token * 10_000 + pos)


def compute(cache: PagedCache, seq: Sequence, n: int, lookahead: int = 0) -> None:
    """One engine step for ``seq``: reserve, store K=V for tokens [computed, n), commit."""
    cache.reserve(seq, n + lookahead)
    bs = cache.layout.block_size
    table = cache.block_table(seq)
    pos = list(range(seq.num_computed_tokens, n))
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in pos], dtype=torch.long)
    kv = torch.tensor([value(seq.token_ids[p], p) for p in pos], dtype=torch.float64).view(-1, 1, 1)
    cache.layer(0).store(kv, kv.clone(), slots)
    seq.num_computed_tokens = n
    cache.commit(seq)


def read(cache: PagedCache, seq: Sequence) -> list[float]:
    k, v = cache.layer(0).read(cache.block_table(seq), seq.num_computed_tokens)
    assert torch.equal(k, v)
    return k.flatten().tolist()


def expected(seq: Sequence) -> list[float]:
    return [value(t, p) for p, t in enumerate(seq.token_ids[:seq.num_computed_tokens])]


def prompt(base: int, length: int) -> list[int]:
    return BASES[base][:length]


class PagedMachine(RuleBasedStateMachine):
    """``live`` maps seq_id to the sequences the engine holds; ``tabled`` those the cache has
    a block table for (reserved, matched with prefix caching on, or forked). With prefix
    caching, ``committed`` holds every (salt, full-block prefix) computed since the last reset
    and ``content`` what the block of each content key must hold."""

    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), slots=st.sampled_from([32, 64, 128]),
                prefix_caching=st.booleans())
    def start(self, block_size, slots, prefix_caching):
        self.bs = block_size
        self.cache = make_cache(block_size, slots // block_size, prefix_caching)
        self.live: dict[int, Sequence] = {}
        self.tabled: set[int] = set()
        self.committed: set[tuple[str | None, tuple[int, ...]]] = set()
        self.content: dict[bytes, list[float]] = {}

    def _pick(self, data, ids) -> Sequence:
        return self.live[data.draw(st.sampled_from(sorted(ids)))]

    def _compute(self, seq: Sequence, n: int, lookahead: int = 0) -> None:
        compute(self.cache, seq, n, lookahead)
        self.tabled.add(seq.seq_id)
        if not self.cache.options.prefix_caching:
            return
        bs, table, key = self.bs, self.cache.block_table(seq), None
        for i in range(n // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            key = block_key(key, tokens, seq.cache_salt)
            self.committed.add((seq.cache_salt, tuple(seq.token_ids[:(i + 1) * bs])))
            self.content[key] = [value(t, i * bs + j) for j, t in enumerate(tokens)]
            if self.cache.pool.is_cached(table[i]):  # indexed: under this very prefix
                assert self.cache.pool.lookup(key) == table[i], (seq, i)

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(base=st.integers(0, len(BASES) - 1), length=st.integers(1, 40),
          tail=st.lists(st.sampled_from(VOCAB), max_size=2), salt=st.sampled_from(SALTS),
          prefill=st.sampled_from([None, None, 0, 5]))
    def add(self, base, length, tail, salt, prefill):
        """Admit a request: match its prompt against the prefix cache, then compute the whole
        prompt (None), nothing yet (0), or a first chunk, if it fits."""
        seq = new_seq(prompt(base, length) + tail, salt)
        hit = self.cache.match_prefix(seq)
        assert hit % self.bs == 0 and 0 <= hit < seq.num_tokens, "a match leaves a token to compute"
        if hit:
            event("prefix hit")
            assert (salt, tuple(seq.token_ids[:hit])) in self.committed, "a hit was computed, with this salt"
        seq.num_computed_tokens = hit
        self.live[seq.seq_id] = seq
        if self.cache.options.prefix_caching:
            self.tabled.add(seq.seq_id)
        else:
            assert hit == 0
        n = seq.num_tokens if prefill is None else min(hit + prefill, seq.num_tokens)
        if n > hit and self.cache.can_reserve(seq, n):
            self._compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 24), lookahead=st.integers(0, 3), sampled=st.sampled_from(VOCAB))
    def step(self, data, k, lookahead, sampled):
        """Compute up to k pending tokens of one sequence (a decode step first samples one if
        none is pending), reserving ``lookahead`` slots more as a speculative decoder does."""
        self._advance(self._pick(data, self.live), k, lookahead, sampled)

    def _advance(self, seq: Sequence, k: int, lookahead: int, sampled: int) -> None:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(sampled)
        n = min(seq.num_computed_tokens + k, seq.num_tokens)
        if self.cache.can_reserve(seq, n + lookahead):
            copies = self.cache.cow_copies
            self._compute(seq, n, lookahead)
            if self.cache.cow_copies > copies:
                event("copy on write")
        else:
            event("reserve refused")
            table = list(self.cache.block_table(seq)) if seq.seq_id in self.tabled else None
            refs = list(self.cache.pool.ref_counts)
            with pytest.raises(RuntimeError):
                self.cache.reserve(seq, n + lookahead)
            # a refused reserve changes nothing
            assert self.cache.pool.ref_counts == refs
            if table is not None:
                assert self.cache.block_table(seq) == table

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=3))
    def append(self, data, tokens):
        """Sampled tokens join the sequence; their KV comes with the next step."""
        self._pick(data, self.live).token_ids.extend(tokens)

    @precondition(lambda self: self.tabled and len(self.live) < MAX_LIVE)
    @rule(data=st.data(), samples=st.lists(st.sampled_from(VOCAB), min_size=2, max_size=2))
    def fork(self, data, samples):
        """Parallel sampling: the child shares the parent's blocks, then each appends its own
        sampled token, so the next step of either writes into a shared partial block."""
        parent = self._pick(data, self.tabled)
        child = parent.fork(1)
        assert self.cache.can_fork(parent)
        self.cache.fork(parent, child)
        self.live[child.seq_id] = child
        self.tabled.add(child.seq_id)
        for a, b in zip(self.cache.block_table(parent), self.cache.block_table(child)):
            assert a == b and self.cache.pool.ref_counts[a] >= 2
        parent.token_ids.append(samples[0])
        child.token_ids.append(samples[1])

    @precondition(lambda self: self.tabled)
    @rule(data=st.data(), drop=st.booleans(), redo=st.lists(st.sampled_from(VOCAB), max_size=12))
    def truncate(self, data, drop, redo):
        """Roll back to m computed tokens; the tokens past m are either dropped (rejected
        drafts) or kept to be computed again. Then ``redo`` tokens are appended and all
        pending ones computed at once, rewriting the slots the rollback released (a block
        shared or indexed must be copied first)."""
        seq = self._pick(data, self.tabled)
        m = data.draw(st.integers(0, seq.num_computed_tokens))
        seq.num_computed_tokens = m
        self.cache.truncate(seq, m)
        assert len(self.cache.block_table(seq)) == -(-m // self.bs)
        if drop:
            del seq.token_ids[m:]
        if redo:
            seq.token_ids.extend(redo)
            self._advance(seq, seq.num_tokens - m, 0, redo[0])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.tabled.discard(seq.seq_id)
        self.cache.free(seq)

    @rule()
    def reset_prefix_cache(self):
        self.cache.reset_prefix_cache()
        assert self.cache.pool.num_cached == 0
        assert all(self.cache.pool.lookup(key) is None for key in self.content)
        self.committed.clear()

    # ------------------------------------------------------------------ invariants

    def _tables(self) -> dict[int, list[int]]:
        return {i: self.cache.block_table(self.live[i]) for i in self.tabled}

    @invariant()
    def contents_are_what_was_written(self):
        """(a) every live sequence reads back its own tokens at their own positions."""
        for i, seq in self.live.items():
            if seq.num_computed_tokens:
                assert i in self.tabled
                assert read(self.cache, seq) == expected(seq), seq

    @invariant()
    def index_holds_what_it_claims(self):
        """A block found by content key holds that content: an indexed block is never written."""
        slots = self.cache.layer(0).k.flatten().tolist()
        bs = self.bs
        for key, values in self.content.items():
            block = self.cache.pool.lookup(key)
            if block is not None:
                assert slots[block * bs:(block + 1) * bs] == values, block

    @invariant()
    def ref_counts_count_tables(self):
        """(b) a block's reference count is the number of live tables holding it."""
        held = [0] * self.cache.num_blocks
        for i, table in self._tables().items():
            assert len(set(table)) == len(table)
            assert len(table) * self.bs >= self.live[i].num_computed_tokens
            for block in table:
                held[block] += 1
        assert self.cache.pool.ref_counts == held

    @invariant()
    def states_partition_the_pool(self):
        """(c) free, in use and cached blocks partition the pool; (d) free + in use = all;
        (e) no block of a live table is free or cached."""
        pool = self.cache.pool
        free, cached = pool.free_blocks(), pool.cached_blocks()
        in_use = {b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0}
        assert not (free & cached) and not (free & in_use) and not (cached & in_use)
        assert free | cached | in_use == set(range(pool.num_blocks))
        assert self.cache.num_free_blocks + len(in_use) == self.cache.num_blocks
        held = {b for table in self._tables().values() for b in table}
        assert held == in_use and not held & (free | cached)

    @invariant()
    def used_slots_within_allocated(self):
        """(f) valid slots never exceed allocated ones."""
        assert 0 <= self.cache.num_used_slots() <= self.cache.num_allocated_slots()

    def teardown(self):
        for seq in list(self.live.values()):
            self.cache.free(seq)
        assert self.cache.num_free_blocks == self.cache.num_blocks
        pool = self.cache.pool
        assert pool.num_used == 0 and len(pool.free_blocks()) + pool.num_cached == pool.num_blocks
        assert self.cache.num_used_slots() == 0 and self.cache.num_allocated_slots() == 0


TestPagedMachine = PagedMachine.TestCase
TestPagedMachine.settings = settings(max_examples=400, stateful_step_count=40)  # about 5 s


# ---------------------------------------------------------------------- unit tests


def test_prefix_hit_reuses_full_blocks():
    cache = make_cache(4, 8)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 2.5 blocks
    a = new_seq(tokens)
    assert cache.match_prefix(a) == 0
    compute(cache, a, len(tokens))
    b = new_seq(tokens)
    b.num_computed_tokens = cache.match_prefix(b)
    assert b.num_computed_tokens == 8
    assert cache.block_table(b) == cache.block_table(a)[:2]
    assert read(cache, b) == expected(b)
    assert cache.prefix_cache_stats().queried_tokens == 10  # b's lookup counts once b has run
    cache.free(b)  # b cannot start after all: its lookup is dropped, and repeated later
    b.num_computed_tokens = cache.match_prefix(b)
    compute(cache, b, len(tokens))
    stats = cache.prefix_cache_stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (20, 8) and stats.hit_rate == pytest.approx(0.4)
    assert read(cache, b) == expected(b) and read(cache, a) == expected(a)


def test_never_matches_the_whole_prompt():
    cache = make_cache(4, 8)
    tokens = list(range(1, 9))  # exactly 2 full blocks
    a = new_seq(tokens)
    cache.match_prefix(a)
    compute(cache, a, 8)
    cache.free(a)
    b = new_seq(tokens)
    assert cache.match_prefix(b) == 4  # the last token's logits must be computed


def test_cache_salt_isolates_prefixes():
    cache = make_cache(4, 16)
    tokens = list(range(1, 10))

    def run(salt):
        seq = new_seq(tokens, salt)
        seq.num_computed_tokens = hit = cache.match_prefix(seq)
        compute(cache, seq, len(tokens))
        cache.free(seq)
        return hit

    assert run("a") == 0
    assert run("b") == 0
    assert run("a") == 8
    assert run(None) == 0
    assert run(None) == 8
    assert run("a") == 8


def test_lru_eviction_of_cached_blocks():
    cache = make_cache(4, 4)
    p1, p2 = [1] * 9, [2] * 9  # 2 full blocks + 1 token each
    a = new_seq(p1)
    cache.match_prefix(a)
    compute(cache, a, 9)
    a_blocks = list(cache.block_table(a))
    cache.free(a)  # tail first: the second full block is released before the first
    assert cache.pool.num_cached == 2 and cache.num_free_blocks == 4
    b = new_seq(p2)
    cache.match_prefix(b)
    compute(cache, b, 9)  # 3 blocks: the 2 free ones, then evict the least recently released
    assert cache.pool.evictions == 1 and a_blocks[1] in cache.block_table(b)
    assert cache.pool.cached_blocks() == {a_blocks[0]}
    c = new_seq(p1)
    c.num_computed_tokens = cache.match_prefix(c)
    assert c.num_computed_tokens == 4 and cache.block_table(c) == a_blocks[:1]  # evicted block not matched
    assert read(cache, c) == expected(c)


def test_lru_evicts_the_earlier_finished_request_first():
    cache = make_cache(2, 4)
    a, b = new_seq([1, 1, 1]), new_seq([2, 2, 2])
    for seq in (a, b):
        cache.match_prefix(seq)
        compute(cache, seq, 3)
    a_full, b_full = cache.block_table(a)[0], cache.block_table(b)[0]
    cache.free(a)
    cache.free(b)
    c = new_seq([3, 3, 3, 3, 3, 3, 3])  # 4 blocks: 2 free, then a's cached block, then b's
    cache.match_prefix(c)
    cache.reserve(c, 5)
    assert cache.pool.cached_blocks() == {b_full} and a_full in cache.block_table(c)


def test_fork_shares_blocks_and_copies_on_first_write():
    cache = make_cache(4, 8)
    parent = new_seq([1, 2, 3, 4, 5, 6])
    cache.match_prefix(parent)
    compute(cache, parent, 6)
    child = parent.fork(1)
    assert cache.can_fork(parent)
    cache.fork(parent, child)
    assert cache.block_table(child) == cache.block_table(parent)
    assert [cache.pool.ref_counts[b] for b in cache.block_table(parent)] == [2, 2]
    parent.token_ids.append(7)
    compute(cache, parent, 7)  # writes into the shared partial block: copies exactly it
    assert cache.cow_copies == 1
    pt, ct = cache.block_table(parent), cache.block_table(child)
    assert pt[0] == ct[0] and pt[1] != ct[1]
    assert [cache.pool.ref_counts[b] for b in (pt[0], pt[1], ct[1])] == [2, 1, 1]
    child.token_ids.append(8)
    compute(cache, child, 7)  # the child now owns its block alone: written in place
    assert cache.cow_copies == 1 and cache.block_table(child) == ct
    assert read(cache, parent) == expected(parent) and read(cache, parent)[6] == value(7, 6)
    assert read(cache, child) == expected(child) and read(cache, child)[6] == value(8, 6)
    cache.free(parent)
    cache.free(child)
    assert cache.num_free_blocks == cache.num_blocks and cache.pool.num_used == 0


def test_try_reserve_equals_can_reserve_then_reserve():
    """The fast path (a write inside the last block) changes nothing; a shared block about to be
    written is still copied; a full cache answers False and allocates nothing."""
    cache = make_cache(4, 4)
    parent = new_seq([1, 2, 3, 4, 5, 6])
    cache.match_prefix(parent)
    compute(cache, parent, 6)
    table = list(cache.block_table(parent))
    assert cache.try_reserve(parent, 7) and cache.block_table(parent) == table  # room in block 1
    child = parent.fork(1)
    cache.fork(parent, child)
    assert cache.try_reserve(parent, 7) and cache.cow_copies == 1  # block 1 is shared: copied first
    assert cache.block_table(parent)[1] != table[1]
    hog = new_seq([9] * 8)
    assert cache.num_free_blocks == 1 and not cache.try_reserve(hog, 8)  # needs 2 blocks
    assert cache.num_free_blocks == 1 and hog.seq_id not in cache._tables
    assert cache.try_reserve(hog, 4) and cache.num_free_blocks == 0


def test_reset_prefix_cache():
    cache = make_cache(4, 8)
    tokens = list(range(1, 11))
    a, live = new_seq(tokens), new_seq([9] * 9)
    for seq in (a, live):
        cache.match_prefix(seq)
        compute(cache, seq, seq.num_tokens)
    cache.free(a)
    assert cache.pool.num_cached == 2
    assert cache.reset_prefix_cache() == 4  # a's 2 cached blocks and live's 2 in-use ones
    assert cache.pool.num_cached == 0 and cache.num_free_blocks == 8 - 3
    assert cache.match_prefix(new_seq(tokens)) == 0
    # a live sequence keeps its blocks and indexes them again as it commits
    live.token_ids.append(9)
    compute(cache, live, 10)
    again = new_seq([9] * 9)
    assert cache.match_prefix(again) == 8 and cache.block_table(again) == cache.block_table(live)[:2]


def test_max_seq_tokens_and_full_pool():
    cache = make_cache(4, 3)
    assert cache.max_seq_tokens == 12
    seq = new_seq(list(range(13)))
    assert not cache.can_reserve(seq, 13)
    with pytest.raises(RuntimeError, match="needs 13 slots; the cache holds 12"):
        cache.reserve(seq, 13)
    cache.reserve(seq, 12)
    other = new_seq([1])
    assert not cache.can_reserve(other, 1)
    with pytest.raises(RuntimeError, match="paged cache is full"):
        cache.reserve(other, 1)
    cache.free(other)  # holds nothing: a no-op
    assert cache.num_free_blocks == 0


def test_capacity_from_the_cpu_memory_budget():
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
                     max_model_len=256)
    per_block = 2 * 16 * 2 * 2 * 8 * 4  # K and V, block 16, 2 layers, 2 heads, dim 8, 4 bytes
    assert bytes_per_block(spec, 16, torch.float32) == per_block
    budget = 2**20 + 100
    cache = PagedCache(PagedOptions(block_size=16, cpu_memory_bytes=budget), spec, KVLayout("kv", 16, torch.float32))
    assert cache.num_blocks == budget // per_block - 1 == 255  # one block is the scratch block
    assert cache.layer(1).k.shape == (256 * 16, 2, 8)  # the storage fills the budget
    assert make_cache(16, 5).num_blocks == 5  # num_blocks overrides the budget


@pytest.mark.parametrize("share, reserved, expected", [(1.0, 0, 100), (0.1, 4, 10), (0.02, 4, 0)])
def test_a_cuda_budget_stays_within_the_process_share(monkeypatch, share, reserved, expected):
    """On CUDA the cache takes its fraction of the free memory, but never more than this
    process may still take under ``torch.cuda.set_per_process_memory_fraction`` (test
    workers sharing a GPU): 140 GiB device, 100 free."""
    from tessellm.plugins.cache.paged.manager import _free_cuda_bytes

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: share, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved * gib)
    assert _free_cuda_bytes(torch.device("cuda", 0)) == expected * gib


@pytest.mark.parametrize("block_size, message", [(3, "power of two"), (0, "greater than or equal to 1")])
def test_block_size_must_be_a_positive_power_of_two(block_size, message):
    with pytest.raises(pydantic.ValidationError, match=message) as info:
        PagedOptions(block_size=block_size)
    assert "block_size" in str(info.value)


def test_num_used_slots_counts_shared_partial_blocks_once():
    cache = make_cache(16, 8)
    a, b = new_seq(list(range(20))), new_seq([1] * 5)
    for seq in (a, b):
        cache.match_prefix(seq)
        compute(cache, seq, seq.num_tokens)
    assert cache.num_allocated_slots() == 3 * 16 and cache.num_used_slots() == 20 + 5
    child = a.fork(1)
    cache.fork(a, child)
    assert cache.num_allocated_slots() == 3 * 16 and cache.num_used_slots() == 20 + 5
    child.token_ids.append(7)
    compute(cache, child, 21)  # copies the partial block: 16 shared + 4 + 5 + 5
    assert cache.num_allocated_slots() == 4 * 16 and cache.num_used_slots() == 16 + 4 + 5 + 5


def test_rollback_into_an_indexed_block_copies_it_before_rewriting():
    cache = make_cache(4, 8)
    a = new_seq([1, 2, 3, 4, 5])
    cache.match_prefix(a)
    compute(cache, a, 5)
    indexed = cache.block_table(a)[0]
    assert cache.pool.is_cached(indexed)
    a.num_computed_tokens = 2
    cache.truncate(a, 2)
    del a.token_ids[2:]
    a.token_ids += [9, 9, 9]
    compute(cache, a, 5)  # rewrites positions 2, 3 of the indexed block: a copy, not in place
    assert cache.cow_copies == 1 and cache.block_table(a)[0] != indexed
    assert read(cache, a) == expected(a)
    for tokens, block in (([1, 2, 3, 4, 6], indexed), ([1, 2, 9, 9, 6], cache.block_table(a)[0])):
        seq = new_seq(tokens)
        seq.num_computed_tokens = cache.match_prefix(seq)
        assert seq.num_computed_tokens == 4 and cache.block_table(seq) == [block]
        assert read(cache, seq) == expected(seq)


def test_num_used_slots_counts_a_shared_block_by_its_fullest_holder():
    """Distinct valid slots: a block full for the parent stays full however far a fork child
    sharing it rolls back. Minimal case found by the state machine (block 2, one 2-token
    sequence, fork, child truncated to 1): 2 valid slots, reported 1."""
    cache = make_cache(2, 4, prefix_caching=False)
    parent = new_seq([1, 1])
    compute(cache, parent, 2)
    child = parent.fork(1)
    cache.fork(parent, child)
    child.num_computed_tokens = 1
    cache.truncate(child, 1)
    assert read(cache, parent) == expected(parent) and read(cache, child) == expected(child)
    assert cache.num_allocated_slots() == 2
    assert cache.num_used_slots() == 2
