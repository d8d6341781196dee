"""Per-step batch metadata: planned once per engine step, read by every layer.

The batch is packed ("varlen"): the query tokens of all scheduled sequences are laid end to
end in one tensor, with no padding, and per-sequence offsets say where each begins. A
prefill chunk, a single decode token and a speculative verification of k+1 tokens are the
same thing with different query lengths.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .sequence import Sequence

if TYPE_CHECKING:
    from .cache import CacheManager


PENDING_TOKEN = 0
"""Stand-in id for a token not yet on the host (async scheduling); the engine overwrites it
on the device before the forward reads it."""


@dataclass
class ScheduledSeq:
    """A sequence chosen for this step and how many of its uncomputed tokens to process."""

    seq: Sequence
    num_query_tokens: int


@dataclass
class SchedulerOutput:
    """What one ``Scheduler.schedule()`` call decided."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    """Sequences whose cache was freed to make room; they are recomputed later."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampleSlot:
    """Where one sequence's logits sit in the step's logits tensor.

    ``num_rows`` is 1 for plain decoding and 1 + len(draft_tokens) for speculative
    verification; the rows are consecutive. Parallel sampling (n > 1) gives each forked
    sequence its own slot pointing at the same rows.
    """

    seq: Sequence
    first_row: int
    num_rows: int
    draft_tokens: tuple[int, ...] = ()

    @property
    def last_row(self) -> int:
        return self.first_row + self.num_rows - 1


@dataclass
class BatchMetadata:
    """Everything a forward needs about the packed batch; built once per step.

    Example with block size 16: sequence A has 20 tokens cached and decodes 1, sequence B
    prefills a 3-token chunk at positions 0..2. Then ``input_ids`` has 4 rows,
    ``query_start_loc = [0, 1, 4]``, ``seq_lens = [21, 3]``, ``positions = [20, 0, 1, 2]``;
    if A's block table is [7, 2] and B's is [5], ``slot_mapping = [2*16+4, 80, 81, 82]``.
    """

    input_ids: torch.Tensor  # [T] int64, packed query tokens
    positions: torch.Tensor  # [T] int64, absolute position of each query token
    query_start_loc: torch.Tensor  # [B+1] int32, sequence i's queries are rows [q[i], q[i+1])
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) per query token
    block_tables: torch.Tensor  # [B, max_blocks] int32, physical blocks per sequence, -1 padded
    logits_indices: torch.Tensor  # [R] int64, packed rows whose logits the decoder needs
    query_lens_cpu: list[int]  # host copies, so planning never waits on the device
    seq_lens_cpu: list[int]
    block_tables_cpu: list[list[int]]
    block_size: int
    seqs: list[Sequence]  # the scheduled sequences, in batch order
    samples: list[SampleSlot]  # which sequences sample this step, in logits-row order

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    def padded_tables(self, members: list[int], num_blocks: int) -> torch.Tensor:
        """Block tables of sequences ``members`` cut or padded (with block 0) to ``num_blocks``
        columns, [len(members), num_blocks] int64 on the CPU. A table may hold more blocks
        than its tokens fill: slots reserved for a speculative decoder's drafts."""
        return torch.tensor([t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks]))
                             for t in (self.block_tables_cpu[i] for i in members)], dtype=torch.long)


