"""Per-request settings for a decoding plugin (``SamplingParams.extra_args``): the plugin
declares them as its ``RequestArgs`` model, the engine validates them when the request
arrives (one line naming the plugin, the key and what it takes), the decoder reads them
validated; a decoder that declares none refuses any. And min_p, a built-in field."""

from __future__ import annotations

import pytest
import torch
from pydantic import Field

import tessellm
from tessellm import LLM
from tessellm.core.errors import InvalidRequestError


class AvoidArgs(tessellm.PluginOptions):
    """The request's own setting for `avoiding`."""

    avoid: list[int] = Field(default_factory=list)
    """Token ids this request must never get."""


class AvoidingDecoder(tessellm.Decoder):
    """Argmax over the tokens the request does not avoid."""

    name = "avoiding"
    api_version = "1.1"
    RequestArgs = AvoidArgs

    def decode(self, logits: torch.Tensor, batch: tessellm.BatchMetadata) -> list[list[int]]:
        rows = tessellm.slot_logits(logits, batch).clone()
        for row, slot in zip(rows, batch.samples):
            args = self.request_args(slot.seq.params)
            row[args.avoid] = float("-inf")
        return [[t] for t in rows.argmax(dim=-1).tolist()]


@tessellm.hookimpl
def register_decoding(register):
    register(AvoidingDecoder)


@pytest.fixture
def llms(authors_plugins, cpu_config, tiny_model):
    folder = tiny_model("llama")
    return (LLM(cpu_config(folder, decoding={"name": "avoiding"})),
            LLM(cpu_config(folder, decoding={"name": "sample"})))


PROMPT = [[5, 6, 7, 8, 9]]


def test_the_decoder_gets_its_validated_args(llms):
    avoiding, sample = llms
    greedy = sample.generate(PROMPT, {"max_tokens": 6, "ignore_eos": True})[0].token_ids
    assert avoiding.generate(PROMPT, {"max_tokens": 6, "ignore_eos": True})[0].token_ids == greedy
    avoided = avoiding.generate(PROMPT, {"max_tokens": 6, "ignore_eos": True,
                                         "extra_args": {"avoid": greedy}})[0].token_ids
    assert len(avoided) == 6 and not set(avoided) & set(greedy)


@pytest.mark.parametrize("which, extra, words", [
    (0, {"avod": [1]}, ["decoding plugin 'avoiding'", "it takes: avoid", "extra_args.avod", "Extra inputs"]),
    (0, {"avoid": "three"}, ["decoding plugin 'avoiding'", "extra_args.avoid", "'three'"]),
    (1, {"avoid": [1]}, ["decoding plugin 'sample' takes no extra_args", "avoid"]),
])
def test_bad_args_are_refused_on_arrival_naming_the_plugin(llms, which, extra, words):
    llm = llms[which]
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(PROMPT, {"max_tokens": 2, "extra_args": extra})
    assert all(w in str(info.value) for w in words), str(info.value)
    assert llm.engine.requests == {} and not llm.engine.scheduler.unfinished()
    assert llm.generate(PROMPT, {"max_tokens": 2})[0].token_ids  # the engine still serves


def test_min_p_one_keeps_only_the_most_likely_token(llms):
    _, sample = llms
    greedy = sample.generate(PROMPT, {"max_tokens": 6, "ignore_eos": True})[0].token_ids
    kept = sample.generate(PROMPT, {"max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 1,
                                    "min_p": 1.0})[0].token_ids
    assert kept == greedy
    with pytest.raises(InvalidRequestError, match="min_p"):
        sample.generate(PROMPT, {"min_p": 1.5})
