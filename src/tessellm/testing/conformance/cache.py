"""The KV-cache contract as properties, on sequences driven through reserve, commit, fork,
truncate, match_prefix and free in random orders, with K/V written through the layer storage
and read back."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st

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
    dtype = cache.layer(0).layout.dtype
    k = torch.randn(end - start, HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(end - start, HEADS, HEAD_DIM, generator=g).to(dtype)
    cache.layer(0).store(k, v, slots(cache, seq, start, end))
    return k, v


def read(cache: CacheManager, seq: Sequence, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.layer(0).gather(slots(cache, seq, 0, end))


def computed(cache: CacheManager, seq: Sequence, n: int) -> None:
    """Reserve and mark ``seq``'s first ``n`` tokens as holding valid KV, as a step would."""
    cache.reserve(seq, n)
    seq.num_computed_tokens = n
    cache.commit(seq)


class CacheConformance(ConformanceSuite):
    """The contract every KV-cache manager honours (core/interfaces/cache.py), checked on the
    plugin named by ``plugin`` (or ``plugin_class``) with ``options``, a float32 CPU cache of
    one layer:

    - K/V stored through a layer's storage read back bit-exact through ``gather``;
    - free gives everything back: after any mix of reserves, commits, forks, truncates and
      frees (aborts), the free blocks return to their number at the start, and while
      sequences live their block tables share no block unless a fork or a prefix match made
      them share it;
    - a fork's child reads its parent's tokens, and its own writes never change what the
      parent reads (copy-on-write);
    - truncate rolls back exactly: tokens before the cut read back unchanged, and tokens
      written after it replace the old ones;
    - a prefix matches only under the same ``cache_salt`` (skipped, saying so, for a cache
      that never matches a prefix).

    ``max_model_len`` is the pipeline's context length the cache is built for.
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

    def test_stored_kv_reads_back_and_free_returns_every_block(self) -> None:
        @given(st.lists(st.integers(1, self.max_model_len - 1), min_size=1, max_size=4), st.data())
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
        @given(st.integers(1, self.max_model_len // 2), st.integers(0, 8), st.integers(0, 2**16))
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
        @given(st.integers(2, self.max_model_len - 8), st.data())
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
            if bs * blocks + 1 >= self.max_model_len:
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
