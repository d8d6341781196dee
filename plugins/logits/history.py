"""Each sequence's tokens kept on the device, for processors that must run in the overlapped
step (where the last token is still on the device) yet read token values: the penalties.

A sequence owns one row (a slot) of a growable ``[slots, capacity]`` tensor; its length and
prompt length are known on the host, so a new token is written at a place the host knows
without reading the token. ``window`` gathers, for a step's rows, the tokens each row follows
(from the prompt's start or the output's), its drafts after them: a ``[R, L]`` index, so a
processor touches only the logits of tokens a row holds, never a dense ``[R, vocab]`` pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tessellm.core.interfaces.logits import ProcessorRows, to_device
from tessellm.core.interfaces.sequence import Sequence


@dataclass
class RowTokens:
    """The tokens a step's rows follow, padded to one width ``L``.

    - ``ids``: ``[R, L]`` token ids; a padding position repeats a token of its row, or holds 0
      in a row holding none, so a write through it repeats a write the row makes anyway.
    - ``valid``: ``[R, L]`` bool, the positions that are the row's tokens.
    - ``nonempty``: ``[R, 1]`` bool, the rows that hold a token; None when all do (the usual
      case, so a processor skips the masking).
    E.g. a row following prompt [5, 7] and draft [9], beside a row with four tokens:
    ids [5, 7, 7, 7, 9], valid [1, 1, 0, 0, 1] (history width 4, drafts width 1)."""

    ids: torch.Tensor
    valid: torch.Tensor
    nonempty: Optional[torch.Tensor]


def flat_index(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The positions of ``logits[rows[i], ids[i, j]]`` in ``logits.view(-1)``, ``[R * L]``: one
    flat index reads and writes a few logits a row much faster than 2-D indexing."""
    assert logits.is_contiguous(), "logits processors transform the engine's contiguous copy"
    return (rows[:, None] * logits.shape[1] + ids).reshape(-1)


