"""Packing a step's scheduled sequences into the batch every layer reads (``BatchMetadata``,
core/interfaces/batch.py): token ids, positions, cache slots and block tables, uploaded to the
device in two copies; for sequences with images, the image rows (``image_inputs``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tessellm.core.engine.contracts import check_slots
from tessellm.core.interfaces.batch import PENDING_TOKEN, BatchMetadata, PromptRows, SampleSlot, ScheduledSeq
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.multimodal import MultimodalBatch
from tessellm.core.interfaces.sequence import Sequence


@dataclass
class _Rows:
    """A step's packed query rows before upload: token ids, each sequence's start and query
    offsets and block table, the rows whose logits are wanted, the sample slots and the
    prompt-logprob rows."""

    ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    qsl: list[int] = field(default_factory=lambda: [0])
    tables: list[list[int]] = field(default_factory=list)
    logits: list[int] = field(default_factory=list)
    samples: list[SampleSlot] = field(default_factory=list)
    prompt_rows: list[PromptRows] = field(default_factory=list)


def build_batch(scheduled: list[ScheduledSeq], cache: CacheManager, device: torch.device,
                drafts: dict[int, list[int]] | None = None,
                forks: dict[int, list[Sequence]] | None = None, all_logits: bool = False,
                decodes_only: bool = False, prompt_logprobs: bool = True,
                multimodal: bool | None = None) -> BatchMetadata:
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
    ``multimodal`` says whether some sequence may have images (None: look); the engine
    passes False while no live sequence has any, so a text batch costs no test per row.
    """
    block_table = cache.block_table
    if decodes_only:
        rows = _decode_rows(scheduled, block_table)
    else:
        rows = _query_rows(scheduled, block_table, drafts or {}, forks or {})
        if prompt_logprobs and not all_logits:
            _add_prompt_rows(rows, scheduled)
    if all_logits:
        rows.logits = list(range(len(rows.ids)))
    if multimodal is None:
        multimodal = any(getattr(item.seq, "multimodal", None) is not None for item in scheduled)
    return _upload(rows, scheduled, cache, device, multimodal)


def _decode_rows(scheduled: list[ScheduledSeq], block_table: Any) -> _Rows:
    """One query row per sequence, which samples: its next token (or one still on the device)."""
    rows = _Rows(qsl=list(range(len(scheduled) + 1)), logits=list(range(len(scheduled))))
    ids, starts, tables = rows.ids, rows.starts, rows.tables
    for item in scheduled:  # per sequence: hundreds in a decode step
        seq = item.seq
        start = seq.num_computed_tokens
        token_ids = seq.token_ids
        ids.append(token_ids[start] if start < len(token_ids) else PENDING_TOKEN)
        starts.append(start)
        tables.append(block_table(seq))
    rows.samples = [SampleSlot(item.seq, i, 1) for i, item in enumerate(scheduled)]
    return rows


def _query_rows(scheduled: list[ScheduledSeq], block_table: Any, drafts: dict[int, list[int]],
                forks: dict[int, list[Sequence]]) -> _Rows:
    """Each sequence's query (a prefill chunk, its last token, or tokens still on the device)
    and its drafts; a query that reaches the sequence's end samples, from its last row (and
    its drafts' rows), for it and the sequences forking from it."""
    rows = _Rows()
    ids, logits = rows.ids, rows.logits
    for item in scheduled:  # per sequence: hundreds in a decode step
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
        rows.starts.append(start)
        rows.qsl.append(stop)
        rows.tables.append(block_table(seq))
        if end == held + seq.num_pending:  # the chunk reaches the sequence's end: it samples
            first = len(logits)
            if draft:
                logits.extend(range(stop - 1 - len(draft), stop))
            else:
                logits.append(stop - 1)
            width, drafted = (1 + len(draft), tuple(draft)) if draft else (1, ())
            rows.samples.append(SampleSlot(seq, first, width, drafted))
            for child in forks.get(seq.seq_id, ()) if forks else ():
                rows.samples.append(SampleSlot(child, first, width, drafted))
    return rows


def _add_prompt_rows(rows: _Rows, scheduled: list[ScheduledSeq]) -> None:
    """The rows of prompt positions whose requests ask for prompt logprobs (positions start ..
    predict the prompt tokens after them), after every sample slot's rows."""
    for seq_index, item in enumerate(scheduled):
        seq = item.seq
        start = seq.num_computed_tokens
        if seq.params.prompt_logprobs is None or start >= seq.num_prompt_tokens - 1:
            continue
        packed = rows.qsl[seq_index]
        count = min(start + item.num_query_tokens, seq.num_prompt_tokens - 1) - start
        rows.prompt_rows.append(PromptRows(seq, len(rows.logits), start, count))
        rows.logits.extend(range(packed, packed + count))


