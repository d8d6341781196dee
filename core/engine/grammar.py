"""The engine's side of structured outputs: one grammar matcher per constrained sequence, its
masks applied to the sample rows before any decoder picks, and the picked tokens fed back.

Speculative steps verify k drafts on k + 1 rows: row j must allow what the grammar allows
after the sequence's tokens and drafts 0..j-1, so the matcher walks the drafts while the
masks are filled and is rolled back before the decoder runs. A draft the grammar refuses is
refused by its masked row (probability 0: greedy verification and rejection sampling both
reject it), so accepted tokens always satisfy the grammar; the rows after it keep the mask of
the last allowed state, never an all -inf row.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.grammar import GrammarBackend, GrammarMatcher, GrammarSpec
from tessellm.core.interfaces.sequence import SamplingParams, Sequence


class GrammarSession:
    """Matchers of the live constrained sequences and the masks of each step.

    ``check(params)`` compiles (or finds cached) a request's grammar when it arrives, raising
    ``InvalidRequestError`` when the pipeline has no grammar backend or the grammar does not
    compile. ``mask(logits, batch)`` returns the logits with every disallowed token at -inf
    on constrained rows (a copy; the model's own logits stay for log-probabilities).
    ``accept(seq, token)`` advances a sequence's matcher (False: the grammar refuses the
    token); ``is_complete(seq)`` says its grammar has ended; ``finish(seq)`` drops it.

    The backend is built by ``build`` when the first grammar is compiled (reading a large
    vocabulary takes a noticeable part of a second, which a pipeline that never sees a
    structured request should not pay); ``build`` None: the pipeline has none.
    """

    def __init__(self, build: Callable[[], GrammarBackend] | None, max_rollback: int):
        self._build = build
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()  # a server compiles on its worker threads
        self.max_rollback = max_rollback
        self.matchers: dict[int, GrammarMatcher] = {}
        self.live = 0  # live constrained sequences (skip every step's scan without)

    @property
    def backend(self) -> GrammarBackend | None:
        """The grammar backend, built on first use; None where the pipeline has none."""
        if self._backend is None and self._build is not None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._build()
        return self._backend

    def check(self, params: SamplingParams) -> None:
        if params.structured_output is not None:
            self.compile(params.structured_output)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar (cached by the backend): what a server calls off the engine's
        thread before it adds the request."""
        backend = self.backend
        if backend is None:
            raise InvalidRequestError(
                f"the request asks for structured output ({spec.kind}), but this pipeline has no grammar backend: "
                f"install one (pip install xgrammar) or name one in the config's grammar section")
        return backend.compile(spec)

    def _matcher(self, seq: Sequence) -> GrammarMatcher:
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None:
            compiled = self.backend.compile(seq.params.structured_output)
            matcher = self.matchers[seq.seq_id] = self.backend.matcher(compiled, self.max_rollback)
            for token in seq.output_token_ids:  # a sequence forked after its first token
                matcher.accept(token)
        return matcher

    def mask(self, logits: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        slots = [s for s in batch.samples if s.seq.params.structured_output is not None]
        if not slots:
            return logits
        rows: list[int] = []
        done: set[int] = set()  # samples of one request share rows until they fork: mask each once
        buffer = self.backend.new_mask(sum(s.num_rows for s in slots))
        for slot in slots:
            if slot.first_row in done:
                continue
            done.add(slot.first_row)
            matcher = self._matcher(slot.seq)
            walked = 0
            for j in range(slot.num_rows):
                matcher.fill_mask(buffer, len(rows))
                rows.append(slot.first_row + j)
                if j < len(slot.draft_tokens) and walked == j and matcher.accept(slot.draft_tokens[j]):
                    walked += 1
            if walked:
                matcher.rollback(walked)
        logits = logits.clone()
        self.backend.apply_mask(logits, buffer[:len(rows)], rows)
        return logits

    def accept(self, seq: Sequence, token: int) -> bool:
        if seq.params.structured_output is None:
            return True
        return self._matcher(seq).accept(token)

    def is_complete(self, seq: Sequence) -> bool:
        matcher = self.matchers.get(seq.seq_id)
        return matcher is not None and matcher.is_terminated()

    def finish(self, seq: Sequence) -> None:
        if seq.params.structured_output is not None:
            self.matchers.pop(seq.seq_id, None)
            self.live -= 1
