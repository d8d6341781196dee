"""The stop rule (core/engine/outputs.py): every stop condition in one place, min_tokens
included, and the same lengths for tokens on the host and tokens still on the device."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tessellm import LLM
from tessellm.core.engine.outputs import StopRule
from tessellm.core.interfaces.sequence import FinishReason, SamplingParams, Sequence

EOS = 2


def seq_with(prompt: int, output: list[int], **params) -> Sequence:
    seq = Sequence("r", list(range(10, 10 + prompt)), SamplingParams(**params))
    seq.token_ids += output
    return seq


def test_eos_and_stop_ids_stop_unless_ignored():
    rule = StopRule({EOS}, 100)
    assert rule.check(seq_with(3, [EOS]), EOS) is FinishReason.STOP
    assert rule.check(seq_with(3, [EOS], ignore_eos=True), EOS) is None
    assert rule.check(seq_with(3, [7], stop_token_ids=[7]), 7) is FinishReason.STOP
    assert rule.check(seq_with(3, [7], stop_token_ids=[7], ignore_eos=True), 7) is FinishReason.STOP


def test_min_tokens_bars_every_stop_but_length():
    rule = StopRule({EOS}, 100, decode_text=lambda ids: "".join(chr(65 + i % 26) for i in ids))
    for output in ([EOS], [5, EOS]):
        assert rule.check(seq_with(3, output, min_tokens=3, max_tokens=3), EOS) is None
    assert rule.check(seq_with(3, [5, 6, EOS], min_tokens=3), EOS) is FinishReason.STOP
    assert rule.check(seq_with(3, [7], min_tokens=2, stop_token_ids=[7]), 7) is None
    text_hit = seq_with(3, [0], min_tokens=2, stop=["A"])  # token 0 decodes to "A"
    assert rule.check(text_hit, 0) is None
    text_hit.token_ids.append(0)
    # the first "A" came before min_tokens and never stopped the output: the cut is at the second
    assert rule.check(text_hit, 0) is FinishReason.STOP and text_hit.stop_text_len == 1
    assert rule.check(seq_with(3, [5, 6], min_tokens=2, max_tokens=2), 6) is FinishReason.LENGTH
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


@given(st.integers(1, 20), st.integers(0, 20), st.integers(0, 1), st.integers(1, 40), st.integers(2, 60))
def test_length_counts_pending_tokens_and_agrees_with_tokens_left(prompt, output, pending, max_tokens, window):
    """With r tokens left (``tokens_left``, a token still on the device counted), the rule
    stops a sequence by length exactly at the r-th new token; the pending token's landing
    stops it when it was the last (r = 0). ``continuing`` keeps a sequence exactly while a
    coming token is not its last (r > 1)."""
    rule = StopRule({EOS}, window)
    seq = seq_with(prompt, [5] * output, max_tokens=max_tokens)
    seq.num_pending = pending
    left = rule.tokens_left(seq)
    assert left == min(max_tokens - output - pending, window - prompt - output - pending)
    assert (rule.continuing([seq]) == [seq]) == (left > 1)
    assume(left >= (0 if pending else 1))
    stopped_after = None
    if pending:  # the token on the device lands: the length does not change
        seq.num_pending = 0
        seq.token_ids.append(5)
        if rule.check(seq, 5) is FinishReason.LENGTH:
            stopped_after = 0
    new = 0
    while stopped_after is None:
        new += 1
        seq.token_ids.append(5)
        if rule.check(seq, 5) is FinishReason.LENGTH:
            stopped_after = new
        assert new <= left
    assert stopped_after == left


@pytest.mark.parametrize("decoding, async_scheduling", [("greedy", False), ("greedy", True), ("sample", False),
                                                       ("speculative", False)])
def test_min_tokens_through_the_engine(tiny_model, cpu_config, decoding, async_scheduling):
    """A stop id that greedy decoding picks first is barred for min_tokens tokens, and stops
    the request once it may: every decoder, async scheduling included."""
    def llm(decoding):
        return LLM(cpu_config(tiny_model("llama"), dtype="float64", decoding={"name": decoding},
                              cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 64}},
                              scheduler={"name": "continuous"}, async_scheduling=async_scheduling))

    prompt = [5, 6, 7, 8, 9]
    free = llm("greedy").generate([prompt], {"max_tokens": 12, "ignore_eos": True})[0].token_ids
    first = free[0]
    out = llm(decoding).generate([prompt], {"max_tokens": 12, "min_tokens": 3, "stop_token_ids": [first],
                                            "ignore_eos": True})[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3
    if first in out.token_ids:
        assert out.token_ids.index(first) == len(out.token_ids) - 1 and out.finish_reason == "stop"


def test_a_stop_string_before_min_tokens_never_cuts_the_output():
    """vLLM's rule: stop strings are looked for from the min_tokens-th token on, so an
    occurrence earlier in the output neither stops it nor becomes the cut later (a streamed
    answer has already sent that text). An occurrence straddling the boundary counts."""
    letters = lambda ids: "".join(chr(65 + i % 26) for i in ids)  # noqa: E731 (token i decodes to one letter)
    rule = StopRule({EOS}, 100, decode_text=letters)
    # (28 decodes to "C": token 2 is EOS)
    early = seq_with(3, [1, 28, 3, 4], min_tokens=3, stop=["BC"])  # "BCDE": "BC" ends at token 2, before token 3
    assert rule.check(early, 4) is None and early.stop_text_len is None
    early.token_ids += [1, 28]  # "BCDEBC": a later occurrence stops it there
    assert rule.check(early, 28) is FinishReason.STOP and early.stop_text_len == 4
    straddling = seq_with(3, [1, 28, 3], min_tokens=3, stop=["CD"])  # "BCD": "CD" ends in token 3's text
    assert rule.check(straddling, 3) is FinishReason.STOP and straddling.stop_text_len == 1
