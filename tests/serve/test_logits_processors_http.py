"""The logits processors' request fields over HTTP: presence_penalty,
frequency_penalty, repetition_penalty, bad_words, allowed_token_ids, no_repeat_ngram_size and
a third-party processor named in logits_processors, sent by the openai client to completions and
chat, give the offline engine's greedy tokens with the same SamplingParams and change them as
each field says; bad values and unknown processors are a 400 naming them; langchain-openai and
litellm, which send presence_penalty and frequency_penalty by default, get a 200."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from pydantic import Field

import tessellm
from tessellm import LLM
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorRows, to_device
from tessellm.core.plugin import PluginOptions
from tessellm.core.registry import PluginRegistry
from tessellm.core.version import PLUGIN_API_VERSION
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

openai = pytest.importorskip("openai")

MODEL = "tiny"
PROMPT = [5, 6, 7, 8, 9, 10]  # its greedy output repeats two tokens within 12
GREEDY = {"max_tokens": 12, "temperature": 0.0}
FORCED = 1234


class ForceTokenArgs(PluginOptions):
    token_id: int = Field(ge=0)


class ForceToken(LogitsProcessor):
    """A third-party processor, as a package outside the tree would register it: only
    ``token_id`` may be picked."""

    name = "force-token"
    api_version = PLUGIN_API_VERSION
    Args = ForceTokenArgs

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        ids = to_device([args.token_id for args in rows.args], torch.long, logits.device)
        kept = logits[rows.index, ids]
        logits[rows.index] = float("-inf")
        logits[rows.index, ids] = kept


@tessellm.hookimpl
def register_logits(register):
    register(ForceToken)


@pytest.fixture(scope="module")
def config(request, cpu_config, tiny_model):
    """The pipeline config, with this module's processor installed for the pipelines built
    while the module's tests run."""
    registry = PluginRegistry()
    registry.add_module(request.module, package="authors-package")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tessellm.core.registry._default", registry)
        yield cpu_config(tiny_model("llama"), max_model_len=256, scheduler={"name": "continuous"},
                         cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}})


@pytest.fixture(scope="module")
def offline(config):
    return LLM(config)


@pytest.fixture(scope="module")
def server(config):
    llm = LLM(config)
    with serving(build_app(llm, model_name=MODEL, api_key=None, max_request_bytes=64 * 1024)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def split(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """OpenAI's own fields (keyword arguments of the openai client) and the extensions
    (its ``extra_body``)."""
    own = {k: v for k, v in fields.items() if k in ("presence_penalty", "frequency_penalty")}
    return own, {k: v for k, v in fields.items() if k not in own}


def complete(client, fields: dict[str, Any], **more) -> Any:
    own, extra = split(fields)
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=GREEDY["max_tokens"], temperature=0,
                                     extra_body=extra, **own, **more)


def chat(client, fields: dict[str, Any]) -> str:
    own, extra = split(fields)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=GREEDY["max_tokens"], temperature=0, extra_body=extra, **own)
    return r.choices[0].message.content


def reference(offline: LLM, fields: dict[str, Any], chat: bool = False) -> Any:
    """The offline engine's greedy output with these fields."""
    return offline.generate("hi" if chat else [PROMPT], {**GREEDY, **fields}, chat=chat)[0].outputs[0]


FIELDS = [
    {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -1.0},
    {"repetition_penalty": 1.5},
    {"bad_words": ["the", " of"]},
    {"allowed_token_ids": [FORCED, 2345, 3456]},
    {"no_repeat_ngram_size": 2},
    {"logits_processors": [{"name": "force-token", "args": {"token_id": FORCED}}]},
    {"presence_penalty": 0.5, "repetition_penalty": 1.2, "bad_words": ["a"], "no_repeat_ngram_size": 3},
]


@pytest.mark.parametrize("fields", FIELDS, ids=lambda f: ",".join(f))
def test_completions_and_chat_give_the_offline_tokens(client, offline, fields):
    assert complete(client, fields).choices[0].text == reference(offline, fields).text
    assert chat(client, fields) == reference(offline, fields, chat=True).text


def test_allowed_token_ids_hold_every_token(client, offline):
    allowed = [FORCED, 2345, 3456]
    r = complete(client, {"allowed_token_ids": allowed}, logprobs=0)
    pieces = {offline.tokenizer.decode([t]) for t in allowed}
    assert set(r.choices[0].logprobs.tokens) <= pieces, r.choices[0].logprobs.tokens
    assert set(reference(offline, {"allowed_token_ids": allowed}).token_ids) <= set(allowed)


