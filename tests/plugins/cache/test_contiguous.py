"""`contiguous`: a region per sequence, never shared; a hypothesis state machine checks that
no region is both free and held, and that forks copy exactly the parent's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.model.spec import KVShape
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.plugins.cache.contiguous import ContiguousCache, ContiguousOptions

MAX_LEN = 12


def make_cache(max_seqs: int) -> ContiguousCache:
    spec = CacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float64, device=torch.device("cpu"),
                     max_model_len=MAX_LEN)
    return ContiguousCache(ContiguousOptions(max_seqs=max_seqs), spec, KVLayout("kv", MAX_LEN, torch.float64))


class ContiguousMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = make_cache(3)
        self.live: dict[int, Sequence] = {}

    def _seq(self) -> Sequence:
        return Sequence("r", [1, 2, 3], SamplingParams(max_tokens=4))

    @rule(n=st.integers(1, MAX_LEN))
    def reserve_new(self, n):
        seq = self._seq()
        if self.cache.can_reserve(seq, n):
            self.cache.reserve(seq, n)
            seq.num_computed_tokens = n
            self._write(seq)
            self.live[seq.seq_id] = seq
        else:
            assert self.cache.num_free_blocks == 0

    def _write(self, seq):
        """Write a recognizable value (the seq id) into every token's K of every layer."""
        region = self.cache.block_table(seq)[0]
        for layer in range(2):
            self.cache.layer(layer).k[region * MAX_LEN: region * MAX_LEN + seq.num_computed_tokens] = seq.seq_id

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self.cache.free(self.live.pop(seq_id))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = self._seq()
        if not self.cache.can_fork(parent):
            assert self.cache.num_free_blocks == 0
            return
        self.cache.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        src, dst = self.cache.block_table(parent)[0], self.cache.block_table(child)[0]
        assert src != dst
        n = parent.num_computed_tokens
        for layer in range(2):
            k = self.cache.layer(layer).k
            assert torch.equal(k[dst * MAX_LEN: dst * MAX_LEN + n], k[src * MAX_LEN: src * MAX_LEN + n])
        self.live[child.seq_id] = child

    @invariant()
    def accounting(self):
        held = [self.cache.block_table(s)[0] for s in self.live.values()]
        assert len(set(held)) == len(held)  # no region held twice
        assert not set(held) & set(self.cache._free)  # no region both free and held
        assert self.cache.num_free_blocks + len(held) == self.cache.num_blocks
        assert self.cache.num_allocated_slots() == len(held) * MAX_LEN


TestContiguousMachine = ContiguousMachine.TestCase


def test_reserve_past_region_is_refused():
    cache = make_cache(1)
    seq = Sequence("r", [1], SamplingParams())
    assert not cache.can_reserve(seq, MAX_LEN + 1)
    assert cache.max_seq_tokens == MAX_LEN
    cache.free(seq)  # freeing a sequence that holds nothing is a no-op
    assert cache.num_free_blocks == 1


def test_refuses_more_memory_than_the_machine_has():
    model = SimpleNamespace(num_layers=30, kv_shape=KVShape("kv", 32, 128))
    ctx = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, model=model, max_model_len=131072,
                          options=ContiguousOptions(max_seqs=4096))
    reasons = ContiguousCache.unsupported_reasons(ctx)  # type: ignore[arg-type]
    assert reasons and "max_seqs=4096" in reasons[0] and "GiB" in reasons[0]
