"""``repetition_penalty`` and ``presence_frequency``: each equals its reference on random logits
and histories (transformers' RepetitionPenaltyLogitsProcessor; OpenAI's formula in float64),
verification rows see their drafts, a batch equals each row alone, the state built one token
at a time (host or device) equals the state built at once, drafts leave no trace, and the
device history reuses its slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from tessellm.core.interfaces.logits import ProcessorRows
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.plugins.logits.history import TokenHistory
from tessellm.plugins.logits.penalties import PresenceFrequencyPenalty, RepetitionPenalty
from tessellm.testing.logits import CPU, added_rows, processor_context, sequence









def random_logits(num_rows: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((2 * num_rows + 1, vocab), generator=gen, dtype=torch.float64) * 4
    return logits.to(dtype)


@st.composite
def histories(draw, max_seqs: int = 4):
    """(vocab, [(prompt, output, drafts)], seed): tokens often from a small alphabet, so they repeat."""
    vocab = draw(st.integers(50, 300))
    alphabet = draw(st.sampled_from([6, vocab]))
    token = st.integers(0, alphabet - 1)
    seqs = [(draw(st.lists(token, min_size=1, max_size=20)), draw(st.lists(token, max_size=20)),
             tuple(draw(st.lists(token, max_size=3)))) for _ in range(draw(st.integers(1, max_seqs)))]
    return vocab, seqs, draw(st.integers(0, 2**31 - 1))


def build(cls, vocab: int, seqs, params: list[dict]):
    """A processor with each sequence added under the args its params give; its rows."""
    proc = cls(cls.Options(), processor_context(vocab))
    return proc, added_rows(proc, [(*seq, p) for seq, p in zip(seqs, params)])


def untouched_rows_equal(out: torch.Tensor, logits: torch.Tensor) -> None:
    torch.testing.assert_close(out[0::2], logits[0::2], rtol=0, atol=0)


penalty = st.floats(0.1, 10.0).filter(lambda p: p != 1.0)
presence_frequency = st.tuples(st.floats(-2.0, 2.0), st.floats(-2.0, 2.0)).filter(lambda pf: pf != (0.0, 0.0))


# ---------------------------------------------------------------------- against the references


@settings(max_examples=40)
@given(histories(), st.data())
def test_repetition_penalty_equals_transformers(case, data):
    vocab, seqs, seed = case
    params = [{"repetition_penalty": data.draw(penalty)} for _ in seqs]
    proc, rows = build(RepetitionPenalty, vocab, seqs, params)
    logits = random_logits(len(rows), vocab, seed)
    out = logits.clone()
    proc.apply(out, rows)
    for i, row in enumerate(rows.rows):
        reference = RepetitionPenaltyLogitsProcessor(penalty=rows.args[i].penalty)
        expected = reference(torch.tensor([rows.history(i)]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row:row + 1], expected)
    untouched_rows_equal(out, logits)


def presence_frequency_reference(logits: torch.Tensor, output: list[int], presence: float,
                                 frequency: float) -> torch.Tensor:
    """OpenAI's definition in float64: logit[t] -= frequency * count[t] + presence * (count[t] > 0)."""
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for token in output:
        counts[token] += 1
    return logits.double() - (frequency * counts + presence * (counts > 0).double())


@settings(max_examples=40)
@given(histories(), st.sampled_from([torch.float32, torch.float64]), st.data())
def test_presence_frequency_equals_openai_definition(case, dtype, data):
    vocab, seqs, seed = case
    params = [dict(zip(("presence_penalty", "frequency_penalty"), data.draw(presence_frequency))) for _ in seqs]
    proc, rows = build(PresenceFrequencyPenalty, vocab, seqs, params)
    logits = random_logits(len(rows), vocab, seed, dtype)
    out = logits.clone()
    proc.apply(out, rows)
    for i, row in enumerate(rows.rows):
        output = rows.seqs[i].output_token_ids + list(rows.drafts[i])  # the prompt does not count
        args = rows.args[i]
        expected = presence_frequency_reference(logits[row], output, args.presence_penalty, args.frequency_penalty)
        torch.testing.assert_close(out[row].double(), expected, rtol=0, atol=1e-5)
    untouched_rows_equal(out, logits)


