"""``build_batch`` (core/batch.py): the short loop for decode-only steps builds exactly the
batch the general loop builds."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tessellm.core.interfaces.batch import ScheduledSeq
from tessellm.core.engine.batch_builder import build_batch
from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.plugins.cache.paged import PagedCache, PagedOptions

CPU = torch.device("cpu")


@given(st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=12), st.sampled_from([1, 4, 16]))
def test_decodes_only_batch_equals_the_general_one(seqs, block_size):
    """Each sequence decodes one token: its last one (synchronous), or one still on the device
    (async: ``num_pending``). Every tensor and host list of the two batches is equal."""
    cache = PagedCache(PagedOptions(block_size=block_size, num_blocks=256),
                       CacheSpec(1, 1, 1, torch.float32, CPU, 4096), KVLayout("kv", block_size, torch.float32))
    scheduled = []
    for i, (length, pending) in enumerate(seqs):
        seq = Sequence(f"r{i}", [(7 * i + j) % 97 + 1 for j in range(length)], SamplingParams(max_tokens=8))
        seq.num_pending = int(pending)
        seq.num_computed_tokens = seq.num_tokens - 1
        cache.reserve(seq, seq.num_tokens)
        scheduled.append(ScheduledSeq(seq, 1))
    general = build_batch(scheduled, cache, CPU)
    short = build_batch(scheduled, cache, CPU, decodes_only=True)
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "query_start_loc", "seq_lens",
                 "block_tables"):
        assert torch.equal(getattr(general, name), getattr(short, name)), name
    assert (general.query_lens_cpu, general.seq_lens_cpu, general.block_tables_cpu) == \
        (short.query_lens_cpu, short.seq_lens_cpu, short.block_tables_cpu)
    assert [(s.seq, s.first_row, s.num_rows, s.draft_tokens) for s in general.samples] == \
        [(s.seq, s.first_row, s.num_rows, s.draft_tokens) for s in short.samples]