def test_a_third_party_processor_named_in_logits_processors_applies(client, offline):
    fields = {"logits_processors": [{"name": "force-token", "args": {"token_id": FORCED}}]}
    assert complete(client, fields).choices[0].text == offline.tokenizer.decode([FORCED] * GREEDY["max_tokens"])
    assert chat(client, fields) == offline.tokenizer.decode([FORCED] * GREEDY["max_tokens"])


def one_token_word(offline: LLM, tokens: list[int]) -> tuple[str, int]:
    """A word of the output that is one token as it stands or after a space (what bad_words
    tokenizes), and that token."""
    encode = offline.tokenizer.encode
    for token in tokens:
        word = offline.tokenizer.decode([token]).strip()
        if re.fullmatch(r"\w+", word) and [token] in (encode(word, add_special_tokens=False),
                                                     encode(" " + word, add_special_tokens=False)):
            return word, token
    pytest.fail(f"no one-token word in the greedy output {tokens}")


def test_bad_words_take_a_word_out_of_the_greedy_output(client, offline):
    greedy = reference(offline, {}).token_ids
    word, token = one_token_word(offline, greedy)
    banned = reference(offline, {"bad_words": [word]})
    assert token not in banned.token_ids and banned.token_ids != greedy
    assert complete(client, {"bad_words": [word]}).choices[0].text == banned.text


def test_a_strong_presence_penalty_stops_the_repeats(client, offline):
    greedy = reference(offline, {}).token_ids
    assert len(set(greedy)) < len(greedy), "the unpenalized greedy output repeats a token"
    penalized = reference(offline, {"presence_penalty": 2.0})
    assert len(set(penalized.token_ids)) == len(penalized.token_ids), penalized.token_ids
    assert complete(client, {"presence_penalty": 2.0}).choices[0].text == penalized.text
    streamed = complete(client, {"presence_penalty": 2.0}, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == penalized.text


def test_no_repeat_ngram_size_one_repeats_no_token_of_prompt_or_output(client, offline):
    out = reference(offline, {"no_repeat_ngram_size": 1}).token_ids
    assert len(set(out)) == len(out) and not set(out) & set(PROMPT), out
    assert complete(client, {"no_repeat_ngram_size": 1}).choices[0].text == offline.tokenizer.decode(out)


@pytest.mark.parametrize("fields", [
    {"presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None},
    {"bad_words": None, "allowed_token_ids": None, "no_repeat_ngram_size": None, "logits_processors": None},
    {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logits_processors": []},
])
def test_null_and_the_defaults_are_greedy_decoding(client, offline, fields):
    assert complete(client, fields).choices[0].text == reference(offline, {}).text


@pytest.mark.parametrize("fields, words", [
    ({"logits_processors": ["no-such-processor"]}, "no-such-processor"),
    ({"logits_processors": [{"name": "no-such-processor", "args": {"x": 1}}]}, "no-such-processor"),
    ({"logits_processors": [{"name": "force-token", "args": {"token_id": "x"}}]}, "force-token"),
    ({"logits_processors": [{"name": "force-token", "args": {}}]}, "force-token"),
    ({"logits_processors": ["logit_bias"]}, "logit_bias"),
    ({"logits_processors": [{"name": "force-token", "arg": {}}]}, "logits_processors"),
    ({"logits_processors": 5}, "logits_processors"),
    ({"presence_penalty": "a lot"}, "presence_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [1, 2]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
])
@pytest.mark.parametrize("path", ["completions", "chat"])
def test_bad_values_and_unknown_processors_are_a_400_naming_them(client, path, fields, words):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, fields) if path == "completions" else chat(client, fields)
    assert caught.value.status_code == 400 and words in caught.value.message, caught.value.message


def test_an_allowed_token_outside_the_vocabulary_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, {"allowed_token_ids": [10**9]})
    assert "allowed_token_ids" in caught.value.message, caught.value.message


def test_langchain_openai_gets_an_answer(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="x", model=MODEL, presence_penalty=0.5,
                                        frequency_penalty=0.5, max_tokens=4, temperature=0, max_retries=0)
    assert isinstance(model.invoke("hi").content, str)


def test_litellm_gets_an_answer(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list on import
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server}/v1", api_key="x",
                           messages=[{"role": "user", "content": "hi"}], presence_penalty=0.5,
                           frequency_penalty=0.5, max_tokens=4, temperature=0, num_retries=0)
    assert isinstance(r.choices[0].message.content, str)