# ---------------------------------------------------------------------- batching and state


PROCESSORS = [(RepetitionPenalty, {"repetition_penalty": 1.7}),
              (PresenceFrequencyPenalty, {"presence_penalty": 0.6, "frequency_penalty": -0.9})]


@pytest.mark.parametrize("cls, params", PROCESSORS)
@settings(max_examples=25)
@given(case=histories())
def test_batch_equals_each_row_alone(cls, params, case):
    vocab, seqs, seed = case
    proc, rows = build(cls, vocab, seqs, [params] * len(seqs))
    logits = random_logits(len(rows), vocab, seed)
    batched = logits.clone()
    proc.apply(batched, rows)
    for i, row in enumerate(rows.rows):
        alone = logits.clone()
        proc.apply(alone, ProcessorRows([row], [rows.seqs[i]], [rows.args[i]], [rows.drafts[i]],
                                        [rows.num_output[i]], index=torch.tensor([row])))
        torch.testing.assert_close(batched[row], alone[row], rtol=0, atol=0)


@pytest.mark.parametrize("cls, params", PROCESSORS)
@pytest.mark.parametrize("on_device", [False, True])
@settings(max_examples=20)
@given(case=histories(max_seqs=3))
def test_tokens_one_at_a_time_equal_add_at_once(cls, params, on_device, case):
    """Accepting each output token after the prompt (host tokens, or device tokens before they
    reach the host, as the overlapped step does) gives what ``add`` on the whole history gives."""
    vocab, seqs, seed = case
    at_once, rows = build(cls, vocab, seqs, [params] * len(seqs))
    stepped = cls(cls.Options(), processor_context(vocab))
    growing = [sequence(prompt, [], **params) for prompt, _, _ in seqs]
    for seq in growing:
        stepped.add(seq, stepped.request_args(seq.params))
    for step in range(max(len(output) for _, output, _ in seqs)):
        live = [(seq, output[step]) for seq, (_, output, _) in zip(growing, seqs) if step < len(output)]
        if on_device:  # the step's tokens are told before they reach token_ids
            stepped.accept_on_device([seq for seq, _ in live], torch.tensor([t for _, t in live]))
            for seq, token in live:
                seq.token_ids.append(token)
        else:
            for seq, token in live:
                seq.token_ids.append(token)
            stepped.accept([(seq, [token]) for seq, token in live])
    same = dict(zip(dict.fromkeys(rows.seqs), growing))  # each added sequence -> its growing twin
    stepped_rows = ProcessorRows(rows.rows, [same[s] for s in rows.seqs], rows.args, rows.drafts, rows.num_output,
                                 rows.index)
    logits = random_logits(len(rows), vocab, seed)
    expected, out = logits.clone(), logits.clone()
    at_once.apply(expected, rows)
    stepped.apply(out, stepped_rows)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("cls, params", PROCESSORS)
def test_device_tokens_count_before_they_reach_the_host(cls, params):
    """In an overlapped step the last token is on the device only: the row still sees it."""
    proc = cls(cls.Options(), processor_context(50))
    seq = sequence([3, 4], [5], **params)
    proc.add(seq, proc.request_args(seq.params))
    proc.accept_on_device([seq], torch.tensor([5]))  # token_ids does not hold it yet
    known = sequence([3, 4], [5, 5], **params)
    reference = cls(cls.Options(), processor_context(50))
    reference.add(known, reference.request_args(known.params))
    logits = random_logits(1, 50, 7)
    out, expected = logits.clone(), logits.clone()
    args = proc.request_args(seq.params)
    proc.apply(out, ProcessorRows([1], [seq], [args], [()], [2], index=torch.tensor([1])))
    reference.apply(expected, ProcessorRows([1], [known], [args], [()], [2], index=torch.tensor([1])))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("cls, params", PROCESSORS)
