"""``bad_words``, ``allowed_token_ids`` and ``no_repeat_ngram``: each equals its reference on
random logits and histories (transformers' NoBadWordsLogitsProcessor and
NoRepeatNGramLogitsProcessor; a plain-torch mask for the allowed ids), verification rows see
their drafts, a batch equals each row alone, the n-grams built one token at a time equal those
built at once, drafts leave no trace, and bad arguments are refused naming what is wrong."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.logits import ProcessorRows
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.plugins.logits.bans import AllowedTokenIds, BadWords, NoRepeatNGram
from tessellm.testing.logits import added_rows, processor_context, sequence, verification_rows



def encode(text: str) -> list[int]:
    """A toy tokenizer: a space joins the letter after it (" a" is one token), other letters
    are a token each."""
    ids, i = [], 0
    while i < len(text):
        if text[i] == " " and i + 1 < len(text) and text[i + 1] != " ":
            ids.append(100 + ord(text[i + 1]) % 50)
            i += 2
        else:
            ids.append(ord(text[i]) % 50)
            i += 1
    return ids








def random_logits(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2 * num_rows + 1, vocab), generator=gen) * 4


@st.composite
def histories(draw, max_seqs: int = 4):
    """(vocab, alphabet, [(prompt, output, drafts)], seed): tokens often from a small alphabet,
    so n-grams and bad words recur."""
    vocab = draw(st.integers(50, 300))
    alphabet = draw(st.sampled_from([4, vocab]))
    token = st.integers(0, alphabet - 1)
    seqs = [(draw(st.lists(token, min_size=1, max_size=20)), draw(st.lists(token, max_size=20)),
             tuple(draw(st.lists(token, max_size=3)))) for _ in range(draw(st.integers(1, max_seqs)))]
    return vocab, alphabet, seqs, draw(st.integers(0, 2**31 - 1))


def build(cls, vocab: int, seqs, params: list[dict]):
    """A processor with each sequence added under the args its params give; its rows."""
    proc = cls(cls.Options(), processor_context(vocab, encode))
    return proc, added_rows(proc, [(*seq, p) for seq, p in zip(seqs, params)])


def applied(proc, logits: torch.Tensor, rows: ProcessorRows) -> torch.Tensor:
    out = logits.clone()
    proc.apply(out, rows)
    torch.testing.assert_close(out[0::2], logits[0::2], rtol=0, atol=0)  # rows it was not given
    return out


def one_row(rows: ProcessorRows, i: int) -> ProcessorRows:
    return ProcessorRows([rows.rows[i]], [rows.seqs[i]], [rows.args[i]], [rows.drafts[i]], [rows.num_output[i]],
                         index=torch.tensor([rows.rows[i]]))


def word_lists(alphabet: int):
    return st.lists(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=3), min_size=1, max_size=4)


# ---------------------------------------------------------------------- against the references


@settings(max_examples=40)
@given(histories(), st.data())
def test_bad_words_ids_equal_transformers(case, data):
    vocab, alphabet, seqs, seed = case
    params = [{"bad_words_ids": data.draw(word_lists(alphabet))} for _ in seqs]
    proc, rows = build(BadWords, vocab, seqs, params)
    logits = random_logits(len(rows), vocab, seed)
    out = applied(proc, logits, rows)
    for i, row in enumerate(rows.rows):
        reference = NoBadWordsLogitsProcessor(rows.seqs[i].params.bad_words_ids, eos_token_id=None)
        expected = reference(torch.tensor([rows.history(i)]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row:row + 1], expected, rtol=0, atol=0)


@settings(max_examples=40)
@given(histories(), st.data())
def test_no_repeat_ngram_equals_transformers(case, data):
    vocab, _, seqs, seed = case
    params = [{"no_repeat_ngram_size": data.draw(st.integers(1, 4))} for _ in seqs]
    proc, rows = build(NoRepeatNGram, vocab, seqs, params)
    logits = random_logits(len(rows), vocab, seed)
    out = applied(proc, logits, rows)
    for i, row in enumerate(rows.rows):
        reference = NoRepeatNGramLogitsProcessor(rows.args[i].size)
        expected = reference(torch.tensor([rows.history(i)]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row:row + 1], expected, rtol=0, atol=0)


@settings(max_examples=30)
@given(histories(), st.data())
def test_allowed_token_ids_keep_only_those(case, data):
    vocab, _, seqs, seed = case
    params = [{"allowed_token_ids": data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))}
              for _ in seqs]
    proc, rows = build(AllowedTokenIds, vocab, seqs, params)
    logits = random_logits(len(rows), vocab, seed)
    out = applied(proc, logits, rows)
    for i, row in enumerate(rows.rows):
        expected = torch.full((vocab,), float("-inf"))
        allowed = rows.seqs[i].params.allowed_token_ids
        expected[allowed] = logits[row, allowed]
        torch.testing.assert_close(out[row], expected, rtol=0, atol=0)


# ---------------------------------------------------------------------- batching and state


def params_for(cls, alphabet: int, data) -> dict:
    if cls is BadWords:
        return {"bad_words_ids": data.draw(word_lists(alphabet))}
    if cls is AllowedTokenIds:
        return {"allowed_token_ids": data.draw(st.lists(st.integers(0, 49), min_size=1, max_size=8))}
    return {"no_repeat_ngram_size": data.draw(st.integers(1, 4))}


@pytest.mark.parametrize("cls", [BadWords, AllowedTokenIds, NoRepeatNGram])
@settings(max_examples=20)
@given(case=histories(), data=st.data())
def test_batch_equals_each_row_alone(cls, case, data):
    vocab, alphabet, seqs, seed = case
    proc, rows = build(cls, vocab, seqs, [params_for(cls, alphabet, data) for _ in seqs])
    logits = random_logits(len(rows), vocab, seed)
    batched = applied(proc, logits, rows)
    for i, row in enumerate(rows.rows):
        torch.testing.assert_close(batched[row], applied(proc, logits, one_row(rows, i))[row], rtol=0, atol=0)


@settings(max_examples=25)
@given(case=histories(max_seqs=3), size=st.integers(1, 4))
def test_ngrams_one_token_at_a_time_equal_add_at_once(case, size):
    vocab, _, seqs, seed = case
    params = {"no_repeat_ngram_size": size}
    at_once, rows = build(NoRepeatNGram, vocab, seqs, [params] * len(seqs))
    stepped = NoRepeatNGram(NoRepeatNGram.Options(), processor_context(vocab, encode))
    growing = [sequence(prompt, [], **params) for prompt, _, _ in seqs]
    for seq in growing:
        stepped.add(seq, stepped.request_args(seq.params))
    for step in range(max(len(output) for _, output, _ in seqs)):
        live = [(seq, output[step]) for seq, (_, output, _) in zip(growing, seqs) if step < len(output)]
        for seq, token in live:
            seq.token_ids.append(token)
        stepped.accept([(seq, [token]) for seq, token in live])
    same = dict(zip(dict.fromkeys(rows.seqs), growing))
    for seq, twin in same.items():
        assert stepped.ngrams[twin.seq_id].following == at_once.ngrams[seq.seq_id].following
        assert stepped.ngrams[twin.seq_id].tail == at_once.ngrams[seq.seq_id].tail


@settings(max_examples=20)
@given(case=histories(), size=st.integers(1, 4))
def test_drafts_leave_no_trace(case, size):
    vocab, _, seqs, seed = case
    proc, rows = build(NoRepeatNGram, vocab, seqs, [{"no_repeat_ngram_size": size}] * len(seqs))
    before = {sid: ({k: set(v) for k, v in s.following.items()}, list(s.tail)) for sid, s in proc.ngrams.items()}
    applied(proc, random_logits(len(rows), vocab, seed), rows)
    assert {sid: (s.following, s.tail) for sid, s in proc.ngrams.items()} == before


def test_remove_forgets_each_sequence():
    ngram, allowed = NoRepeatNGram(NoRepeatNGram.Options(), processor_context(50, encode)), AllowedTokenIds(
        AllowedTokenIds.Options(), processor_context(50, encode))
    for _ in range(20):
        seq = sequence([1, 2, 3], [4], no_repeat_ngram_size=2, allowed_token_ids=[3, 4])
        for proc in (ngram, allowed):
            proc.add(seq, proc.request_args(seq.params))
        for proc in (ngram, allowed):
            proc.remove(seq)
    assert not ngram.ngrams and not allowed.on_device


def test_unused_at_the_default():
    for cls in (BadWords, AllowedTokenIds, NoRepeatNGram):
        assert cls(cls.Options(), processor_context(50, encode)).request_args(SamplingParams()) is None
    assert AllowedTokenIds.overlap_safe and not BadWords.overlap_safe and not NoRepeatNGram.overlap_safe


# ---------------------------------------------------------------------- bad words as text


def test_bad_words_tokenized_as_given_and_after_a_space():
    proc = BadWords(BadWords.Options(), processor_context(200, encode))
    args = proc.request_args(SamplingParams(bad_words=["a", "bc"]))
    a, b, c = (ord(x) % 50 for x in "abc")
    assert args.banned == (a, 100 + a)  # "a" and " a" are one token each: always banned
    assert args.sequences == ((b, c), (100 + b, c))  # c is banned after b, and after " b"
    # repeats and a word already spaced give each token sequence once
    assert proc.request_args(SamplingParams(bad_words=[" bc", "bc", " bc"])).sequences == ((100 + b, c), (b, c))
    both = proc.request_args(SamplingParams(bad_words=["bc"], bad_words_ids=[[b, c], [7]]))
    assert both.sequences == ((b, c), (100 + b, c)) and both.banned == (7,)


def test_bad_word_completed_across_the_output_and_drafts():
    proc = BadWords(BadWords.Options(), processor_context(200, encode))
    b, c = ord("b") % 50, ord("c") % 50
    seq = sequence([5, 6], [7], bad_words=["bc"])
    args = proc.request_args(seq.params)
    rows = verification_rows([(seq, args, (b, 9))])  # row 1 follows the draft b: c is banned there only
    out = applied(proc, random_logits(3, 200, 0), rows)
    assert torch.isinf(out[rows.rows[1], c]) and torch.isfinite(out[rows.rows[0], c]) and torch.isfinite(
        out[rows.rows[2], c])


@pytest.mark.parametrize("params, message", [
    ({"bad_words": ["  "]}, "no word in it"),
    ({"bad_words": ["", "ok"]}, "no word in it"),
    ({"bad_words_ids": [[3, 50]]}, "token id 50, outside the vocabulary [0, 50)"),
    ({"bad_words": ["\u00ff"]}, "outside the model's vocabulary"),  # the toy tokenizer's 100+ ids
])
def test_bad_words_refused(params, message):
    proc = BadWords(BadWords.Options(), processor_context(50, encode))
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace(")", r"\)")):
        proc.request_args(SamplingParams(**params))


def test_allowed_token_ids_outside_the_vocabulary_refused():
    proc = AllowedTokenIds(AllowedTokenIds.Options(), processor_context(50, encode))
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids holds token id 50, outside the vocabulary"):
        proc.request_args(SamplingParams(allowed_token_ids=[1, 50]))
    assert proc.request_args(SamplingParams(allowed_token_ids=[3, 1, 3])).token_ids == (1, 3)


# ---------------------------------------------------------------------- a finite logit stays


def test_a_ban_that_would_empty_a_row_leaves_it_as_it_came():
    """Row 1's only finite logits are its bad words: it keeps them; row 3 loses its bad words."""
    proc = BadWords(BadWords.Options(), processor_context(50, encode))
    seq = sequence([5], [6], bad_words_ids=[[3], [4]])
    args = proc.request_args(seq.params)
    logits = random_logits(2, 50, 1)
    logits[1] = float("-inf")
    logits[1, [3, 4]] = torch.tensor([0.5, -1.0])
    rows = ProcessorRows([1, 3], [seq, seq], [args, args], [(), ()], [1, 1], index=torch.tensor([1, 3]))
    out = applied(proc, logits, rows)
    torch.testing.assert_close(out[1], logits[1], rtol=0, atol=0)
    assert torch.isinf(out[3, [3, 4]]).all() and torch.isfinite(out[3]).sum() == 48


def test_allowed_tokens_none_finite_leave_the_row_as_it_came():
    proc = AllowedTokenIds(AllowedTokenIds.Options(), processor_context(50, encode))
    seq = sequence([5], [], allowed_token_ids=[3, 4])
    args = proc.request_args(seq.params)
    proc.add(seq, args)
    logits = random_logits(2, 50, 2)
    logits[1, [3, 4]] = float("-inf")  # as an earlier processor's bans leave it
    rows = ProcessorRows([1, 3], [seq, seq], [args, args], [(), ()], [0, 0], index=torch.tensor([1, 3]))
    out = applied(proc, logits, rows)
    torch.testing.assert_close(out[1], logits[1], rtol=0, atol=0)
    assert torch.isfinite(out[3]).nonzero().flatten().tolist() == [3, 4]
