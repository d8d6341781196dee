"""``min_tokens`` and ``logit_bias`` equal transformers' MinNewTokensLengthLogitsProcessor and
SequenceBiasLogitsProcessor (one-token sequences) on random logits and histories, verification
rows counting their drafts; a batch equals each row alone; each is unused at its default."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor

from tessellm.core.interfaces.logits import ProcessorRows
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.plugins.logits.bias import LogitBias
from tessellm.plugins.logits.stop_bar import MinTokens
from tessellm.testing.logits import added_rows, processor_context

EOS = frozenset({0, 2})








def random_logits(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2 * num_rows + 1, vocab), generator=gen) * 4


@st.composite
def cases(draw, request):
    """(vocab, [(prompt, output, drafts, params)], seed), params drawn by ``request(vocab)``."""
    vocab = draw(st.integers(50, 300))
    token = st.integers(0, vocab - 1)
    seqs = [(draw(st.lists(token, min_size=1, max_size=20)), draw(st.lists(token, max_size=20)),
             tuple(draw(st.lists(token, max_size=3))), draw(request(vocab)))
            for _ in range(draw(st.integers(1, 4)))]
    return vocab, seqs, draw(st.integers(0, 2**31 - 1))


def build(cls, vocab: int, seqs):
    proc = cls(cls.Options(), processor_context(vocab, eos=EOS))
    return proc, added_rows(proc, seqs)


def applied(proc, logits: torch.Tensor, rows: ProcessorRows) -> torch.Tensor:
    out = logits.clone()
    proc.apply(out, rows)
    torch.testing.assert_close(out[0::2], logits[0::2], rtol=0, atol=0)  # rows it was not given
    return out


def batch_equals_each_row_alone(proc, logits: torch.Tensor, rows: ProcessorRows) -> None:
    batched = applied(proc, logits, rows)
    for i, row in enumerate(rows.rows):
        alone = applied(proc, logits, ProcessorRows([row], [rows.seqs[i]], [rows.args[i]], [rows.drafts[i]],
                                                    [rows.num_output[i]], index=torch.tensor([row])))
        torch.testing.assert_close(batched[row], alone[row], rtol=0, atol=0)


def min_tokens_request(vocab: int):
    return st.fixed_dictionaries({"min_tokens": st.integers(1, 25), "max_tokens": st.just(30),
                                  "stop_token_ids": st.lists(st.integers(0, vocab - 1), max_size=3),
                                  "ignore_eos": st.booleans()})


@settings(max_examples=40)
@given(cases(min_tokens_request))
def test_min_tokens_equals_transformers(case):
    vocab, seqs, seed = case
    proc, rows = build(MinTokens, vocab, seqs)
    logits = random_logits(len(rows), vocab, seed)
    out = applied(proc, logits, rows)
    for i, row in enumerate(rows.rows):
        seq, params = rows.seqs[i], rows.seqs[i].params
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(EOS))
        if not stops:  # nothing to bar
            torch.testing.assert_close(out[row], logits[row], rtol=0, atol=0)
            continue
        reference = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=seq.num_prompt_tokens,
                                                      min_new_tokens=params.min_tokens, eos_token_id=sorted(stops))
        expected = reference(torch.tensor([rows.history(i)]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row:row + 1], expected, rtol=0, atol=0)
    batch_equals_each_row_alone(proc, logits, rows)


def bias_request(vocab: int):
    return st.fixed_dictionaries({"logit_bias": st.dictionaries(
        st.integers(0, vocab - 1), st.floats(-100.0, 100.0, allow_nan=False), min_size=1, max_size=6)})


@settings(max_examples=40)
@given(cases(bias_request))
def test_logit_bias_equals_transformers_sequence_bias(case):
    vocab, seqs, seed = case
    proc, rows = build(LogitBias, vocab, seqs)
    logits = random_logits(len(rows), vocab, seed)
    out = applied(proc, logits, rows)
    for i, row in enumerate(rows.rows):
        bias = [[[token], float(value)] for token, value in rows.seqs[i].params.logit_bias.items()]
        reference = SequenceBiasLogitsProcessor(sequence_bias=bias)
        expected = reference(torch.tensor([rows.history(i)]), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row:row + 1], expected, rtol=0, atol=0)
    batch_equals_each_row_alone(proc, logits, rows)


def test_unused_at_the_default():
    for cls in (MinTokens, LogitBias):
        proc = cls(cls.Options(), processor_context(50))
        assert proc.request_args(SamplingParams()) is None
        assert cls.overlap_safe
