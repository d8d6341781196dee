"""Packing a step's scheduled sequences into the batch every layer reads (``BatchMetadata``,
core/interfaces/batch.py): token ids, positions, cache slots and block tables, uploaded to the
device in two copies."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from tessellm.core.engine.contracts import check_slots
from tessellm.core.interfaces.batch import PENDING_TOKEN, BatchMetadata, PromptRows, SampleSlot, ScheduledSeq
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.sequence import Sequence


def build_batch(scheduled: list[ScheduledSeq], cache: CacheManager, device: torch.device,
                drafts: dict[int, list[int]] | None = None,
                forks: dict[int, list[Sequence]] | None = None, all_logits: bool = False,
                decodes_only: bool = False, prompt_logprobs: bool = True) -> BatchMetadata:
    """Pack ``scheduled`` into a batch; the cache must already hold slots for every token.

    ``drafts`` (seq_id -> draft tokens) extends a decoding sequence's query with tokens to
    verify; ``forks`` (seq_id -> forked sequences) lets those sample from its logits too;
    ``all_logits`` asks for the logits of every query row (scoring), not only sampled ones.
    A sequence whose request asks for prompt logprobs gets the rows of its prompt positions
    too (``BatchMetadata.prompt_rows``), after every sample slot's rows, unless
    ``prompt_logprobs`` is False (a decoder's own forwards, whose items need no ``params``).
    ``decodes_only`` promises that every item is one query token that samples (the
    sequence's last token, or one still on the device), with no drafts or forks: the same
    batch, built by a shorter loop (async scheduling's steps, hundreds of sequences each).
    """
    drafts = drafts or {}
    forks = forks or {}
    prompt_logprobs = prompt_logprobs and not all_logits
    bs = cache.layout.block_size
    ids: list[int] = []
    starts: list[int] = []
    qsl = [0]
    tables: list[list[int]] = []
    rows: list[int] = []
    samples: list[SampleSlot] = []
    scored: list[tuple[Sequence, int, int, int]] = []  # prompt logprobs: (seq, packed row, position, rows)
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
        if prompt_logprobs and seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            # the rows at positions start .. predict the prompt tokens after them
            scored.append((seq, len(ids), start, min(end, seq.num_prompt_tokens - 1) - start))
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
    prompt_rows = []
    for seq, packed, position, count in scored:
        prompt_rows.append(PromptRows(seq, len(rows), position, count))
        rows.extend(range(packed, packed + count))
    if all_logits:
        rows = list(range(len(ids)))
    # everything below is vectorized: a prefill step has thousands of tokens, a decode step
    # hundreds of sequences
    num_seqs, num_tokens = len(tables), len(ids)
    padded = _padded(tables)
    width = padded.shape[1]
    qsl_np = np.asarray(qsl, dtype=np.int64)
    query_lens = np.diff(qsl_np)
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    pos = np.arange(num_tokens, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - qsl_np[:-1], query_lens)
    slots = padded[seq_of_token, pos // bs] * bs + pos % bs
    check_slots(cache, slots)
    seq_lens = np.asarray(starts, dtype=np.int64) + query_lens
    # two host-to-device copies (one per dtype) instead of one per field, from pinned memory
    # on a GPU: a copy from pageable memory may wait for the kernels already queued
    def upload(values: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(values)
        return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)

    longs = upload(np.concatenate([np.asarray(ids, dtype=np.int64), pos, slots, np.asarray(rows, dtype=np.int64)]))
    ints = upload(np.concatenate([qsl_np, seq_lens, padded.reshape(-1)]).astype(np.int32))
    t, r, b = num_tokens, len(rows), num_seqs
    batch = BatchMetadata(
        input_ids=longs[:t], positions=longs[t:2 * t], slot_mapping=longs[2 * t:3 * t], logits_indices=longs[3 * t:3 * t + r],
        query_start_loc=ints[:b + 1], seq_lens=ints[b + 1:2 * b + 1], block_tables=ints[2 * b + 1:].view(b, width),
        query_lens_cpu=query_lens.tolist(), seq_lens_cpu=seq_lens.tolist(),
        block_tables_cpu=tables, block_size=bs, seqs=[s.seq for s in scheduled], samples=samples,
        prompt_rows=prompt_rows, lora_slots_cpu=_lora_slots(scheduled))
    for group in range(1, len(getattr(cache, "layer_groups", ()))):  # a cache that frees out-of-window blocks
        group_tables = [cache.group_block_table(item.seq, group) for item in scheduled]
        group_padded = _padded(group_tables)
        group_slots = group_padded[seq_of_token, pos // bs] * bs + pos % bs
        check_slots(cache, group_slots)
        batch.groups.append(dataclasses.replace(
            batch, slot_mapping=upload(group_slots), block_tables=upload(group_padded.astype(np.int32)),
            block_tables_cpu=group_tables, groups=[]))
    return batch


def _lora_slots(scheduled: list[ScheduledSeq]) -> list[int] | None:
    """Each sequence's LoRA slot, or None when none has an adapter (a decoder's stand-in for a
    sequence without the attribute has none)."""
    slots = [getattr(item.seq, "lora_slot", -1) for item in scheduled]
    return slots if max(slots, default=-1) >= 0 else None


def _padded(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one [num_seqs, longest] int64 array, padded with -1."""
    table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    padded = np.full((len(tables), max(int(table_lens.max(initial=0)), 1)), -1, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(table_lens.sum()))
    owner = np.repeat(np.arange(len(tables)), table_lens)
    padded[owner, np.arange(flat.size) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)] = flat
    return padded
