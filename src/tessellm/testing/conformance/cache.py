"""The KV-cache contract as properties: a hypothesis state machine drives sequences through
reserve, commit, fork, truncate, match_prefix and free (abort) in any order, with K/V written
through the layer storage and read back after every step; focused properties check each
operation alone."""

from __future__ import annotations

import zlib
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tessellm.core.interfaces.cache import CacheManager, CacheSpec
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.plugin import SelectionContext
from tessellm.testing.conformance.attention import model_spec
from tessellm.testing.conformance.base import ConformanceSuite, property_settings

HEADS, HEAD_DIM = 2, 8


def slots(cache: CacheManager, seq: Sequence, start: int, end: int) -> torch.Tensor:
    """The cache slots of ``seq``'s tokens [start, end), from its block table."""
    table, bs = cache.block_table(seq), cache.layout.block_size
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.long)


def write(cache: CacheManager, seq: Sequence, start: int, end: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Store random K/V for tokens [start, end) of ``seq`` in layer 0; return what was stored."""
    g = torch.Generator().manual_seed(seed)
    storage = cache.layer(0)
    k = torch.randn(end - start, HEADS, HEAD_DIM, generator=g)
    v = torch.randn(end - start, HEADS, HEAD_DIM, generator=g)
    storage.store(k, v, slots(cache, seq, start, end))
    return storage.stored_value(k), storage.stored_value(v)


def read(cache: CacheManager, seq: Sequence, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.layer(0).gather(slots(cache, seq, 0, end))


def computed(cache: CacheManager, seq: Sequence, n: int) -> None:
    """Reserve and mark ``seq``'s first ``n`` tokens as holding valid KV, as a step would."""
    cache.reserve(seq, n)
    seq.num_computed_tokens = n
    cache.commit(seq)


def token_kv(salt: str | None, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V a model would compute for the last token of ``prefix`` under ``salt``: a
    function of the salt and the whole prefix, as real K/V are of the tokens before them (the
    salt stands for what a tenant's cache must not share). A cache that hands a sequence
    another prefix's blocks, or another salt's, makes it read K/V that differ from these."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((salt, prefix)).encode()))
    return torch.randn(HEADS, HEAD_DIM, generator=g), torch.randn(HEADS, HEAD_DIM, generator=g)


class CacheMachine(RuleBasedStateMachine):
    """Sequences through every cache operation in any order; ``suite`` supplies the cache.

    The model of the cache is each live sequence's tokens: after every rule, each one's
    computed tokens read back exactly ``token_kv`` of their prefixes (so no write ever
    reaches another sequence's tokens, a fork's child starts as its parent, truncate rolls
    back exactly and a matched prefix holds that prefix's K/V under the same salt); at the
    end, freeing every sequence gives back every block."""

    suite: ClassVar["CacheConformance"]
    VOCAB = (3, 4, 5)  # few token ids: prompts repeat one another's prefixes often

    def __init__(self) -> None:
        super().__init__()
        self.cache = self.suite.build()
        self.start_free = self.cache.num_free_blocks
        self.live: list[Sequence] = []
        self.limit = self.suite.capacity() - 1

    def _store(self, seq: Sequence, start: int, end: int) -> None:
        """Reserve, write tokens [start, end) of ``seq`` and commit them, as a step would."""
        self.cache.reserve(seq, end)
        if end > start:
            kv = [token_kv(seq.cache_salt, tuple(seq.token_ids[:p + 1])) for p in range(start, end)]
            k = torch.stack([a for a, _ in kv])
            v = torch.stack([b for _, b in kv])
            self.cache.layer(0).store(k, v, slots(self.cache, seq, start, end))
        seq.num_computed_tokens = end
        self.cache.commit(seq)

    @rule(data=st.data(), salt=st.sampled_from([None, "tenant-a", "tenant-b"]))
    def admit(self, data: Any, salt: str | None) -> None:
        """A new request, its prompt often repeating a live sequence's prefix: match_prefix,
        then reserve and prefill the rest, or give the matched blocks back if it cannot start."""
        prompt: list[int] = []
        if self.live and data.draw(st.booleans(), label="shares a prefix"):
            source = data.draw(st.sampled_from(self.live), label="prefix of")
            prompt = source.token_ids[:data.draw(st.integers(1, len(source.token_ids)), label="shared tokens")]
        prompt += data.draw(st.lists(st.sampled_from(self.VOCAB), min_size=1, max_size=20), label="new tokens")
        prompt = prompt[:self.limit]
        seq = Sequence("r", prompt, SamplingParams(), cache_salt=salt)
        hit = self.cache.match_prefix(seq)
        assert 0 <= hit <= len(prompt) - 1, \
            f"{self.suite.label()}: match_prefix covered {hit} of a {len(prompt)}-token prompt; at most all but one"
        seq.num_computed_tokens = hit
        if not self.cache.can_reserve(seq, len(prompt)):
            self.cache.free(seq)  # a sequence that cannot start keeps no blocks
            return
        self._store(seq, hit, len(prompt))
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data: Any) -> None:
        """A step: some new tokens (a decode, or drafts) written after the computed ones."""
        seq = data.draw(st.sampled_from(self.live), label="sequence")
        room = self.limit - len(seq.token_ids)
        if room <= 0 or not self.cache.can_reserve(seq, len(seq.token_ids) + 1):
            return
        new = data.draw(st.lists(st.sampled_from(self.VOCAB), min_size=1, max_size=min(room, 6)), label="tokens")
        if not self.cache.can_reserve(seq, len(seq.token_ids) + len(new)):
            new = new[:1]
        start = len(seq.token_ids)
        seq.token_ids += new
        self._store(seq, start, len(seq.token_ids))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: Any) -> None:
        """Parallel sampling: a child sharing the parent's tokens so far."""
        parent = data.draw(st.sampled_from(self.live), label="parent")
        if not self.cache.can_fork(parent):
            return
        child = parent.fork(1)
        self.cache.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def truncate(self, data: Any) -> None:
        """A speculative rollback: the last tokens are rejected and forgotten."""
        seq = data.draw(st.sampled_from(self.live), label="sequence")
        cut = data.draw(st.integers(1, len(seq.token_ids)), label="keep")
        self.cache.truncate(seq, cut)
        del seq.token_ids[cut:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, cut)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: Any) -> None:
        """A sequence finishes or is aborted."""
        seq = data.draw(st.sampled_from(self.live), label="sequence")
        self.cache.free(seq)
        self.live.remove(seq)

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        for seq in self.live:
            n = seq.num_computed_tokens
            k, v = read(self.cache, seq, n)
            kv = [token_kv(seq.cache_salt, tuple(seq.token_ids[:p + 1])) for p in range(n)]
            storage = self.cache.layer(0)
            expected_k = storage.stored_value(torch.stack([a for a, _ in kv])) if kv else k
            expected_v = storage.stored_value(torch.stack([b for _, b in kv])) if kv else v
            bad = [p for p in range(n) if not (torch.equal(k[p], expected_k[p]) and torch.equal(v[p], expected_v[p]))]
            assert not bad, (f"{self.suite.label()}: sequence {seq.seq_id} (salt {seq.cache_salt!r}, {n} computed "
                             f"tokens) reads other K/V than it wrote at positions {bad[:8]}: a write reached it "
                             f"through a shared block, a rollback was not exact, or a prefix matched wrongly")
        assert self.cache.num_free_blocks >= 0

    def teardown(self) -> None:
        for seq in self.live:
            self.cache.free(seq)
        assert self.cache.num_free_blocks == self.start_free, \
            f"{self.suite.label()}: {self.start_free - self.cache.num_free_blocks} blocks leaked once every sequence was freed"