@settings(max_examples=20)
@given(case=histories())
def test_drafts_leave_no_trace(cls, params, case):
    vocab, seqs, seed = case
    proc, rows = build(cls, vocab, seqs, [params] * len(seqs))
    plain = ProcessorRows(rows.rows, rows.seqs, rows.args, [()] * len(rows), rows.num_output, rows.index)
    logits = random_logits(len(rows), vocab, seed)
    before = logits.clone()
    proc.apply(before, plain)
    proc.apply(logits.clone(), rows)  # with drafts
    after = logits.clone()
    proc.apply(after, plain)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("cls, params", PROCESSORS)
def test_unused_at_the_default(cls, params):
    proc = cls(cls.Options(), processor_context(50))
    assert proc.request_args(SamplingParams()) is None
    assert proc.request_args(SamplingParams(**params)) is not None
    assert cls.overlap_safe


@pytest.mark.parametrize("cls, params", PROCESSORS)
def test_row_without_tokens_is_unchanged(cls, params):
    """A row holding no token the processor counts (no output for presence and frequency, an
    empty prompt for the repetition penalty) keeps its logits beside rows that change."""
    proc = cls(cls.Options(), processor_context(20))
    empty = sequence([] if cls is RepetitionPenalty else [1, 2, 3], [], **params)
    full = sequence([1], [0, 0, 4], **params)
    args = proc.request_args(empty.params)
    for seq in (empty, full):
        proc.add(seq, args)
    logits = random_logits(2, 20, 3)
    out = logits.clone()
    proc.apply(out, ProcessorRows([1, 3], [empty, full], [args, args], [(), ()], [0, 3], index=torch.tensor([1, 3])))
    torch.testing.assert_close(out[1], logits[1], rtol=0, atol=0)
    assert (out[3] != logits[3]).sum() == (3 if cls is RepetitionPenalty else 2)  # tokens 0, 4 (and 1)


# ---------------------------------------------------------------------- the device history


def test_history_reuses_slots_and_grows_only_with_what_it_holds():
    history = TokenHistory(CPU, slots=2, capacity=4)
    for cycle in range(50):
        seqs = [sequence(list(range(1, 2 + cycle % 5)), [7] * (cycle % 3)) for _ in range(2)]
        for seq in seqs:
            history.add(seq)
        history.extend([(seqs[0], [9, 9])])
        for seq in seqs:
            history.remove(seq)
    assert history.tokens.shape[0] == 2  # never more than two held at once
    assert history.tokens.shape[1] == 16  # the longest held: 5 prompt + 2 output + 2 new = 9, doubled to 16
    assert not history.slot and sorted(history.free) == [0, 1]


def test_history_window_pads_with_a_token_of_the_row():
    history = TokenHistory(CPU, slots=1, capacity=2)  # grows while adding
    a, b, c = sequence([5, 7], []), sequence([1, 2, 3], [4]), sequence([8], [])
    for seq in (a, b, c):
        history.add(seq)
    history.extend_on_device([b], torch.tensor([6]))
    rows = ProcessorRows([0, 1, 2], [a, b, c], [None] * 3, [(9,), (), ()], [1, 2, 0], index=torch.arange(3))
    held = history.window(rows, outputs_only=False)
    # padding repeats the row's last held token (its last draft in the drafts' columns)
    assert held.ids.tolist() == [[5, 7, 7, 7, 7, 9], [1, 2, 3, 4, 6, 6], [8, 8, 8, 8, 8, 8]]
    assert held.valid.tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert held.nonempty is None
    # outputs only: a has only its draft, c nothing at all (its prompt ends where the tensor does)
    outputs = history.window(rows, outputs_only=True)
    assert outputs.ids.tolist() == [[9, 9, 9], [4, 6, 6], [0, 0, 0]]
    assert outputs.valid.tolist() == [[0, 0, 1], [1, 1, 0], [0, 0, 0]]
    assert outputs.nonempty.flatten().tolist() == [True, True, False]
    drafts = ProcessorRows([0, 1], [a, c], [None] * 2, [(9, 3), (2,)], [2, 1], index=torch.arange(2))
    assert history.window(drafts, outputs_only=True).ids.tolist() == [[9, 3], [2, 2]]
    assert history.window(ProcessorRows([0], [c], [None], [()], [0], index=torch.arange(1)), True) is None
