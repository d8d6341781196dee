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
from tessellm.core.interfaces.grammar import GrammarBackend, GrammarMatcher, GrammarSpec
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorRows
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.version import PLUGIN_API_VERSION


class GrammarSession:
    """Matchers of the live constrained sequences and the masks of each step.

    ``check(params)`` compiles (or finds cached) a request's grammar when it arrives, raising
    ``InvalidRequestError`` when the pipeline has no grammar backend or the grammar does not
    compile. ``fill(logits, rows)`` sets every disallowed token to -inf
    on constrained rows (in place, on the engine's copy: ``GrammarMask``, the grammar as a
    logits processor, calls it). ``accept(seq, token)`` advances a sequence's matcher (False: the grammar refuses the
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
                f"install one (pip install xgrammar) or name one in the config's grammar section",
                field="structured_output")
        return backend.compile(spec)

    def _matcher(self, seq: Sequence) -> GrammarMatcher:
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None:
            compiled = self.backend.compile(seq.params.structured_output)
            matcher = self.matchers[seq.seq_id] = self.backend.matcher(compiled, self.max_rollback)
            for token in seq.output_token_ids:  # a sequence forked after its first token
                matcher.accept(token)
        return matcher

    def fill(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        """Set every token the grammar disallows to -inf on ``rows`` (in place). Rows of one
        slot come in order, each following one more draft than the row before; the matcher
        walks those drafts and is rolled back after the slot."""
        buffer = self.backend.new_mask(len(rows))
        matcher, walked, refused = None, 0, False
        for i, (seq, drafts) in enumerate(zip(rows.seqs, rows.drafts)):
            if not drafts:  # a slot's first row: the sequence's own state
                if walked:
                    matcher.rollback(walked)
                matcher, walked, refused = self._matcher(seq), 0, False
            elif not refused:  # the draft just before this row
                if matcher.accept(drafts[-1]):
                    walked += 1
                else:  # the rows after a refused draft keep the last allowed state's mask
                    refused = True
            matcher.fill_mask(buffer, i)
        if walked:
            matcher.rollback(walked)
        self.backend.apply_mask(logits, buffer[:len(rows)], rows.rows)

    def accept(self, seq: Sequence, token: int) -> bool:
        if seq.params.structured_output is None:
            return True
        return self._matcher(seq).accept(token)

    def is_complete(self, seq: Sequence) -> bool:
        matcher = self.matchers.get(seq.seq_id)
        return matcher is not None and matcher.is_terminated()

    def finish(self, seq: Sequence) -> None:
        self.matchers.pop(seq.seq_id, None)


class GrammarMask(LogitsProcessor):
    """The grammar's mask as the engine's last logits processor: a request with
    ``structured_output`` uses it. The matchers advance in the engine's token loop, which
    must fail a request whose decoder picked a forbidden token and end one whose grammar is
    complete (``GrammarSession.accept`` / ``is_complete``), so ``accept`` here does nothing."""

    name = "structured_output"
    api_version = PLUGIN_API_VERSION
    order = 100
    fields = ("structured_output",)

    def __init__(self, session: GrammarSession):
        self.session = session

    def request_args(self, params: SamplingParams) -> GrammarSpec | None:
        self.session.check(params)  # compiles now: a grammar that does not compile is refused on arrival
        return params.structured_output

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        self.session.fill(logits, rows)

    def remove(self, seq: Sequence) -> None:
        self.session.finish(seq)
