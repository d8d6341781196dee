"""`paged` for models with sliding-window layers (windowed.py over window_pool.py): a
hypothesis state machine plays the engine (match a prefix, reserve, compute, commit, grow,
fork, roll back drafts, free, reset) on caches built without a model, with full-attention and
sliding layers in several proportions. Every computed token is stored in every layer as
``layer * 1e8 + token_id * 10_000 + position``: reading back what each layer's queries can
still see (the whole context for full layers, the window for sliding ones) proves that
release, reuse across kinds, copy-on-write and prefix sharing never hand anyone a slot
someone else overwrote."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.plugins.cache.paged import PagedCache, PagedOptions
from tessellm.plugins.cache.paged.window_pool import FULL, SLIDING
from tessellm.plugins.cache.paged.windowed import WindowedPagedCache

VOCAB = [1, 2, 3]
BASES = [[1] * 64, [1, 2] * 32, [(i * i) % 3 + 1 for i in range(64)]]
MAX_LIVE = 5
LAYOUTS = {
    "alternating": (None, 6, None, 6),  # Gemma 2 / GPT-OSS: runs of 2 units, one of either kind a superblock
    "five-to-one": (6, 6, 6, 6, 6, None),  # Gemma 3: 1 full unit, 5 sliding: 5 full runs or 1 sliding one
    "two-windows": (None, 4, 7, 7),  # different windows: the largest decides what is released
    "all-sliding": (5, 5),  # Mistral, Phi-3: one kind
}


def make_cache(windows: tuple, block_size: int, num_blocks: int, prefix_caching: bool = True) -> WindowedPagedCache:
    options = PagedOptions(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching)
    spec = CacheSpec(num_layers=len(windows), num_kv_heads=1, head_dim=1, dtype=torch.float64,
                     device=torch.device("cpu"), max_model_len=4096, layer_windows=windows)
    cache = PagedCache(options, spec, KVLayout("kv", block_size, torch.float64))
    assert isinstance(cache, WindowedPagedCache)
    return cache


def value(layer: int, token: int, pos: int) -> float:
    return float(layer * 100_000_000 + token * 10_000 + pos)


def compute(cache: WindowedPagedCache, seq: Sequence, n: int, lookahead: int = 0) -> None:
    """One engine step: reserve, store every layer's K=V for tokens [computed, n) through its
    group's table, commit."""
    cache.reserve(seq, n + lookahead)
    bs = cache.layout.block_size
    pos = list(range(seq.num_computed_tokens, n))
    for group, layers in enumerate(cache.layer_groups):
        table = cache.group_block_table(seq, group)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in pos], dtype=torch.long)
        for layer in layers:
            kv = torch.tensor([value(layer, seq.token_ids[p], p) for p in pos], dtype=torch.float64).view(-1, 1, 1)
            cache.layer(layer).store(kv, kv.clone(), slots)
    seq.num_computed_tokens = n
    cache.commit(seq)


def visible(cache: WindowedPagedCache, layer: int, seq: Sequence) -> range:
    """Positions the next query of ``seq`` may read in ``layer``."""
    window = cache.spec.layer_windows[layer]
    n = seq.num_computed_tokens
    return range(0 if window is None else max(0, n - window + 1), n)


def read(cache: WindowedPagedCache, layer: int, seq: Sequence, positions: range) -> list[float]:
    group = next(g for g, layers in enumerate(cache.layer_groups) if layer in layers)
    table, bs = cache.group_block_table(seq, group), cache.layout.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.long)
    k, v = cache.layer(layer).gather(slots)
    assert torch.equal(k, v)
    return k.flatten().tolist()