def build_batch(scheduled: list[ScheduledSeq], cache: CacheManager, device: torch.device,
                drafts: dict[int, list[int]] | None = None,
                forks: dict[int, list[Sequence]] | None = None, all_logits: bool = False,
                decodes_only: bool = False) -> BatchMetadata:
    """Pack ``scheduled`` into a batch; the cache must already hold slots for every token.

    ``drafts`` (seq_id -> draft tokens) extends a decoding sequence's query with tokens to
    verify; ``forks`` (seq_id -> forked sequences) lets those sample from its logits too;
    ``all_logits`` asks for the logits of every query row (scoring), not only sampled ones.
    ``decodes_only`` promises that every item is one query token that samples (the
    sequence's last token, or one still on the device), with no drafts or forks: the same
    batch, built by a shorter loop (async scheduling's steps, hundreds of sequences each).
    """
    drafts = drafts or {}
    forks = forks or {}
    bs = cache.layout.block_size
    ids: list[int] = []
    starts: list[int] = []
    qsl = [0]
    tables: list[list[int]] = []
    rows: list[int] = []
    samples: list[SampleSlot] = []
    block_table = cache.block_table
    if decodes_only:
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            token_ids = seq.token_ids
            ids.append(token_ids[start] if start < len(token_ids) else PENDING_TOKEN)
            starts.append(start)
            tables.append(block_table(seq))
        qsl = list(range(len(scheduled) + 1))
        rows = list(range(len(scheduled)))
        samples = [SampleSlot(item.seq, i, 1) for i, item in enumerate(scheduled)]
    for item in scheduled if not decodes_only else ():  # per sequence: hundreds in a decode step
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_query_tokens
        held = len(seq.token_ids)
        if start < held:
            ids.extend(seq.token_ids[start:end])
        if seq.num_pending and end > held:  # a token still on the device: the engine fills it there
            pending = end - max(start, held)
            if pending == 1:  # async decoding's steady state
                ids.append(PENDING_TOKEN)
            else:
                ids.extend([PENDING_TOKEN] * pending)
        draft = drafts.get(seq.seq_id) if drafts else None
        if draft:
            ids.extend(draft)
        stop = len(ids)
        starts.append(start)
        qsl.append(stop)
        tables.append(block_table(seq))
        if end == held + seq.num_pending:  # the chunk reaches the sequence's end: it samples
            first = len(rows)
            if draft:
                rows.extend(range(stop - 1 - len(draft), stop))
            else:
                rows.append(stop - 1)
            width = 1 + len(draft) if draft else 1
            samples.append(SampleSlot(seq, first, width, tuple(draft) if draft else ()))
            for child in forks.get(seq.seq_id, ()) if forks else ():
                samples.append(SampleSlot(child, first, width, tuple(draft) if draft else ()))
    if all_logits:
        rows = list(range(len(ids)))
    # everything below is vectorized: a prefill step has thousands of tokens, a decode step
    # hundreds of sequences
    num_seqs, num_tokens = len(tables), len(ids)
    table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=num_seqs)
    width = max(int(table_lens.max(initial=0)), 1)
    padded = np.full((num_seqs, width), -1, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(table_lens.sum()))
    owner = np.repeat(np.arange(num_seqs), table_lens)
    padded[owner, np.arange(flat.size) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)] = flat
    qsl_np = np.asarray(qsl, dtype=np.int64)
    query_lens = np.diff(qsl_np)
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    pos = np.arange(num_tokens, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - qsl_np[:-1], query_lens)
    slots = padded[seq_of_token, pos // bs] * bs + pos % bs
    seq_lens = np.asarray(starts, dtype=np.int64) + query_lens
    # two host-to-device copies (one per dtype) instead of one per field, from pinned memory
    # on a GPU: a copy from pageable memory may wait for the kernels already queued
    def upload(values: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(values)
        return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)

    longs = upload(np.concatenate([np.asarray(ids, dtype=np.int64), pos, slots, np.asarray(rows, dtype=np.int64)]))
    ints = upload(np.concatenate([qsl_np, seq_lens, padded.reshape(-1)]).astype(np.int32))
    t, r, b = num_tokens, len(rows), num_seqs
    return BatchMetadata(
        input_ids=longs[:t], positions=longs[t:2 * t], slot_mapping=longs[2 * t:3 * t], logits_indices=longs[3 * t:3 * t + r],
        query_start_loc=ints[:b + 1], seq_lens=ints[b + 1:2 * b + 1], block_tables=ints[2 * b + 1:].view(b, width),
        query_lens_cpu=query_lens.tolist(), seq_lens_cpu=seq_lens.tolist(),
        block_tables_cpu=tables, block_size=bs, seqs=[s.seq for s in scheduled], samples=samples)