class TokenHistory:
    """The tokens of each sequence added, on ``device``: a slot per sequence, freed on remove
    and reused, so the tensor grows only with the most sequences and tokens held at once."""

    def __init__(self, device: torch.device, slots: int = 8, capacity: int = 256):
        self.device = device
        self.tokens = torch.zeros((slots, capacity), dtype=torch.long, device=device)  # [slots, capacity]
        self.slot: dict[int, int] = {}  # seq_id -> its row of ``tokens``
        self.length: dict[int, int] = {}  # seq_id -> tokens held, on the device ones included
        self.prompt: dict[int, int] = {}  # seq_id -> its prompt's length
        self.free: list[int] = list(range(slots - 1, -1, -1))

    # ---------------------------------------------------------------- membership

    def add(self, seq: Sequence) -> None:
        """Hold ``seq``'s tokens so far (prompt and output on the host)."""
        self.remove(seq)  # (added again: its tokens replace what was held)
        if not self.free:
            self._grow(slots=2 * self.tokens.shape[0])
        slot = self.free.pop()
        n = len(seq.token_ids)
        self._fit(n)
        if n:
            self.tokens[slot, :n] = to_device(seq.token_ids, torch.long, self.device)
        self.slot[seq.seq_id], self.length[seq.seq_id] = slot, n
        self.prompt[seq.seq_id] = seq.num_prompt_tokens

    def remove(self, seq: Sequence) -> None:
        slot = self.slot.pop(seq.seq_id, None)
        if slot is not None:
            del self.length[seq.seq_id], self.prompt[seq.seq_id]
            self.free.append(slot)

    # ---------------------------------------------------------------- new tokens

    def extend(self, updates: list[tuple[Sequence, list[int]]]) -> None:
        """Append host tokens: one write for the whole step."""
        slots: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for seq, new in updates:
            at = self.length[seq.seq_id]
            slots.extend([self.slot[seq.seq_id]] * len(new))
            cols.extend(range(at, at + len(new)))
            values.extend(new)
            self.length[seq.seq_id] = at + len(new)
        if values:
            self._fit(max(cols) + 1)
            index = to_device([slots, cols], torch.long, self.device)
            self.tokens.index_put_((index[0], index[1]), to_device(values, torch.long, self.device))

    def extend_on_device(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """Append ``tokens[i]`` (on the device) to ``seqs[i]``, at the length the host knows:
        nothing is read back."""
        slots = [self.slot[seq.seq_id] for seq in seqs]
        cols = [self.length[seq.seq_id] for seq in seqs]
        for seq in seqs:
            self.length[seq.seq_id] += 1
        self._fit(max(cols) + 1)
        index = to_device([slots, cols], torch.long, self.device)
        self.tokens.index_put_((index[0], index[1]), tokens.reshape(-1).to(torch.long))

    # ---------------------------------------------------------------- one step

    def window(self, rows: ProcessorRows, outputs_only: bool) -> RowTokens | None:
        """The tokens each of ``rows`` follows: its sequence's (all of them, or the output's
        only), then its drafts. None when no row holds any."""
        slots, starts, held, drafted = [], [], [], []
        for seq, drafts in zip(rows.seqs, rows.drafts):
            sid = seq.seq_id
            start = self.prompt[sid] if outputs_only else 0
            slots.append(self.slot[sid])
            starts.append(start)
            held.append(self.length[sid] - start)
            drafted.append(len(drafts))
        width, k = max(held), max(drafted)
        if width + k == 0:
            return None
        device = self.device
        parts, masks = [], []
        if width:
            parts.append(self._held(slots, starts, held, width))
            masks.append(torch.arange(width, device=device) < to_device(held, torch.long, device)[:, None])
            if not all(held):  # a row holding no such token yet reads its first draft, or 0
                has = to_device([[h > 0] for h in held], torch.bool, device)
                fill = to_device([[d[0] if d else 0] for d in rows.drafts], torch.long, device)
                parts[0] = torch.where(has, parts[0], fill)
        if k:  # the drafts, a row's padding repeating its last draft, or its last held token
            padded = [list(d) + [d[-1] if d else 0] * (k - len(d)) for d in rows.drafts]
            part = to_device(padded, torch.long, device)
            if width and not all(drafted):
                part = torch.where(to_device([[d > 0] for d in drafted], torch.bool, device), part, parts[0][:, -1:])
            parts.append(part)
            masks.append(torch.arange(k, device=device) < to_device(drafted, torch.long, device)[:, None])
        ids = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        valid = masks[0] if len(masks) == 1 else torch.cat(masks, dim=1)
        full = [h + d > 0 for h, d in zip(held, drafted)]
        nonempty = None if all(full) else to_device([[f] for f in full], torch.bool, device)
        return RowTokens(ids, valid, nonempty)

    def _held(self, slots: list[int], starts: list[int], held: list[int], width: int) -> torch.Tensor:
        """``[R, width]``: ``tokens[slot, start + j]`` for ``j < held``, then the row's last
        held token repeated (a row holding none reads a token that is not its own)."""
        starts = [s if h else 0 for s, h in zip(starts, held)]  # (a row holding none may start past the end)
        per_row = to_device([slots, starts, [max(h - 1, 0) for h in held]], torch.long, self.device)
        cols = torch.minimum(torch.arange(width, device=self.device)[None, :], per_row[2][:, None])
        return self.tokens[per_row[0][:, None], per_row[1][:, None] + cols]

    # ---------------------------------------------------------------- storage

    def _fit(self, length: int) -> None:
        if length > self.tokens.shape[1]:
            self._grow(capacity=max(length, 2 * self.tokens.shape[1]))

    def _grow(self, slots: int | None = None, capacity: int | None = None) -> None:
        old = self.tokens
        rows, cols = slots or old.shape[0], capacity or old.shape[1]
        self.tokens = torch.zeros((rows, cols), dtype=torch.long, device=self.device)
        self.tokens[: old.shape[0], : old.shape[1]] = old
        self.free = list(range(rows - 1, old.shape[0] - 1, -1)) + self.free
