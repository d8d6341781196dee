"""``tessellm serve --stream-interval N``: after a request's first token, its events come every
N tokens of a sample and at its end; the text streamed is the same, and so are the usage and
the finish reasons, with and without logprobs, for one sample or several."""

from __future__ import annotations

import pytest

from tessellm import LLM
from tessellm.core.errors import ConfigError
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

MODEL = "tiny"
INTERVAL = 4


@pytest.fixture(scope="module")
def llm(cpu_config, tiny_model):
    return LLM(cpu_config(tiny_model("llama"), max_model_len=256,
                          cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 512}},
                          scheduler={"name": "continuous", "options": {"max_num_seqs": 16}}))


@pytest.fixture(scope="module")
def client(llm):
    from openai import OpenAI

    with serving(build_app(llm, model_name=MODEL, stream_interval=INTERVAL)) as url:
        yield OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def streamed(client, **kwargs) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str | None], int]:
    """Each choice's text, the tokens each of its chunks carried (by the running usage), its
    finish reason, and the final completion tokens."""
    texts: dict[int, str] = {}
    steps: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    seen, final = 0, None
    for chunk in client.completions.create(model=MODEL, stream=True, temperature=0, **kwargs,
                                           stream_options={"include_usage": True, "continuous_usage_stats": True}):
        if not chunk.choices:
            final = chunk.usage.completion_tokens
            continue
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            steps.setdefault(choice.index, []).append(chunk.usage.completion_tokens - seen)
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
        seen = chunk.usage.completion_tokens
    return texts, steps, reasons, final


@pytest.mark.parametrize("prompt,max_tokens,logprobs", [("Once upon a time", 13, None), ("def f(x):", 16, None),
                                                        ("1, 2, 3,", 1, None), ("The sky is", 10, 1)])
def test_events_come_every_interval_with_the_same_text(client, llm, prompt, max_tokens, logprobs):
    texts, steps, reasons, final = streamed(client, prompt=prompt, max_tokens=max_tokens, logprobs=logprobs,
                                            extra_body={"ignore_eos": True})
    ref = llm.generate([prompt], {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})[0].outputs[0]
    assert texts[0] == ref.text and reasons[0] == "length" and final == max_tokens
    tokens = steps[0]
    assert sum(tokens) == max_tokens and tokens[0] == 1  # the first token at once
    assert all(t == INTERVAL for t in tokens[1:-1]) and 0 <= tokens[-1] <= INTERVAL, tokens


def test_several_samples_each_stream_their_whole_text(client, llm):
    prompt, params = "A long time ago", {"max_tokens": 11, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True}
    texts, _, reasons, final = streamed(client, prompt=prompt, max_tokens=11, n=3, seed=5,
                                        extra_body={"ignore_eos": True, "temperature": 1.0})
    ref = llm.generate([prompt], params)[0].outputs
    assert [texts[i] for i in range(3)] == [o.text for o in ref]
    assert all(reasons[i] == "length" for i in range(3)) and final == 33


def test_a_stream_interval_below_one_is_refused():
    from tessellm.cli import build_parser
    from tessellm.serve.cli import cmd_serve

    args = build_parser().parse_args(["serve", "--stream-interval", "0"])
    with pytest.raises(ConfigError, match="--stream-interval must be at least 1, got 0"):
        cmd_serve(args)


def test_build_app_refuses_a_stream_interval_below_one(llm):
    with pytest.raises(ConfigError, match="stream_interval must be at least 1, got -2"):
        build_app(llm, stream_interval=-2)
