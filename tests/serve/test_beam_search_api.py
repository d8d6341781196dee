"""Beam search over HTTP as vLLM's completions take it: ``use_beam_search`` with ``best_of``
beams and ``n`` results (through the openai library's ``extra_body``) returns the offline
beams' texts; a stream or a server without the `beam` decoder is a 400 naming the fix."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tessellm import LLM
from tessellm.serve.app import build_app
from tessellm.testing.models import build_tiny_llama
from tessellm.testing.serving import serving

PROMPT = [1, 5, 9, 14, 3, 22]


def config(model, decoding: str) -> dict:
    return {"model": str(model), "device": "cpu", "dtype": "float32", "decoding": {"name": decoding},
            "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 128}}, "scheduler": {"name": "continuous"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("beam-http") / "model", vocab_size=64)


@pytest.fixture(scope="module")
def server(model):
    llm = LLM(config(model, "beam"))
    with serving(build_app(llm, model_name="tiny", api_key=None, max_request_bytes=64 * 1024)) as url:
        yield url, llm


def test_openai_client_gets_the_offline_beams(server, model):
    url, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=2,
                                       extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5})
    offline = LLM(config(model, "beam")).generate([PROMPT], {"max_tokens": 6, "n": 2, "extra_args": {
        "num_beams": 3, "length_penalty": 0.5, "early_stopping": False}})[0]
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == [o.text for o in offline.outputs]
    assert answer.usage.completion_tokens == sum(len(o.token_ids) for o in offline.outputs)


def test_a_streamed_beam_search_is_refused(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True,
                                                  "use_beam_search": True, "best_of": 2}, timeout=30)
    assert r.status_code == 400 and "not streamed" in r.json()["error"]["message"]


def test_a_server_without_the_beam_decoder_names_it(model):
    llm = LLM(config(model, "sample"))
    with serving(build_app(llm, model_name="tiny", api_key=None, max_request_bytes=64 * 1024)) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                      "use_beam_search": True, "best_of": 2}, timeout=30)
    assert r.status_code == 400 and "decoding.name=beam" in r.json()["error"]["message"]