def _upload(rows: _Rows, scheduled: list[ScheduledSeq], cache: CacheManager, device: torch.device,
            multimodal: bool = False) -> BatchMetadata:
    """Positions and cache slots computed (vectorized: a prefill step has thousands of tokens,
    a decode step hundreds of sequences) and everything uploaded in two copies."""
    bs = cache.layout.block_size
    tables = rows.tables
    num_seqs, num_tokens = len(tables), len(rows.ids)
    padded = _padded(tables)
    width = padded.shape[1]
    qsl_np = np.asarray(rows.qsl, dtype=np.int64)
    query_lens = np.diff(qsl_np)
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    starts = np.asarray(rows.starts, dtype=np.int64)
    pos = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - qsl_np[:-1], query_lens)
    slots = padded[seq_of_token, pos // bs] * bs + pos % bs
    check_slots(cache, slots)
    seq_lens = starts + query_lens
    upload = functools.partial(_to_device, device=device)
    images, rope_pos = image_inputs(scheduled, rows, pos, device) if multimodal else (None, pos)
    longs = upload(np.concatenate([np.asarray(rows.ids, dtype=np.int64), rope_pos, slots,
                                   np.asarray(rows.logits, dtype=np.int64)]))
    ints = upload(np.concatenate([qsl_np, seq_lens, padded.reshape(-1)]).astype(np.int32))
    t, r, b = num_tokens, len(rows.logits), num_seqs
    batch = BatchMetadata(
        input_ids=longs[:t], positions=longs[t:2 * t], slot_mapping=longs[2 * t:3 * t], logits_indices=longs[3 * t:3 * t + r],
        query_start_loc=ints[:b + 1], seq_lens=ints[b + 1:2 * b + 1], block_tables=ints[2 * b + 1:].view(b, width),
        query_lens_cpu=query_lens.tolist(), seq_lens_cpu=seq_lens.tolist(),
        block_tables_cpu=tables, block_size=bs, seqs=[s.seq for s in scheduled], samples=rows.samples,
        prompt_rows=rows.prompt_rows, lora_slots_cpu=_lora_slots(scheduled), images=images)
    for group in range(1, len(getattr(cache, "layer_groups", ()))):  # a cache that frees out-of-window blocks
        group_tables = [cache.group_block_table(item.seq, group) for item in scheduled]
        group_padded = _padded(group_tables)
        group_slots = group_padded[seq_of_token, pos // bs] * bs + pos % bs
        check_slots(cache, group_slots)
        batch.groups.append(dataclasses.replace(
            batch, slot_mapping=upload(group_slots), block_tables=upload(group_padded.astype(np.int32)),
            block_tables_cpu=group_tables, groups=[]))
    return batch


def image_inputs(scheduled: list[ScheduledSeq], rows: _Rows, pos: np.ndarray,
                 device: torch.device) -> tuple[MultimodalBatch | None, np.ndarray]:
    """The image rows of a batch (each row a placeholder of an image the query reaches, with
    that image's embedding, which the engine attached to the sequence) and the rows' rotary
    positions: M-RoPE sequences' rows after their prompt shifted by its delta, and every row's
    3-D position where some row lies in a prompt with M-RoPE positions (``pos``: each row's
    position in its sequence, which cache slots keep)."""
    rope_pos = pos
    emb_rows: list[np.ndarray] = []
    embeds: list[torch.Tensor] = []
    spans: list[tuple[int, int, int]] = []
    in_prompts: list[tuple[int, np.ndarray]] = []  # (first row, 3-D positions of its rows in the prompt)
    for i, item in enumerate(scheduled):
        mm = item.seq.multimodal
        if mm is None:
            continue
        first, last, start = rows.qsl[i], rows.qsl[i + 1], rows.starts[i]
        end = start + last - first
        for j, image in enumerate(mm.images):
            if image.offset >= end or image.end <= start:
                continue
            spans.append((i, image.offset, image.end))
            at = image.embed_positions()
            lo, hi = np.searchsorted(at, start), np.searchsorted(at, end)
            if hi > lo:
                emb_rows.append(first + at[lo:hi] - start)
                embeds.append(mm.embeds[j][lo:hi])
        if mm.rope_positions is None:
            continue
        prompt = item.seq.num_prompt_tokens
        if rope_pos is pos:
            rope_pos = pos.copy()
        rope_pos[first:last] += np.where(pos[first:last] >= prompt, mm.rope_delta, 0)
        if start < prompt:
            in_prompts.append((first, mm.rope_positions[:, start:min(end, prompt)]))
    pos3 = None
    if in_prompts:  # rows in a prompt take its table's 3-D positions; the others their 1-D one thrice
        pos3 = np.repeat(rope_pos[None, :], 3, axis=0)
        for first, table in in_prompts:
            pos3[:, first:first + table.shape[1]] = table
    if not (emb_rows or spans or pos3 is not None):
        return None, rope_pos
    if emb_rows:
        flat = np.concatenate(emb_rows)
        rows_t, embeds_t = _to_device(flat, device), torch.cat(embeds)
    else:
        rows_t, embeds_t = torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, device=device)
    positions = _to_device(np.ascontiguousarray(pos3), device) if pos3 is not None else None
    return MultimodalBatch(rows_t, embeds_t, positions, spans), rope_pos


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """From pinned memory on a GPU: a copy from pageable memory may wait for the kernels
    already queued."""
    host = torch.from_numpy(values)
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


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
