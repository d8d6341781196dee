"""A third party's logits processor (examples/tessellm-logits-example: `wrap-up`, which raises
the end-of-sequence logit once the output is long enough) loads through its entry point,
passes the logits conformance suite (``tessellm plugins --check logits:wrap-up``), and a
request that names it with arguments gets another output than one that does not; an unknown
name or arguments it does not take are refused when the request arrives, naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessellm import LLM, SamplingParams
from tessellm.cli import main
from tessellm.core.errors import InvalidRequestError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tessellm-logits-example"
EOS = 2  # the tiny model's


@pytest.fixture
def wrap_up(install_example):
    """The example installed as a distribution, in the registry pipelines use."""
    return install_example(EXAMPLE)


def test_listed_and_conformant(wrap_up, capsys):
    dist, registry = wrap_up
    entry = registry.get("logits", "wrap-up")
    assert entry is not None and entry.package == dist == "tessellm-logits-example"
    assert main(["plugins", "--check", "logits:wrap-up", "--examples", "3"]) == 0
    table = capsys.readouterr().out
    assert "logits plugin 'wrap-up' passes" in table and "test_overlapped_steps_equal_synchronous_ones" in table


def test_a_request_names_it_with_its_arguments(wrap_up, tiny_model, cpu_config):
    llm = LLM(cpu_config(tiny_model("llama")))
    prompts = [[5, 6, 7, 8], [9, 10]]
    plain = SamplingParams(max_tokens=8)
    wrapped = SamplingParams(max_tokens=8, logits_processors=[{"name": "wrap-up", "args": {"after": 3,
                                                                                             "boost": 1000.0}}])
    before = llm.generate(prompts, plain)
    after = llm.generate(prompts, [wrapped, plain])  # one request with it, one without, in one batch
    assert all(EOS not in o.outputs[0].token_ids for o in before)
    ended = after[0].outputs[0]
    # the same 3 tokens, then EOS: nothing changes before `after` tokens, then EOS wins
    assert ended.token_ids == before[0].outputs[0].token_ids[:3] + [EOS] and ended.finish_reason == "stop"
    assert after[1].outputs[0].token_ids == before[1].outputs[0].token_ids


def test_unknown_names_and_bad_arguments_are_refused_naming_them(wrap_up, tiny_model, cpu_config):
    llm = LLM(cpu_config(tiny_model("llama")))
    with pytest.raises(InvalidRequestError, match="'wrap-upp'.*not an installed logits processor.*wrap-up"):
        llm.generate([[5, 6]], SamplingParams(logits_processors=["wrap-upp"]))
    with pytest.raises(InvalidRequestError, match="'wrap-up' refuses its args.*after, boost.*afterr"):
        llm.generate([[5, 6]], SamplingParams(logits_processors=[{"name": "wrap-up", "args": {"afterr": 3}}]))
    with pytest.raises(InvalidRequestError, match="'wrap-up' refuses its args.*boost"):
        llm.generate([[5, 6]], SamplingParams(logits_processors=[{"name": "wrap-up", "args": {"boost": -1}}]))
    assert llm.engine.processors.bound == {}  # nothing admitted, nothing left behind


def test_example_imports_only_the_plugin_api(plugin_api_imports):
    assert plugin_api_imports(EXAMPLE) == []
