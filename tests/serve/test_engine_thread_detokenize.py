"""Streamed text is detokenized incrementally, by the coroutine that reads the stream: the
deltas of every sample add up to ``tokenizer.decode(all its output ids, skip_special_tokens=True)``
(cut where a stop string begins), for random ids of SmolLM2's real tokenizer that split
multi-byte characters across tokens and however the tokens are grouped into steps; and the
engine thread itself never decodes (without stop strings) nor has its stop rule patched."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, strategies as st

from tessellm import LLM
from tessellm.core.engine.outputs import StopRule
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.serve.detokenize import IncrementalDetokenizer, SampleText, direct_decode
from tessellm.serve.engine_thread import EngineThread

MULTI_BYTE = "héllo wörld ñandú 日本語の文章 😀🤖🎉 Ωμέγα ∑∫ — “quotes” ‘x’ 한국어 عربى\n\tend"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def pieces(tokenizer) -> list[int]:
    """Ids whose own text is not whole characters (a byte or a few of a multi-byte one),
    the special tokens, and some ordinary ones."""
    ids = tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    split = sorted({i for i in ids if "\ufffd" in tokenizer.decode([i])})
    assert len(split) >= 8
    return split + list(tokenizer.all_special_ids) + ids


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def token_ids(tokenizer, pieces):
    """Random ids: from the split pieces and specials, or from the whole vocabulary."""
    return st.lists(st.one_of(st.sampled_from(pieces), st.integers(0, len(tokenizer) - 1)), min_size=1, max_size=60)


def steps_of(ids: list[int], cuts: list[int]) -> list[list[int]]:
    """``ids`` grouped into steps at ``cuts`` (a speculative step appends several tokens)."""
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@given(data=st.data())
def test_deltas_add_up_to_the_whole_decoding(tokenizer, pieces, data):
    ids = data.draw(token_ids(tokenizer, pieces))
    steps = steps_of(ids, data.draw(st.lists(st.integers(0, 60), max_size=20)))
    decode = decoder(tokenizer)
    detok = IncrementalDetokenizer(decode)
    text = "".join(detok.add(step, final=i == len(steps) - 1) for i, step in enumerate(steps))
    assert text == decode(ids)


@given(data=st.data())
def test_the_direct_decode_is_the_tokenizers(tokenizer, pieces, data):
    """Streams decode through the tokenizers library directly where transformers' decode
    adds nothing to it: the same text as ``tokenizer.decode``, specials skipped."""
    ids = data.draw(token_ids(tokenizer, pieces))
    assert direct_decode(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, clean_up_tokenization_spaces=True)
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tokenizer.encode("Hello , world ! Isn 't it ?", add_special_tokens=False)
    cleaned = tokenizer.decode(ids, skip_special_tokens=True)
    assert cleaned != tokenizer._tokenizer.decode(ids, skip_special_tokens=True)  # the clean-up changed it
    assert direct_decode(tokenizer)(ids) == cleaned


@given(data=st.data())
def test_a_stop_string_cuts_the_streamed_text_where_the_stop_rule_says(tokenizer, pieces, data):
    """The engine's stop rule checks each appended token; the reader's text, held back by the
    longest stop string less one character, never shows what the cut removes."""
    decode = decoder(tokenizer)
    ids = data.draw(token_ids(tokenizer, pieces))
    whole = decode(ids)
    stops = data.draw(st.lists(st.one_of(
        st.builds(lambda a, n: whole[a:a + n], st.integers(0, max(len(whole) - 1, 0)), st.integers(1, 6)),
        st.text(min_size=1, max_size=4)), min_size=1, max_size=3).filter(lambda s: all(s)))
    rule = StopRule(eos_token_ids=[], max_model_len=10_000, decode_text=decode)
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=len(ids), stop=stops))
    reader = SampleText(decode, hold=max(len(s) for s in stops) - 1)
    shown, pending = [], list(ids)
    for step in steps_of(ids, data.draw(st.lists(st.integers(0, 60), max_size=20))):
        new, finished = [], False
        for token in step:  # the engine appends a step's tokens one by one and stops at the rule
            seq.token_ids.append(token)
            new.append(pending.pop(0))
            if rule.check(seq, token) is not None:
                finished = True
                break
        shown.append(reader.push(new, finished, seq.stop_text_len))
        if finished:
            break
    output = seq.output_token_ids
    expected = decode(output) if seq.stop_text_len is None else decode(output)[:seq.stop_text_len]
    assert "".join(shown) == expected
    assert seq.stop_text_len is not None or not any(s in expected for s in stops)


@pytest.fixture(scope="module")
def llm(cpu_config, tiny_model):
    return LLM(cpu_config(tiny_model("llama"), max_model_len=128,
                          cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}},
                          scheduler={"name": "continuous", "options": {"max_num_seqs": 8}}))


async def stream_texts(engine: EngineThread, prompt: list[int], params: SamplingParams) -> dict[int, str]:
    texts: dict[int, str] = {}
    async for out in engine.generate("r", prompt, params):
        for d in out.samples:
            texts[d.index] = texts.get(d.index, "") + d.text
    return texts


def test_the_engine_thread_hands_out_tokens_and_the_reader_decodes_them(llm):
    """No decoding on the engine thread (no stop strings, so its stop rule decodes nothing);
    the streamed texts of n samples are the offline ones; the stop rule is the pipeline's own."""
    threads: set[str] = set()
    decode, library = llm.tokenizer.decode, llm.tokenizer._tokenizer

    def watched(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return decode(*args, **kwargs)

    class WatchedLibrary:  # the tokenizers library's object, its decodes noted
        def __getattr__(self, name):
            return getattr(library, name)

        def decode(self, *args, **kwargs):
            threads.add(threading.current_thread().name)
            return library.decode(*args, **kwargs)

    prompt = llm.encode("Once upon a time")
    llm.tokenizer.decode, llm.tokenizer._tokenizer = watched, WatchedLibrary()
    try:
        engine = EngineThread(llm, max_waiting=8)
        assert llm.engine.stop.decode_text == llm.pipeline._decode_text  # not replaced at run time
        params = SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=7, ignore_eos=True)
        engine.start()
        try:
            texts = asyncio.run(stream_texts(engine, prompt, params))
        finally:
            engine.shutdown()
    finally:
        llm.tokenizer.decode, llm.tokenizer._tokenizer = decode, library
    ref = llm.generate([prompt], params)[0].outputs
    assert [texts[i] for i in range(3)] == [o.text for o in ref]
    assert threads and "tessellm-engine" not in threads
