"""The messages between the API side and the engine core: sampling parameters, errors (with
the field they are about), log-probabilities and generate records survive the round trip
through msgpack; a reader that fell behind gets several steps' outputs as one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tessellm.core.errors import InvalidRequestError, LoraAdapterError, RequestRejectedError
from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.core.interfaces.sequence import SamplingParams, TokenLogprob
from tessellm.serve.engine_client import GENERATE
from tessellm.serve.engine_protocol import (RequestFailed, decode_error, decode_logprobs, decode_params, encode_error,
                                            encode_logprobs, encode_params, pack, unpack)

params_fields = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 10_000), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 100), "n": st.integers(1, 8), "seed": st.integers(0, 2**40),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3), "logprobs": st.integers(0, 20),
    "ignore_eos": st.booleans(), "logit_bias": st.dictionaries(st.integers(0, 5000), st.floats(-100, 100), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 5000), max_size=3),
    "extra_args": st.dictionaries(st.sampled_from(["num_beams", "x"]), st.integers(0, 9), max_size=2)})


@given(params_fields)
def test_sampling_params_cross_unchanged(fields):
    params = SamplingParams(**fields)
    assert decode_params(unpack(pack([encode_params(params)]))[0]) == params


def test_a_grammar_and_processors_cross_unchanged():
    params = SamplingParams(structured_output=GrammarSpec.choice(["a", "b"]), bad_words=["x"],
                            logits_processors=[{"name": "p", "args": {"k": 1}}])
    assert decode_params(unpack(pack([encode_params(params)]))[0]) == params


def test_errors_keep_their_type_and_field():
    cases = [InvalidRequestError("prompt is empty", field="prompt"), RequestRejectedError("too long", field="prompt"),
             LoraAdapterError("no such adapter"), RequestFailed("the step raised"), ValueError("a bug")]
    for exc in cases:
        back = decode_error(unpack(pack(encode_error(exc))))
        assert str(back) == str(exc) and getattr(back, "field", None) == getattr(exc, "field", None)
        assert type(back) is (type(exc) if not isinstance(exc, ValueError) or isinstance(exc, InvalidRequestError)
                              or isinstance(exc, LoraAdapterError) else RuntimeError)


def test_logprobs_and_generate_records_cross():
    lps = [None, TokenLogprob(-0.5, [(3, -0.5), (9, -1.25)])]
    assert decode_logprobs(unpack(pack(encode_logprobs(lps)))) == lps
    record = ["r1", True, [[0, [5, 6], "stop", encode_logprobs(lps[1:] * 2), 3]], 4, 2, 1, None]
    out = GENERATE.reader()([unpack(pack(record))])
    assert out.finished and out.samples[0].token_ids == [5, 6] and out.samples[0].stop_text_len == 3
    assert out.samples[0].logprobs == [lps[1], lps[1]] and (out.prompt_tokens, out.cached_tokens) == (4, 1)


def test_records_of_a_reader_behind_read_as_one_output():
    read = GENERATE.reader()
    first = ["r", False, [[0, [1], None, None, None], [1, [7], None, None, None]], 3, 2, 1, [None]]
    last = ["r", True, [[0, [2, 3], "length", None, None]], 3, 5, 1, None]
    merged = read([unpack(pack(first)), unpack(pack(last))])
    assert merged.finished and merged.completion_tokens == 5 and merged.prompt_logprobs == [None]
    by_index = {d.index: d for d in merged.samples}
    assert by_index[0].token_ids == [1, 2, 3] and by_index[0].finish_reason == "length" and by_index[1].token_ids == [7]


def test_compact_records_keep_the_counts_of_the_first():
    """A decode step's compact record carries only the new tokens: the reader keeps the
    prompt's and cached tokens from the first record and counts the completion."""
    read = GENERATE.reader()
    head = read([["r", False, [[0, [4], None, None, None]], 6, 1, 2, None]])
    assert (head.prompt_tokens, head.completion_tokens, head.cached_tokens) == (6, 1, 2)
    caught_up = read([unpack(pack(["r", [5]])), unpack(pack(["r", [8, 9]]))])
    assert not caught_up.finished and caught_up.samples[0].token_ids == [5, 8, 9]
    assert (caught_up.prompt_tokens, caught_up.completion_tokens, caught_up.cached_tokens) == (6, 4, 2)
    end = read([["r", [10]], ["r", True, [[0, [11], "stop", None, 2]], 6, 6, 2, None]])
    assert end.finished and end.samples[0].token_ids == [10, 11] and end.samples[0].finish_reason == "stop"
    assert end.samples[0].stop_text_len == 2 and end.completion_tokens == 6
