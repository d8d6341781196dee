"""The engine's one list of logits processors: which each live sequence uses, the rows each
processor transforms in a step, and the tokens each is told of.

A step with no sequence that uses a processor costs one dictionary test. Whether a sequence
may run in the overlapped step is decided here too, from its processors' ``overlap_safe``.

A processor transforms only the rows it is handed. The ones tessellm ships are trusted with
the step's whole logits tensor; any other is handed a tensor of its own rows alone (gathered,
transformed, scattered back), so a third party's slip cannot reach the rows of requests that
did not name it. With ``TESSELLM_CHECK_CONTRACTS`` every processor gets the whole tensor plus
a guard row no request owns, and one that changes a row it was not handed is a
``ContractError`` naming it (even when its request runs alone, so fault isolation finds it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tessellm.core.engine import contracts
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.logits import PROCESSOR_FIELDS, LogitsProcessor, ProcessorRows, to_device
from tessellm.core.interfaces.sequence import SamplingParams, Sequence

Binding = tuple[tuple[LogitsProcessor, Any], ...]
"""The processors a request uses, each with its validated arguments, in application order."""

StepPlan = list[tuple[LogitsProcessor, ProcessorRows]]


class LogitsProcessors:
    """Every logits processor of a pipeline, and the bindings of the live sequences.

    ``bind(params)`` validates a request against them when it arrives; ``add(seq, binding)``
    and ``remove(seq)`` follow a sequence's life; ``plan(batch)`` lists a step's processors
    with their rows, ``apply`` runs them on a copy of the logits; ``accept`` and
    ``accept_on_device`` report the tokens each sequence took.
    """

    def __init__(self, processors: list[LogitsProcessor]):
        self.processors = sorted(processors, key=lambda p: (p.order, p.name))
        self._by_name = {p.name: p for p in self.processors}
        self.bound: dict[int, Binding] = {}  # seq_id -> its processors, for live sequences using any
        self.isolated = frozenset(p for p in self.processors if not shipped_with_tessellm(p))
        """The processors handed only their own rows (every one not shipped with tessellm)."""
        self.check_rows = contracts.every_step()
        """Whether each processor's untouched rows are checked (``TESSELLM_CHECK_CONTRACTS``)."""

    def names(self) -> list[str]:
        return [p.name for p in self.processors]

    def bind(self, params: SamplingParams) -> Binding:
        """The processors ``params`` turn on with their arguments; InvalidRequestError naming an
        unknown processor, one named twice, or arguments its processor refuses."""
        for request in params.logits_processors:
            proc = self._by_name.get(request.name)
            if proc is None:
                named = ", ".join(n for n in self.names() if not self._by_name[n].fields) or "none"
                raise InvalidRequestError(f"logits_processors names {request.name!r}, which is not an installed "
                                          f"logits processor (installed: {named})", field="logits_processors")
            if proc.fields:
                raise InvalidRequestError(f"logits_processors names {request.name!r}, a built-in set by "
                                          f"SamplingParams.{', '.join(proc.fields)}; set that field instead",
                                          field="logits_processors")
        self._check_fields_served(params)
        bound = []
        for proc in self.processors:
            args = _naming_field(proc, params)
            if args is not None:
                bound.append((proc, args))
        return tuple(bound)

    def _check_fields_served(self, params: SamplingParams) -> None:
        served = {f for p in self.processors for f in p.fields}
        defaults = SamplingParams.model_fields
        for name in PROCESSOR_FIELDS:
            if name not in served and getattr(params, name) != defaults[name].get_default(call_default_factory=True):
                raise InvalidRequestError(f"SamplingParams.{name} is set, but no installed logits processor applies "
                                          f"it (its plugin is not loaded; see `tessellm plugins`); leave it out", field=name)

    def add(self, seq: Sequence, binding: Binding) -> None:
        """``seq`` starts using ``binding``'s processors (each builds its state from ``seq``'s tokens)."""
        if not binding:
            return
        self.bound[seq.seq_id] = binding
        for proc, args in binding:
            proc.add(seq, args)

    def remove(self, seq: Sequence) -> None:
        for proc, _ in self.bound.pop(seq.seq_id, ()):
            proc.remove(seq)

    def overlap_safe(self, seq: Sequence) -> bool:
        """Whether every processor ``seq`` uses may run in the overlapped step."""
        return all(proc.overlap_safe for proc, _ in self.bound.get(seq.seq_id, ()))

    def binding(self, seq: Sequence) -> Binding:
        return self.bound.get(seq.seq_id, ())

    # ---------------------------------------------------------------- one step

    def plan(self, batch: BatchMetadata) -> StepPlan:
        """The step's processors, in order, each with the rows that use it ([] when none does).
        The samples of an ``n > 1`` request share their rows in the step it forks: each row
        is transformed once."""
        if not self.bound:
            return []
        bound = self.bound
        per: dict[LogitsProcessor, tuple[list, ...]] = {}
        seen: set[int] = set()
        for slot in batch.samples:
            binding = bound.get(slot.seq.seq_id)
            if not binding or slot.first_row in seen:
                continue
            seen.add(slot.first_row)
            seq = slot.seq
            outputs = seq.num_tokens - seq.num_prompt_tokens
            for proc, args in binding:
                rows, seqs, argss, drafts, counts = per.setdefault(proc, ([], [], [], [], []))
                for j in range(slot.num_rows):
                    rows.append(slot.first_row + j)
                    seqs.append(seq)
                    argss.append(args)
                    drafts.append(slot.draft_tokens[:j])
                    counts.append(outputs + j)
        device = batch.logits_indices.device
        return [(proc, ProcessorRows(*per[proc], index=to_device(per[proc][0], torch.long, device)))
                for proc in self.processors if proc in per]

    def apply(self, logits: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """``logits`` transformed by ``plan``'s processors in order: a copy when any runs,
        ``logits`` itself otherwise. A processor not shipped with tessellm sees its own rows
        only; with ``check_rows`` each is checked to leave every other row as it was."""
        if not plan:
            return logits
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        else:
            logits = logits.clone()
        for proc, rows in plan:
            if self.check_rows:
                apply_checked(proc, logits, rows)
            elif proc in self.isolated and len(rows) < logits.shape[0]:
                apply_to_own_rows(proc, logits, rows)
            else:
                proc.apply(logits, rows)
        return logits

    def accept(self, appended: list[tuple[Sequence, list[int]]]) -> None:
        """Tell each processor the tokens appended in a step to the sequences that use it."""
        per: dict[LogitsProcessor, list[tuple[Sequence, list[int]]]] = {}
        for seq, tokens in appended:
            for proc, _ in self.bound.get(seq.seq_id, ()):
                per.setdefault(proc, []).append((seq, tokens))
        for proc in self.processors:
            if proc in per:
                proc.accept(per[proc])

    def accept_on_device(self, batch: BatchMetadata, tokens: torch.Tensor) -> None:
        """Tell each processor the tokens an overlapped step picked (one per sample slot, on
        the device) for the sequences that use it."""
        if not self.bound:
            return
        per: dict[LogitsProcessor, tuple[list[Sequence], list[int]]] = {}
        for j, slot in enumerate(batch.samples):
            for proc, _ in self.bound.get(slot.seq.seq_id, ()):
                seqs, picks = per.setdefault(proc, ([], []))
                seqs.append(slot.seq)
                picks.append(j)
        for proc in self.processors:
            if proc in per:
                seqs, picks = per[proc]
                mine = tokens if len(picks) == tokens.shape[0] else tokens.index_select(
                    0, to_device(picks, torch.long, tokens.device))
                proc.accept_on_device(seqs, mine)


def _naming_field(proc: LogitsProcessor, params: SamplingParams) -> object:
    """``proc.request_args(params)``; a refusal that names no field is about the fields the
    processor reads (``fields``), or its entry in ``logits_processors``."""
    try:
        return proc.request_args(params)
    except InvalidRequestError as exc:
        if exc.field is None:
            exc.field = proc.fields[0] if proc.fields else "logits_processors"
        raise


def shipped_with_tessellm(proc: LogitsProcessor) -> bool:
    """Whether ``proc``'s class is one of tessellm's own (its built-ins, the grammar's mask)."""
    return type(proc).__module__.split(".")[0] == "tessellm"


def apply_to_own_rows(proc: LogitsProcessor, logits: torch.Tensor, rows: ProcessorRows) -> None:
    """``proc.apply`` on a tensor of ``rows``' rows alone (numbered 0..len-1), copied back into
    ``logits``: whatever it writes, no other request's row changes. No host synchronisation."""
    own = logits.index_select(0, rows.index)  # [len(rows), vocab]
    renumbered = dataclasses.replace(rows, rows=list(range(len(rows))),
                                     index=torch.arange(len(rows), device=rows.index.device))
    proc.apply(own, renumbered)
    logits.index_copy_(0, rows.index, own)


def apply_checked(proc: LogitsProcessor, logits: torch.Tensor, rows: ProcessorRows) -> None:
    """``proc.apply`` on the whole of ``logits`` and a guard row past its end that no request
    owns; a ContractError naming ``proc`` when it changed any row it was not handed."""
    work = torch.cat([logits, logits[:1].flip(-1)])  # the guard: real values, owned by no row
    before = work.clone()
    proc.apply(work, rows)
    others = torch.ones(work.shape[0], dtype=torch.bool, device=work.device)
    others[rows.index] = False
    same = (work[others] == before[others]) | (work[others].isnan() & before[others].isnan())
    changed = int((~same.all(dim=-1)).sum())
    if changed:
        raise contracts.broken(proc, f"apply changed {changed} of the {int(others.sum())} logits rows it was not "
                                     f"handed ({len(rows)} handed: rows.rows); it transforms logits[rows.rows] "
                                     f"in place and leaves every other row as it was")
    logits.copy_(work[:-1])
