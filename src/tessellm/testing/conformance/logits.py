"""The logits-processor contract as properties, written against the interface alone
(``LogitsProcessor``, ``ProcessorRows``, ``ProcessorContext``): ``apply`` changes only the
rows it is handed, in place, a batch as each row alone; state advanced by ``accept`` equals
state built by ``add`` on the whole history (a preempted and recomputed sequence, a forked
sample); a verification row that follows drafts equals a sequence that holds them, and the
drafts leave no trace; an overlap-safe processor's ``accept_on_device`` equals ``accept``;
``remove`` forgets; a default request does not use the processor; a row keeps a finite logit;
the same inputs give the same output.

Everything runs on the CPU with small vocabularies (``VOCAB``) and a tokenizer of one token
per character (``char_encode``). Histories are drawn from a few tokens, those the request
names among them (its ids, its strings encoded), so that penalties, bans and n-grams find
repeats to act on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorContext, ProcessorRows
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.testing.conformance.base import ConformanceSuite, property_settings

VOCAB = st.integers(64, 200)
"""Logits widths the properties draw: every example request's token ids fit the smallest."""

EOS = 2
"""The end-of-sequence id of the suite's ``ProcessorContext``."""

MAX_MODEL_LEN = 256

FIELD_EXAMPLES: dict[str, dict[str, Any]] = {
    "min_tokens": {"min_tokens": 4, "stop_token_ids": [5]},
    "logit_bias": {"logit_bias": {3: -100.0, 10: 4.5, 60: 100.0}},
    "presence_penalty": {"presence_penalty": 0.8},
    "frequency_penalty": {"frequency_penalty": -0.6},
    "repetition_penalty": {"repetition_penalty": 1.4},
    "bad_words": {"bad_words": ["ab", "c"]},
    "bad_words_ids": {"bad_words_ids": [[7], [3, 4], [5, 6, 7]]},
    "allowed_token_ids": {"allowed_token_ids": [2, 3, 5, 8, 13, 21, 34, 55]},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
}
"""A request turning on each ``SamplingParams`` field a built-in may read: what a suite
uses for a built-in (a processor with ``fields``) when it sets no ``requests``."""


def char_encode(vocab_size: int) -> Callable[[str], list[int]]:
    """A deterministic tokenizer for ``vocab_size`` ids: one token per character, past the
    three special ids (``EOS`` among them)."""

    def encode(text: str) -> list[int]:
        return [3 + ord(ch) % (vocab_size - 3) for ch in text]

    return encode


def processor_context(vocab_size: int) -> ProcessorContext:
    """The suite's pipeline as a processor sees it: CPU, ``EOS``, ``char_encode``."""
    return ProcessorContext(vocab_size, torch.device("cpu"), frozenset({EOS}), char_encode(vocab_size),
                            MAX_MODEL_LEN)


def mentioned_tokens(value: Any, ctx: ProcessorContext) -> set[int]:
    """The token ids a request names anywhere in ``value`` (ints, int dict keys, strings
    encoded as they stand and with a leading space) that fit the vocabulary."""
    if isinstance(value, bool) or isinstance(value, float):
        return set()
    if isinstance(value, int):
        return {value} if 0 <= value < ctx.vocab_size else set()
    if isinstance(value, str):
        return {t for t in ctx.encode(value) + ctx.encode(" " + value) if 0 <= t < ctx.vocab_size}
    found: set[int] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if key != "name":  # a processor's name (logits_processors) holds no token
                found |= (mentioned_tokens(key, ctx) if isinstance(key, int) else set()) | mentioned_tokens(item, ctx)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found |= mentioned_tokens(item, ctx)
    return found


@dataclass
class Row:
    """One logits row a processor transforms: a sequence, its arguments, the drafts it follows."""

    seq: Sequence
    args: Any
    drafts: tuple[int, ...] = ()