class WindowedMachine(RuleBasedStateMachine):
    @initialize(layout=st.sampled_from(sorted(LAYOUTS)), block_size=st.sampled_from([1, 2, 4]),
                blocks=st.sampled_from([12, 24, 48]), prefix_caching=st.booleans())
    def start(self, layout, block_size, blocks, prefix_caching):
        self.cache = make_cache(LAYOUTS[layout], block_size, blocks, prefix_caching)
        self.bs = block_size
        self.live: dict[int, Sequence] = {}
        self.tabled: set[int] = set()

    def _pick(self, data, ids) -> Sequence:
        return self.live[data.draw(st.sampled_from(sorted(ids)))]

    def _compute(self, seq: Sequence, n: int, lookahead: int = 0) -> None:
        released = self.cache.released_blocks
        compute(self.cache, seq, n, lookahead)
        self.tabled.add(seq.seq_id)
        if self.cache.released_blocks > released:
            event("released")

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(base=st.integers(0, len(BASES) - 1), length=st.integers(1, 40),
          tail=st.lists(st.sampled_from(VOCAB), max_size=2), prefill=st.sampled_from([None, None, 0, 5]))
    def add(self, base, length, tail, prefill):
        seq = Sequence("r", BASES[base][:length] + tail, SamplingParams(max_tokens=8))
        hit = self.cache.match_prefix(seq)
        assert hit % self.bs == 0 and 0 <= hit < seq.num_tokens
        if hit:
            event("prefix hit")
        seq.num_computed_tokens = hit
        self.live[seq.seq_id] = seq
        if self.cache.options.prefix_caching:
            self.tabled.add(seq.seq_id)
        n = seq.num_tokens if prefill is None else min(hit + prefill, seq.num_tokens)
        if n > hit and self.cache.can_reserve(seq, n):
            self._compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 24), lookahead=st.integers(0, 3), sampled=st.sampled_from(VOCAB))
    def step(self, data, k, lookahead, sampled):
        self._advance(self._pick(data, self.live), k, lookahead, sampled)

    def _advance(self, seq: Sequence, k: int, lookahead: int, sampled: int) -> None:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(sampled)
        n = min(seq.num_computed_tokens + k, seq.num_tokens)
        if self.cache.can_reserve(seq, n + lookahead):
            self._compute(seq, n, lookahead)
        else:
            event("reserve refused")
            refs = list(self.cache.arena.ref_counts)
            with pytest.raises(RuntimeError):
                self.cache.reserve(seq, n + lookahead)
            assert self.cache.arena.ref_counts == refs  # a refused reserve changes nothing

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=3))
    def append(self, data, tokens):
        self._pick(data, self.live).token_ids.extend(tokens)

    @precondition(lambda self: self.tabled and len(self.live) < MAX_LIVE)
    @rule(data=st.data(), samples=st.lists(st.sampled_from(VOCAB), min_size=2, max_size=2))
    def fork(self, data, samples):
        parent = self._pick(data, self.tabled)
        child = parent.fork(1)
        self.cache.fork(parent, child)
        self.live[child.seq_id] = child
        self.tabled.add(child.seq_id)
        parent.token_ids.append(samples[0])
        child.token_ids.append(samples[1])

    @precondition(lambda self: self.tabled)
    @rule(data=st.data(), drop=st.booleans(), redo=st.lists(st.sampled_from(VOCAB), max_size=8))
    def roll_back(self, data, drop, redo):
        """Roll back to m computed tokens, no further than the window allows (rejected
        drafts); a rollback past it is refused, naming the window."""
        seq = self._pick(data, self.tabled)
        lowest = self.cache.num_released(seq) * self.bs + self.cache.window - 1
        if lowest > seq.num_computed_tokens:
            if self.cache.num_released(seq):
                with pytest.raises(ValueError, match="window"):
                    self.cache.truncate(seq, 0)
            return
        m = data.draw(st.integers(lowest if self.cache.num_released(seq) else 0, seq.num_computed_tokens))
        seq.num_computed_tokens = m
        self.cache.truncate(seq, m)
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
        assert all(pool.num_cached == 0 for pool in self.cache.arena.pools.values())

    # ------------------------------------------------------------------ invariants

    @invariant()
    def every_layer_reads_what_its_queries_see(self):
        for seq in self.live.values():
            if not seq.num_computed_tokens:
                continue
            for layer in range(self.cache.spec.num_layers):
                positions = visible(self.cache, layer, seq)
                want = [value(layer, seq.token_ids[p], p) for p in positions]
                assert read(self.cache, layer, seq, positions) == want, (layer, seq)

    @invariant()
    def released_entries_are_the_passed_ones(self):
        """The window table lets go of exactly the blocks before the earliest visible one."""
        bs, window = self.bs, self.cache.window
        for i in self.tabled:
            seq = self.live[i]
            table = self.cache.group_block_table(seq, len(self.cache.layer_groups) - 1)
            released = self.cache.num_released(seq)
            assert all(part == self.cache.arena.null for part in table[:released])
            assert self.cache.arena.null not in table[released:]
            assert released <= max(0, (seq.num_computed_tokens - window + 1) // bs)

    @invariant()
    def ref_counts_count_tables(self):
        arena, held = self.cache.arena, [0] * self.cache.arena.num_units
        for i in self.tabled:
            for group in range(len(self.cache.layer_groups)):
                for part in self.cache.group_block_table(self.live[i], group):
                    if part != arena.null:
                        held[part] += 1
        assert arena.ref_counts == held
        in_use = sum(arena.sizes[arena.owner[run // arena.width]] for run in range(arena.num_units)
                     if arena.ref_counts[run])
        assert arena.units_in_use == in_use

    @invariant()
    def runs_partition_the_arena(self):
        """Each superblock is whole (no owner) or one kind's, its runs free, cached or in use
        exactly once; superblock 0 (the null run) is nobody's."""
        arena = self.cache.arena
        assert arena.owner[0] is None and 0 not in arena.whole
        for s in range(1, arena.num_superblocks):
            kind = arena.owner[s]
            assert (kind is None) == (s in arena.whole), s
            if kind is None:
                assert all(arena.ref_counts[u] == 0 for u in range(s * arena.width, (s + 1) * arena.width))
                continue
            pool = arena.pools[kind]
            states = [(run in pool._free) + (run in pool._evictable) + (arena.ref_counts[run] > 0)
                      for run in arena.runs(s, kind)]
            assert states == [1] * len(states), (s, states)
            assert arena.in_use[s] == sum(arena.ref_counts[run] > 0 for run in arena.runs(s, kind))

    def teardown(self):
        for seq in list(self.live.values()):
            self.cache.free(seq)
        self.cache.reset_prefix_cache()
        arena = self.cache.arena
        assert len(arena.whole) == arena.num_superblocks - 1, "a superblock was left split after everything ended"
        assert not any(arena.ref_counts)


TestWindowedMachine = WindowedMachine.TestCase
TestWindowedMachine.settings = settings(max_examples=300, stateful_step_count=40)


# ---------------------------------------------------------------------- unit tests


def test_sliding_runs_released_become_full_runs():
    """Gemma 3's proportion (1 full unit, 5 sliding a block here): sequences let go of their
    sliding runs as they grow, and those come back as full runs, so more long sequences run
    at once than in the same memory without release (every block holding both kinds)."""

    def concurrent(cache) -> int:
        """Sequences of 20 tokens held at once, each grown two tokens a step."""
        count = 0
        while True:
            seq = Sequence("r", [1, 2] * 10, SamplingParams(max_tokens=8))
            for n in range(2, 21, 2):
                if not cache.can_reserve(seq, n):
                    return count
                compute(cache, seq, n)
            count += 1

    windowed = make_cache(LAYOUTS["five-to-one"], block_size=2, num_blocks=60, prefix_caching=False)
    plain = PagedCache(PagedOptions(block_size=2, num_blocks=60, prefix_caching=False, free_out_of_window=False),
                       windowed.spec, windowed.layout)
    assert concurrent(plain) == 6  # 60 blocks of 2 tokens: 10 blocks a sequence
    # 360 units: 72 superblocks of 5; a sequence holds 10 full runs (2 superblocks) and the 3
    # sliding runs its window of 6 still sees (3 superblocks)
    assert concurrent(windowed) == 14
    assert windowed.released_blocks > 0
    assert sum(owner == FULL for owner in windowed.arena.owner) > 0


def test_short_sequences_lose_nothing():
    """Sequences shorter than the window release nothing, and as many fit as in a cache that
    never releases (the two kinds draw on one arena)."""
    windowed = make_cache(LAYOUTS["alternating"], block_size=4, num_blocks=16, prefix_caching=False)
    plain = PagedCache(PagedOptions(block_size=4, num_blocks=16, prefix_caching=False, free_out_of_window=False),
                       windowed.spec, windowed.layout)
    assert type(plain) is PagedCache

    def fits(cache) -> int:
        count = 0
        while True:
            seq = Sequence("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=8))
            if not cache.can_reserve(seq, 5):
                return count
            cache.reserve(seq, 5)
            count += 1

    assert fits(windowed) == fits(plain) == 8
    assert windowed.released_blocks == 0


def test_prefix_hit_needs_the_last_window_of_sliding_runs():
    cache = make_cache(LAYOUTS["alternating"], block_size=2, num_blocks=40)
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 3]
    a = Sequence("r", tokens, SamplingParams(max_tokens=8))
    compute(cache, a, len(tokens))
    assert cache.num_released(a) == (len(tokens) - 6 + 1) // 2  # window 6
    b = Sequence("r", tokens, SamplingParams(max_tokens=8))
    hit = cache.match_prefix(b)
    assert hit == 12  # every full block; a's sliding runs are still held for the last window
    b.num_computed_tokens = hit
    assert cache.num_released(b) == (12 - 6 + 1) // 2
    compute(cache, b, len(tokens))
    for layer in range(4):
        positions = visible(cache, layer, b)
        assert read(cache, layer, b, positions) == [value(layer, tokens[p], p) for p in positions]


@pytest.mark.parametrize("layout", ["five-to-one", "all-sliding"])
def test_one_sequence_outgrows_the_cache_without_release(layout):
    """With steps bounded (the scheduler's budget), the cache admits a sequence longer than
    its memory holds with every block's runs of both kinds, and that sequence runs to its end
    alone, a step at a time, reading back what its windows see."""
    cache = make_cache(LAYOUTS[layout], block_size=2, num_blocks=20, prefix_caching=False)
    bound = cache.max_seq_tokens
    assert bound == 40
    cache.limit_step_tokens(4)
    assert cache.max_seq_tokens > 2 * bound
    length = min(cache.max_seq_tokens, 300)
    seq = Sequence("r", [(i % 3) + 1 for i in range(length)], SamplingParams(max_tokens=8))
    for n in range(4, length + 1, 4):
        assert cache.can_reserve(seq, n), f"refused at {n} of {length} admitted tokens"
        compute(cache, seq, n)
    for layer in range(cache.spec.num_layers):
        positions = visible(cache, layer, seq)
        assert read(cache, layer, seq, positions) == [value(layer, seq.token_ids[p], p) for p in positions]
    cache.free(seq)
    assert len(cache.arena.whole) == cache.arena.num_superblocks - 1