class CacheConformance(ConformanceSuite):
    """The contract every KV-cache manager honours (core/interfaces/cache.py), checked on the
    plugin named by ``plugin`` (or ``plugin_class``) with ``options``, a float32 CPU cache of
    one layer:

    - K/V stored through a layer's storage read back bit-exact through ``gather`` (as
      ``KVStorage.stored_value`` says: the storage dtype, or the quantize-dequantize round
      trip of quantized storage);
    - free gives everything back: after any mix of reserves, commits, forks, truncates and
      frees (aborts), the free blocks return to their number at the start, and while
      sequences live their block tables share no block unless a fork or a prefix match made
      them share it;
    - a fork's child reads its parent's tokens, and its own writes never change what the
      parent reads (copy-on-write);
    - truncate rolls back exactly: tokens before the cut read back unchanged, and tokens
      written after it replace the old ones;
    - a prefix matches only under the same ``cache_salt`` (skipped, saying so, for a cache
      that never matches a prefix);
    - all of these at once, in a hypothesis state machine (``CacheMachine``) over admit with
      match_prefix, grow, fork, truncate and free in any order: every live sequence reads
      back exactly its own K/V after each operation, and freeing all gives back every block.

    ``max_model_len`` is the pipeline's context length the cache is built for. No property
    asks one sequence for more tokens than the cache declares it holds (``capacity``: the
    smaller of ``max_model_len`` and ``max_seq_tokens``).
    """

    kind = "cache"
    max_model_len: ClassVar[int] = 64
    max_examples: ClassVar[int] = 20

    def build(self) -> CacheManager:
        """A fresh cache of the plugin under test."""
        plugin, options = self.under_test(), self.plugin_options()
        spec = model_spec(HEADS, HEADS, HEAD_DIM)
        device = torch.device("cpu")
        ctx = SelectionContext(device=device, dtype=torch.float32, model=spec, options=options,
                               max_model_len=self.max_model_len)
        self.require(ctx, "a float32 CPU cache")
        layout = plugin.kv_layout(options, ctx)
        return plugin(options, CacheSpec(1, HEADS, HEAD_DIM, torch.float32, device, self.max_model_len), layout)

    def capacity(self) -> int:
        """The most tokens one sequence may hold here: ``max_model_len``, or less where the
        cache declares less (``CacheManager.max_seq_tokens``)."""
        if not hasattr(self, "_capacity"):
            self._capacity = min(self.max_model_len, self.build().max_seq_tokens)
        return self._capacity

    def need(self, tokens: int, what: str) -> int:
        """``capacity()``, after skipping the running property (saying why) when a sequence of
        ``tokens`` tokens does not fit."""
        capacity = self.capacity()
        if capacity < tokens:
            pytest.skip(f"{self.label()} holds {capacity} tokens per sequence; {what} needs {tokens}")
        return capacity

    def test_any_sequence_of_operations_keeps_every_sequence_intact(self) -> None:
        """The state machine (``CacheMachine``): admit with match_prefix, grow, fork,
        truncate and free in any order; every live sequence reads back its own K/V after
        each, and nothing leaks."""
        from hypothesis import settings as hypothesis_settings

        suite = self

        class Machine(CacheMachine):
            def __init__(self) -> None:
                suite.case()
                super().__init__()

        Machine.suite = suite
        settings = property_settings(max_examples=self.max_examples)
        run_state_machine_as_test(Machine, settings=hypothesis_settings(settings, stateful_step_count=25))

    def test_stored_kv_reads_back_and_free_returns_every_block(self) -> None:
        capacity = self.need(2, "this property")

        @given(st.lists(st.integers(1, capacity - 1), min_size=1, max_size=4), st.data())
        @property_settings(max_examples=self.max_examples)
        def run(lengths: list[int], data: Any) -> None:
            self.case()
            cache = self.build()
            free = cache.num_free_blocks
            seqs = [Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams()) for i, n in enumerate(lengths)]
            live, stored = [], {}
            for i, seq in enumerate(seqs):
                if not cache.can_reserve(seq, len(seq.token_ids)):
                    continue
                computed(cache, seq, len(seq.token_ids))
                stored[seq.seq_id] = write(cache, seq, 0, len(seq.token_ids), seed=i)
                live.append(seq)
            owned = [b for seq in live for b in set(cache.block_table(seq))]
            assert len(owned) == len(set(owned)), \
                f"{self.label()}: sequences {lengths} without forks share blocks: {[cache.block_table(s) for s in live]}"
            for seq in live:
                k, v = read(cache, seq, len(seq.token_ids))
                assert torch.equal(k, stored[seq.seq_id][0]) and torch.equal(v, stored[seq.seq_id][1]), \
                    f"{self.label()}: K/V of {seq.seq_id} (of lengths {lengths}) did not read back bit-exact"
            for seq in data.draw(st.permutations(live)):
                cache.free(seq)
            assert cache.num_free_blocks == free, \
                f"{self.label()}: {free - cache.num_free_blocks} blocks leaked after freeing sequences of {lengths}"

        run()

    def test_a_fork_child_never_writes_into_its_parent(self) -> None:
        capacity = self.need(5, "a fork that grows by 4 tokens")

        @given(st.integers(1, min(capacity // 2, capacity - 4)), st.integers(0, 8), st.integers(0, 2**16))
        @property_settings(max_examples=self.max_examples)
        def run(n: int, rewrite: int, seed: int) -> None:
            self.case()
            cache = self.build()
            free = cache.num_free_blocks
            parent = Sequence("p", list(range(3, 3 + n)), SamplingParams())
            computed(cache, parent, n)
            pk, pv = write(cache, parent, 0, n, seed)
            if not cache.can_fork(parent):
                pytest.skip(f"{self.label()}: cannot fork with {cache.num_free_blocks} free blocks")
            child = parent.fork(1)
            cache.fork(parent, child)
            child.num_computed_tokens = n
            k, v = read(cache, child, n)
            assert torch.equal(k, pk) and torch.equal(v, pv), f"{self.label()}: a fork's child does not read its parent's {n} tokens"
            start = max(0, n - rewrite)  # the child rolls back its last tokens (a rejected draft), then grows
            cache.truncate(child, start)
            child.num_computed_tokens = start
            cache.reserve(child, n + 4)
            write(cache, child, start, n + 4, seed + 1)
            k, v = read(cache, parent, n)
            assert torch.equal(k, pk) and torch.equal(v, pv), \
                f"{self.label()}: writing tokens [{start}, {n + 4}) of a fork's child changed its parent's K/V " \
                f"({n} tokens): forks must copy on write"
            cache.free(child)
            cache.free(parent)
            assert cache.num_free_blocks == free, f"{self.label()}: blocks leaked after a fork of {n} tokens"

        run()

    def test_truncate_rolls_back_exactly(self) -> None:
        capacity = self.need(6, "a truncated sequence that grows by 4 tokens")

        @given(st.integers(2, capacity - 4), st.data())
        @property_settings(max_examples=self.max_examples)
        def run(n: int, data: Any) -> None:
            self.case()
            cache = self.build()
            cut = data.draw(st.integers(1, n - 1))
            seq = Sequence("t", list(range(3, 3 + n)), SamplingParams())
            computed(cache, seq, n)
            k0, v0 = write(cache, seq, 0, n, seed=n)
            cache.truncate(seq, cut)
            seq.num_computed_tokens = cut
            cache.reserve(seq, n + 4)
            k1, v1 = write(cache, seq, cut, n + 4, seed=n + 1)
            k, v = read(cache, seq, n + 4)
            assert torch.equal(k[:cut], k0[:cut]) and torch.equal(v[:cut], v0[:cut]), \
                f"{self.label()}: truncating {n} tokens to {cut} changed the tokens before the cut"
            assert torch.equal(k[cut:], k1) and torch.equal(v[cut:], v1), \
                f"{self.label()}: tokens rewritten after truncating {n} to {cut} did not read back"
            cache.free(seq)

        run()

    def test_prefixes_match_only_under_the_same_salt(self) -> None:
        @given(st.integers(1, 3), st.sampled_from([None, "tenant-a"]), st.sampled_from([None, "tenant-a", "tenant-b"]))
        @property_settings(max_examples=self.max_examples)
        def run(blocks: int, salt: Any, other_salt: Any) -> None:
            self.case()
            cache = self.build()
            bs = cache.layout.block_size
            if bs * blocks + 1 >= self.capacity():
                pytest.skip(f"{self.label()}: blocks of {bs} tokens leave no room for a shared prefix")
            tokens = list(range(3, 3 + bs * blocks + 1))
            first = Sequence("a", list(tokens), SamplingParams(), cache_salt=salt)
            first.num_computed_tokens = cache.match_prefix(first)
            computed(cache, first, len(tokens))
            again = Sequence("b", list(tokens), SamplingParams(), cache_salt=salt)
            hit = cache.match_prefix(again)
            cache.free(again)
            if hit == 0:
                pytest.skip(f"{self.label()}: no prefix matched for a repeated prompt of {len(tokens)} tokens "
                            f"(a cache without prefix caching): the salt property does not apply")
            other = Sequence("c", list(tokens), SamplingParams(), cache_salt=other_salt)
            matched = cache.match_prefix(other)
            cache.free(other)
            if other_salt != salt:
                assert matched == 0, f"{self.label()}: a prompt under salt {other_salt!r} matched {matched} " \
                                     f"tokens cached under salt {salt!r}"
            cache.free(first)

        run()
