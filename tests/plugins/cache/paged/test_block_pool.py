"""`BlockPool`: a hypothesis state machine drives allocate / incref / decref / register /
lookup / reset against a plain model of reference counts, content keys and release order,
and checks after every step that free, in-use and cached blocks partition the pool and that
eviction takes the least recently released cached block."""

from __future__ import annotations

import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tessellm.plugins.cache.paged.block_pool import BlockPool

KEYS = [b"k0", b"k1", b"k2"]  # few keys: collisions and re-registration happen often


class BlockPoolMachine(RuleBasedStateMachine):
    """The model: ``refs[b]`` table references of block b; ``key_of`` / ``block_of`` the content
    index; ``released`` the cached blocks (count 0, keyed), oldest release first."""

    @initialize(num_blocks=st.integers(1, 4))
    def start(self, num_blocks):
        self.n = num_blocks
        self.pool = BlockPool(num_blocks)
        self.refs = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.released: list[int] = []

    # ------------------------------------------------------------------ model views

    def _in_use(self) -> list[int]:
        return [b for b in range(self.n) if self.refs[b] > 0]

    def _free(self) -> set[int]:
        return {b for b in range(self.n) if self.refs[b] == 0 and b not in self.key_of}

    # ------------------------------------------------------------------ steps

    def _allocate(self) -> int:
        free = self._free()
        block = self.pool.allocate()
        if free:
            assert block in free, "a free block must be handed out before any cached one is evicted"
        else:  # LRU: the cached block released longest ago is evicted
            event("allocate evicts a cached block")
            assert block == self.released[0], (block, self.released)
            self.released.pop(0)
            key = self.key_of.pop(block)
            del self.block_of[key]
            assert self.pool.lookup(key) is None and not self.pool.is_cached(block)  # forgotten
        assert self.pool.ref_counts[block] == 1
        self.refs[block] = 1
        return block

    def _register(self, block: int, key: bytes) -> None:
        self.pool.register(block, key)
        if key not in self.block_of and block not in self.key_of:  # the first registration wins
            self.block_of[key] = block
            self.key_of[block] = key

    def _decref(self, block: int) -> None:
        self.pool.decref(block)
        self.refs[block] -= 1
        if self.refs[block] == 0 and block in self.key_of:
            self.released.append(block)  # newest release: evicted last

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: self.pool.num_free > 0)
    @rule()
    def allocate(self):
        self._allocate()

    @precondition(lambda self: self.pool.num_free > 0)
    @rule(key=st.sampled_from(KEYS))
    def write_and_release(self, key):
        """What a finished sequence does with a full block: allocate, index, release."""
        block = self._allocate()
        self._register(block, key)
        self._decref(block)

    @precondition(lambda self: self.pool.num_free == 0)
    @rule()
    def allocate_when_full(self):
        with pytest.raises(RuntimeError, match="no free KV block"):
            self.pool.allocate()

    @precondition(lambda self: any(r > 0 for r in self.refs) or self.released)
    @rule(data=st.data())
    def incref(self, data):
        block = data.draw(st.sampled_from(sorted(self._in_use() + self.released)))
        self.pool.incref(block)
        if self.refs[block] == 0:
            self.released.remove(block)  # revived: leaves the eviction queue
        self.refs[block] += 1

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data())
    def decref(self, data):
        self._decref(data.draw(st.sampled_from(self._in_use())))

    @precondition(lambda self: any(r == 0 for r in self.refs))
    @rule(data=st.data())
    def decref_unreferenced_raises(self, data):
        block = data.draw(st.sampled_from([b for b in range(self.n) if self.refs[b] == 0]))
        with pytest.raises(RuntimeError, match="released more often than it was referenced"):
            self.pool.decref(block)

    @precondition(lambda self: self._free())
    @rule(data=st.data())
    def incref_free_raises(self, data):
        block = data.draw(st.sampled_from(sorted(self._free())))
        with pytest.raises(RuntimeError, match="is free"):
            self.pool.incref(block)

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def register(self, data, key):
        self._register(data.draw(st.sampled_from(self._in_use())), key)

    @precondition(lambda self: any(r == 0 for r in self.refs))
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def register_unreferenced_raises(self, data, key):
        block = data.draw(st.sampled_from([b for b in range(self.n) if self.refs[b] == 0]))
        with pytest.raises(RuntimeError, match="not in use"):
            self.pool.register(block, key)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key):
        block = self.pool.lookup(key)
        assert block == self.block_of.get(key)
        if block is not None:
            assert self.pool.is_cached(block) and self.key_of[block] == key

    @rule()
    def reset_prefix_cache(self):
        assert self.pool.reset_prefix_cache() == len(self.key_of)
        self.key_of.clear()
        self.block_of.clear()
        self.released.clear()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def states_partition_the_pool(self):
        free, cached = self.pool.free_blocks(), self.pool.cached_blocks()
        in_use = {b for b in range(self.n) if self.pool.ref_counts[b] > 0}
        assert not (free & cached) and not (free & in_use) and not (cached & in_use)
        assert free | cached | in_use == set(range(self.n))
        assert free == self._free() and cached == set(self.released)
        assert all(b in self.key_of for b in cached)

    @invariant()
    def counts_match_the_model(self):
        assert self.pool.ref_counts == self.refs
        assert min(self.pool.ref_counts) >= 0
        assert self.pool.num_free == len(self.pool.free_blocks()) + len(self.pool.cached_blocks())
        assert self.pool.num_cached == len(self.released)
        assert self.pool.num_used == sum(r > 0 for r in self.refs)

    @invariant()
    def index_matches_the_model(self):
        for key in KEYS:
            block = self.pool.lookup(key)
            assert block == self.block_of.get(key)
        for block in range(self.n):
            assert self.pool.is_cached(block) == (block in self.key_of)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=200)  # about 2 s


# ---------------------------------------------------------------------- unit tests


def test_needs_a_block():
    with pytest.raises(ValueError, match="at least one block, not 0"):
        BlockPool(0)


def test_allocate_when_everything_is_in_use():
    pool = BlockPool(2)
    pool.allocate(), pool.allocate()
    with pytest.raises(RuntimeError, match=r"no free KV block: all 2 are in use"):
        pool.allocate()


def test_incref_of_a_free_block():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match=r"block 1 is free; only in-use or cached blocks can be shared"):
        pool.incref(1)


def test_decref_below_zero():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.decref(block)
    with pytest.raises(RuntimeError, match=rf"block {block} released more often than it was referenced"):
        pool.decref(block)
    assert pool.ref_counts[block] == 0


def test_register_of_an_unused_block():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match=r"block 0 is not in use; only written blocks can be indexed"):
        pool.register(0, b"k")


def test_evicts_least_recently_released_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(block, key)
    pool.decref(b), pool.decref(a), pool.decref(c)  # release order: b, a, c
    pool.incref(a)  # revived: no longer evictable
    assert pool.num_cached == 2 and pool.num_free == 2
    assert pool.allocate() == b and pool.lookup(b"b") is None
    assert pool.allocate() == c and pool.lookup(b"c") is None
    assert pool.lookup(b"a") == a and pool.evictions == 2