class Subject:
    """One processor under test on a ``vocab_size``-wide vocabulary, with the requests that
    turn it on (each parsed and bound once) and a generator for histories and logits."""

    def __init__(self, cls: type[LogitsProcessor], options: Any, requests: list[dict[str, Any]],
                 vocab_size: int, seed: int):
        self.cls, self.options = cls, options
        self.ctx = processor_context(vocab_size)
        self.proc = self.fresh()
        self.params = [SamplingParams(**r) for r in requests]
        self.args = [admitted_args(self.proc, p, i) for i, p in enumerate(self.params)]
        self.g = torch.Generator().manual_seed(seed)
        common = sorted(mentioned_tokens(requests, self.ctx) | {EOS})
        width = [2, 4, 8, vocab_size][int(torch.randint(4, (), generator=self.g))]
        drawn = torch.randperm(vocab_size, generator=self.g)[:width].tolist()
        self.alphabet = sorted(set(drawn) | set(common))

    def fresh(self) -> LogitsProcessor:
        """A new instance of the processor, holding no sequence."""
        return self.cls(self.options, self.ctx)

    def tokens(self, n: int) -> list[int]:
        """``n`` tokens drawn from the alphabet (few distinct tokens: repeats)."""
        picks = torch.randint(len(self.alphabet), (n,), generator=self.g).tolist()
        return [self.alphabet[i] for i in picks]

    def sequence(self, request: int, tokens: list[int], num_prompt: int) -> Sequence:
        """A sequence of request ``request`` holding ``tokens``, the first ``num_prompt`` its prompt."""
        seq = Sequence(f"request-{request}", tokens[:num_prompt], self.params[request])
        seq.token_ids = list(tokens)
        return seq

    def logits(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """Random logits [rows, vocab], positive and negative."""
        return torch.randn(rows, self.ctx.vocab_size, generator=self.g, dtype=torch.float64).to(dtype) * 3

    def pick(self, row: torch.Tensor) -> int:
        """A token the processed ``row`` leaves possible (finite), drawn at random."""
        finite = torch.nonzero(row.isfinite()).flatten().tolist()
        return finite[int(torch.randint(len(finite), (), generator=self.g))] if finite else EOS


def admitted_args(proc: LogitsProcessor, params: SamplingParams, index: int) -> Any:
    """``proc.request_args(params)``, the check the engine makes when a request arrives;
    where the processor refuses the request (InvalidRequestError), the running property is
    skipped with its reason, as the engine would never run it."""
    try:
        return proc.request_args(params)
    except InvalidRequestError as exc:
        pytest.skip(f"logits plugin {proc.name!r} refuses the suite's request {index} "
                    f"({params.model_dump(exclude_defaults=True)}) at admission, so it never runs: {exc}")


def processor_rows(entries: list[Row], positions: list[int]) -> ProcessorRows:
    """``ProcessorRows`` for ``entries`` at logits rows ``positions``, each row following its
    sequence's output (tokens still on the device included) and its drafts."""
    return ProcessorRows(rows=list(positions), seqs=[e.seq for e in entries], args=[e.args for e in entries],
                         drafts=[tuple(e.drafts) for e in entries],
                         num_output=[e.seq.num_output_tokens + e.seq.num_pending + len(e.drafts) for e in entries],
                         index=torch.tensor(positions, dtype=torch.long))


def applied(proc: LogitsProcessor, logits: torch.Tensor, entries: list[Row]) -> torch.Tensor:
    """``logits`` (one row per entry, in order) transformed by ``proc``, on a copy."""
    out = logits.clone()
    proc.apply(out, processor_rows(entries, list(range(len(entries)))))
    return out


def differing(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """The token ids where two rows differ (-inf equals -inf), the first few."""
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.nonzero(~same).flatten()[:6].tolist()


class LogitsConformance(ConformanceSuite):
    """The contract every logits processor honours, checked on the plugin named by ``plugin``
    (or ``plugin_class``), built with ``options``, for the requests in ``requests``:

    - ``apply`` changes the rows it is handed and no other, in place; a batch (several
      sequences with different arguments and histories, verification rows among them) gives
      each row what it gets alone; it writes no sequence;
    - state advanced by ``accept``, a few tokens a step, equals state ``add`` builds from the
      whole history (a preempted and recomputed sequence; a forked sample has its own);
    - a row following drafts equals a sequence holding them; afterwards the draft-free row is
      what it was (drafts leave no trace) and accepting some of them equals a fresh ``add``;
    - an overlap-safe processor, told of tokens on the device (``accept_on_device``), with
      steps overlapped or not, gives what the synchronous steps give;
    - ``remove`` forgets a sequence: one added after is what a fresh processor gives it;
    - a default ``SamplingParams`` does not use it, each of ``requests`` does, and one named
      with an argument it does not take is refused (``InvalidRequestError`` naming it);
    - a row that came with a finite logit keeps one; the same inputs give the same output;
      over random histories ``apply`` changes some logits for every request.

    ``requests`` lists ``SamplingParams`` keyword arguments, one request each, that turn the
    processor on: ``{"logits_processors": [{"name": "mine", "args": {"k": 2}}]}`` for one named
    by requests, ``{"presence_penalty": 0.7}`` for a built-in. Left None, a processor named by
    requests is tested with its default arguments, a built-in with ``FIELD_EXAMPLES`` for its
    ``fields``. The suite runs on the CPU; it sees a processor's results, not whether ``apply``
    waits for the device, which an overlap-safe processor must not (no ``.item()``,
    ``.tolist()`` or ``.cpu()`` of a device tensor).
    """

    kind = "logits"
    requests: ClassVar[list[dict[str, Any]] | None] = None

    # ------------------------------------------------------------------ helpers

    @classmethod
    def turning_on(cls) -> list[dict[str, Any]]:
        """The requests the properties use: ``requests``, or the defaults described above."""
        if cls.requests:
            return [dict(r) for r in cls.requests]
        plugin = cls.under_test()
        if not plugin.fields:
            return [{"logits_processors": [{"name": plugin.name}]}]
        missing = [f for f in plugin.fields if f not in FIELD_EXAMPLES]
        if missing:
            pytest.fail(f"{cls.label()} reads SamplingParams.{', '.join(missing)}, for which the suite has no "
                        f"example: set the class attribute requests (SamplingParams keyword arguments that turn "
                        f"it on)")
        return [FIELD_EXAMPLES[f] for f in plugin.fields]

    def subject(self, vocab_size: int, seed: int) -> Subject:
        """The processor built for ``vocab_size`` with its requests bound; a request that does
        not turn it on fails here, naming the request."""
        requests = self.turning_on()
        subject = Subject(self.under_test(), self.plugin_options(), requests, vocab_size, seed)
        for request, args in zip(requests, subject.args):
            assert args is not None, (f"{self.label()}: request_args returned None for {request}, one of the "
                                      f"suite's requests: they must turn the processor on")
        return subject

    def history(self, subject: Subject, request: int, prompt_len: int, output_len: int) -> Row:
        """A sequence of request ``request`` (modulo the number of requests) with a random prompt
        and output, added to the processor."""
        request %= len(subject.params)
        seq = subject.sequence(request, subject.tokens(prompt_len + output_len), prompt_len)
        subject.proc.add(seq, subject.args[request])
        return Row(seq, subject.args[request])

    def assert_rows_equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        assert not bool(got.isnan().any()), f"{self.label()}: apply produced NaN ({what})"
        assert torch.equal(got, want), f"{self.label()}: {what}; the rows differ at token ids {differing(got, want)}"

    def fresh_result(self, subject: Subject, row: Row, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [1, V] as a new processor transforms them for a new sequence of
        ``row``'s request holding ``tokens`` (built by ``add`` on the whole history)."""
        proc = subject.fresh()
        seq = Sequence(row.seq.request_id, tokens[:row.seq.num_prompt_tokens], row.seq.params)
        seq.token_ids = list(tokens)
        proc.add(seq, row.args)
        return applied(proc, logits, [Row(seq, row.args)])

    # ------------------------------------------------------------------ per request

    def test_a_default_request_does_not_use_it_and_each_request_does(self) -> None:
        self.case()
        plugin = self.under_test()
        proc = plugin(self.plugin_options(), processor_context(64))
        assert proc.request_args(SamplingParams()) is None, \
            f"{self.label()}: request_args(SamplingParams()) is not None: a request that asks for nothing uses it"
        self.subject(64, 0)  # each of the requests turns it on

    def test_arguments_it_does_not_take_are_refused(self) -> None:
        self.case()
        plugin = self.under_test()
        if plugin.fields:
            pytest.skip(f"{self.label()} is turned on by SamplingParams.{', '.join(plugin.fields)}, not by name")
        proc = plugin(self.plugin_options(), processor_context(64))
        params = SamplingParams(logits_processors=[{"name": plugin.name, "args": {"no_such_argument": 1}}])
        with pytest.raises(InvalidRequestError) as refused:
            proc.request_args(params)
        assert plugin.name in str(refused.value) and "no_such_argument" in str(refused.value), \
            f"{self.label()}: the refusal of an unknown argument names neither it nor the processor: {refused.value}"

    # ------------------------------------------------------------------ apply

    @given(vocab=VOCAB, seed=st.integers(0, 2**31 - 1), float64=st.booleans(),
           slots=st.lists(st.tuples(st.integers(0, 99), st.integers(1, 8), st.integers(0, 12), st.integers(0, 3)),
                          min_size=1, max_size=4),
           spare=st.integers(0, 3))
    @property_settings(max_examples=30)
    def test_a_batch_equals_each_row_alone(self, vocab: int, seed: int, float64: bool,
                                           slots: list[tuple[int, int, int, int]], spare: int) -> None:
        """Slots of (request, prompt length, output length, drafts): every verification row of
        each slot at a random row of one batch, ``spare`` rows no processor uses among them."""
        self.case()
        subject = self.subject(vocab, seed)
        entries = []
        for request, prompt_len, output_len, num_drafts in slots:
            row = self.history(subject, request, prompt_len, output_len)
            drafts = tuple(subject.tokens(num_drafts))
            entries += [Row(row.seq, row.args, drafts[:j]) for j in range(num_drafts + 1)]
        total = len(entries) + spare
        positions = torch.randperm(total, generator=subject.g)[:len(entries)].tolist()
        before = subject.logits(total, torch.float64 if float64 else torch.float32)
        logits = before.clone()
        held = [list(e.seq.token_ids) for e in entries]
        pointer = logits.data_ptr()
        subject.proc.apply(logits, processor_rows(entries, positions))
        assert logits.data_ptr() == pointer and logits.shape == before.shape and logits.dtype == before.dtype, \
            f"{self.label()}: apply replaced the logits tensor; it must transform it in place"
        assert [e.seq.token_ids for e in entries] == held, f"{self.label()}: apply changed a sequence's tokens"
        for other in sorted(set(range(total)) - set(positions)):
            assert torch.equal(logits[other], before[other]), \
                f"{self.label()}: apply changed row {other}, which it was not handed (rows {sorted(positions)})"
        for i, (entry, at) in enumerate(zip(entries, positions)):
            alone = applied(subject.proc, before[at:at + 1], [entry])
            self.assert_rows_equal(logits[at], alone[0], f"row {i} of a batch of {len(entries)} (drafts "
                                   f"{list(entry.drafts)}) is not what it is alone")

    @given(vocab=VOCAB, seed=st.integers(0, 2**31 - 1), float64=st.booleans(), request=st.integers(0, 99),
           prompt_len=st.integers(1, 8), output_len=st.integers(0, 12))
    @property_settings(max_examples=25)
    def test_the_same_inputs_give_the_same_output(self, vocab: int, seed: int, float64: bool, request: int,
                                                  prompt_len: int, output_len: int) -> None:
        """Twice on one instance, and on a second instance given the same sequence."""
        self.case()
        subject = self.subject(vocab, seed)
        row = self.history(subject, request, prompt_len, output_len)
        logits = subject.logits(1, torch.float64 if float64 else torch.float32)
        first = applied(subject.proc, logits, [row])
        self.assert_rows_equal(applied(subject.proc, logits, [row]), first, "a second apply on the same inputs differs")
        other = subject.fresh()
        other.add(row.seq, row.args)
        self.assert_rows_equal(applied(other, logits, [row]), first, "a second instance gives another output")

    @given(vocab=VOCAB, seed=st.integers(0, 2**31 - 1), request=st.integers(0, 99), prompt_len=st.integers(1, 8),
           output_len=st.integers(0, 12), finite=st.integers(1, 4))
    @property_settings(max_examples=30)
    def test_a_row_with_a_finite_logit_keeps_one(self, vocab: int, seed: int, request: int, prompt_len: int,
                                                 output_len: int, finite: int) -> None:
        """A row with every logit finite, and one with only ``finite`` of them (as an earlier
        processor's bans leave it): tokens this processor bans in the first row where it bans
        any (the hardest case), else tokens the history and the request name."""
        self.case()
        subject = self.subject(vocab, seed)
        row = self.history(subject, request, prompt_len, output_len)
        logits = subject.logits(2, torch.float32)
        banned = torch.nonzero(~applied(subject.proc, logits[:1], [row])[0].isfinite()).flatten()
        pool = banned if len(banned) else torch.tensor(subject.alphabet)
        keep = pool[torch.randperm(len(pool), generator=subject.g)[:finite]]
        sparse = torch.full((vocab,), float("-inf"))
        sparse[keep] = logits[1, keep]
        logits[1] = sparse
        out = applied(subject.proc, logits, [row, row])
        for i, what in enumerate(("every logit finite", f"finite logits only at {sorted(keep.tolist())}")):
            assert bool(out[i].isfinite().any()), \
                f"{self.label()}: a row with {what} came out with none finite; a processor must leave one"

    def test_apply_transforms_the_logits_it_is_handed(self) -> None:
        """For each request, over ``TRIES`` random histories some logit changes: a processor
        that builds a new tensor instead of writing into the one it is handed changes none."""
        tries = 24
        for request in range(len(self.turning_on())):
            changed = False
            for seed in range(tries):
                self.case()
                subject = self.subject(64 + seed, seed)
                row = self.history(subject, request, 1 + seed % 8, seed % 13)
                logits = subject.logits(1, torch.float32)
                if not torch.equal(applied(subject.proc, logits, [row]), logits):
                    changed = True
                    break
            assert changed, (f"{self.label()}: apply changed no logit of {tries} random histories for request "
                             f"{self.turning_on()[request]}: it must transform logits in place (logits[...] = ...)")

    # ------------------------------------------------------------------ state

    @given(vocab=VOCAB, seed=st.integers(0, 2**31 - 1), request=st.integers(0, 99), prompt_len=st.integers(1, 8),
           output_len=st.integers(0, 8), steps=st.lists(st.integers(1, 3), min_size=1, max_size=6),
           fork_at=st.integers(0, 6))
    @property_settings(max_examples=30)
    def test_accepting_step_by_step_equals_adding_the_whole_history(self, vocab: int, seed: int, request: int,
                                                                    prompt_len: int, output_len: int,
                                                                    steps: list[int], fork_at: int) -> None:
        """Each step appends 1-3 tokens (accepted drafts and a bonus token) and tells
        ``accept``; at ``fork_at`` the sequence forks a sample (``add`` with the parent's
        tokens), which goes on with tokens of its own, both told in one ``accept``."""
        self.case()
        subject = self.subject(vocab, seed)
        live = [self.history(subject, request, prompt_len, output_len)]
        for step, count in enumerate(steps):
            if step == fork_at:
                child = live[0].seq.fork(1)
                subject.proc.add(child, live[0].args)
                live.append(Row(child, live[0].args))
            updates = []
            for row in live:
                tokens = subject.tokens(count)
                row.seq.token_ids.extend(tokens)
                updates.append((row.seq, tokens))
            subject.proc.accept(updates)
            logits = subject.logits(len(live), torch.float32)
            batch = applied(subject.proc, logits, live)
            for i, row in enumerate(live):
                fresh = self.fresh_result(subject, row, row.seq.token_ids, logits[i:i + 1])
                self.assert_rows_equal(batch[i], fresh[0], f"after {step + 1} accepted steps, "
                                       f"{'the forked sample' if i else 'the sequence'} is not what add() on its "
                                       f"whole history gives")

    @given(vocab=VOCAB, seed=st.integers(0, 2**31 - 1), request=st.integers(0, 99), prompt_len=st.integers(1, 8),
           output_len=st.integers(0, 10), num_drafts=st.integers(1, 4), num_accepted=st.integers(0, 4))
    @property_settings(max_examples=30)
    def test_drafts_leave_no_trace(self, vocab: int, seed: int, request: int, prompt_len: int, output_len: int,
                                   num_drafts: int, num_accepted: int) -> None:
        """Verification rows 0..k follow drafts[:j]; then ``num_accepted`` drafts and a bonus
        token are accepted, as a speculative step does."""
        self.case()
        subject = self.subject(vocab, seed)
        row = self.history(subject, request, prompt_len, output_len)
        history = list(row.seq.token_ids)
        base = subject.logits(num_drafts + 1, torch.float32)
        before = applied(subject.proc, base[:1], [row])
        drafts = tuple(subject.tokens(num_drafts))
        verified = applied(subject.proc, base, [Row(row.seq, row.args, drafts[:j]) for j in range(num_drafts + 1)])
        for j in range(num_drafts + 1):
            fresh = self.fresh_result(subject, row, history + list(drafts[:j]), base[j:j + 1])
            self.assert_rows_equal(verified[j], fresh[0], f"the verification row following drafts {list(drafts[:j])} "
                                   f"is not a sequence holding them")
        self.assert_rows_equal(applied(subject.proc, base[:1], [row])[0], before[0],
                               "the draft-free row changed after rows with drafts were applied")
        kept = list(drafts[:min(num_accepted, num_drafts)]) + [subject.pick(verified[min(num_accepted, num_drafts)])]
        row.seq.token_ids.extend(kept)
        subject.proc.accept([(row.seq, kept)])
        after = applied(subject.proc, base[:1], [row])
        self.assert_rows_equal(after[0], self.fresh_result(subject, row, row.seq.token_ids, base[:1])[0],
                               f"after accepting {kept} of drafts {list(drafts)}, the sequence is not what add() on "
                               f"its history gives")

    @given(vocab=VOCAB, seed=st.integers(0, 2**31 - 1), requests=st.tuples(st.integers(0, 99), st.integers(0, 99)),
           prompt_len=st.integers(1, 8), output_len=st.integers(0, 10), steps=st.integers(0, 3))
    @property_settings(max_examples=25)
    def test_remove_forgets_a_sequence(self, vocab: int, seed: int, requests: tuple[int, int], prompt_len: int,
                                       output_len: int, steps: int) -> None:
        """A sequence added, advanced and removed; then a new one with the same tokens (another
        request's, perhaps) is what a fresh processor gives it."""
        self.case()
        subject = self.subject(vocab, seed)
        gone = self.history(subject, requests[0], prompt_len, output_len)
        for _ in range(steps):
            tokens = subject.tokens(1)
            gone.seq.token_ids.extend(tokens)
            subject.proc.accept([(gone.seq, tokens)])
        subject.proc.remove(gone.seq)
        request = requests[1] % len(subject.params)
        seq = subject.sequence(request, gone.seq.token_ids, prompt_len)
        row = Row(seq, subject.args[request])
        subject.proc.add(seq, row.args)
        logits = subject.logits(1, torch.float32)
        self.assert_rows_equal(applied(subject.proc, logits, [row])[0],
                               self.fresh_result(subject, row, seq.token_ids, logits)[0],
                               "a sequence added after another was removed is not what a fresh processor gives it")

    @given(vocab=VOCAB, seed=st.integers(0, 2**31 - 1), request=st.integers(0, 99), prompt_len=st.integers(1, 8),
           output_len=st.integers(0, 8), overlapped=st.lists(st.booleans(), min_size=1, max_size=8))
    @property_settings(max_examples=30)
    def test_overlapped_steps_equal_synchronous_ones(self, vocab: int, seed: int, request: int, prompt_len: int,
                                                     output_len: int, overlapped: list[bool]) -> None:
        """A walk of steps, each overlapped or not as ``overlapped`` says. An overlapped step
        applies while the previous step's token is still on the device (counted in
        ``num_output``, absent from ``token_ids``), reports its own token through
        ``accept_on_device``, and then the previous token reaches the host (no ``accept``);
        a synchronous step first lets the pending token land, then reports through
        ``accept``. Every step's row equals a fresh ``add`` on the whole history."""
        self.case()
        if not self.under_test().overlap_safe:
            pytest.skip(f"{self.label()} is not overlap_safe: its requests run in the synchronous step")
        subject = self.subject(vocab, seed)
        row = self.history(subject, request, prompt_len, output_len)
        seq, history, pending = row.seq, list(row.seq.token_ids), None
        for step, ahead in enumerate(overlapped + [False]):
            if not ahead and pending is not None:  # the engine collects the step in flight first
                seq.token_ids.append(pending)
                seq.num_pending, pending = seq.num_pending - 1, None
            logits = subject.logits(1, torch.float32)
            got = applied(subject.proc, logits, [row])
            self.assert_rows_equal(got[0], self.fresh_result(subject, row, history, logits)[0],
                                   f"step {step} ({'overlapped' if ahead else 'synchronous'}, steps so far "
                                   f"{overlapped[:step]}) is not what add() on the whole history gives")
            token = subject.pick(got[0])
            history.append(token)
            if ahead:
                subject.proc.accept_on_device([seq], torch.tensor([token], dtype=torch.long))
                seq.num_pending += 1
                if pending is not None:  # the previous step's token reaches the host
                    seq.token_ids.append(pending)
                    seq.num_pending -= 1
                pending = token
            else:
                seq.token_ids.append(token)
                subject.proc.accept([(seq, [token])])
