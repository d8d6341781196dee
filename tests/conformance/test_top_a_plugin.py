"""A sampler with a rule of its own (top-a, tests/conformance/top_a_plugin.py) passes the
whole decoding suite, its own setting exercised through ``sampling_cases``, and
``tessellm plugins --check decoding:top-a``; its draws are checked against the distribution
it declares (``target_probs``), and one that declares a rule it does not follow fails."""

from __future__ import annotations

import pytest
import torch

from tessellm.core import registry as registry_module
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.core.registry import PluginRegistry
from tessellm.plugins.decoding.sample import SampleDecoder
from tessellm.testing import reference_probs
from tessellm.testing.conformance import DecodingConformance
from tessellm.testing.conformance.decoding import SAMPLING_CASES, SamplingCase, head_logits, target_distribution
from tessellm.testing.conformance.pipeline import build_llm

from . import top_a_plugin
from .top_a_plugin import TopADecoder

TOP_A_CASES = (SamplingCase("top_a=0.3", {"temperature": 1.0, "extra_args": {"top_a": 0.3}}, ("top_a",)),
               SamplingCase("temperature=1.5,top_a=0.5", {"temperature": 1.5, "extra_args": {"top_a": 0.5}},
                            ("temperature", "top_a")))


class TestTopA(DecodingConformance):
    plugin_class = TopADecoder
    sampling_cases = (*SAMPLING_CASES, *TOP_A_CASES)


def test_the_standard_rule_is_exported_under_both_names():
    logits = head_logits(64)
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    expected = target_distribution(logits, 0.7, top_k=4, top_p=0.9)
    assert torch.equal(reference_probs(logits, params), expected)
    assert torch.equal(reference_probs(logits, temperature=0.7, top_k=4, top_p=0.9), expected)
    greedy = torch.nn.functional.one_hot(logits.argmax(), 64).double()
    assert torch.equal(reference_probs(logits, SamplingParams()), greedy)  # temperature 0


class LyingTopA(TopADecoder):
    """Declares the top-a rule but draws by the standard one: the suite must catch it."""

    name = "lying-top-a"
    api_version = "1.6"

    def decode(self, logits, batch):
        return SampleDecoder.decode(self, logits, batch)


class _LyingSuite(DecodingConformance):  # not collected: run by the test below, one property
    plugin_class = LyingTopA


def test_a_sampler_not_following_its_declared_rule_fails(tessellm_tiny_model):
    suite = _LyingSuite()
    llm = build_llm(_LyingSuite, tessellm_tiny_model, suite.engine, {"name": LyingTopA.name, "options": {}})
    with pytest.raises(AssertionError, match="top_a=0.3: sampled tokens do not follow the target distribution"):
        suite.test_sampling_follows_the_target_distribution(llm, TOP_A_CASES[0])


def test_the_check_command_passes_it(monkeypatch, capsys):
    from tessellm.cli import main

    monkeypatch.setattr(registry_module, "_default", PluginRegistry(modules=[top_a_plugin]))
    assert main(["plugins", "--check", "decoding:top-a", "--examples", "3"]) == 0
    out = capsys.readouterr().out
    assert "decoding plugin 'top-a' passes" in out
    assert "test_sampled_continuations_follow_the_target_distribution" in out
