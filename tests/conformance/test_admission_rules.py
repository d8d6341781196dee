"""Every suite that runs requests applies the engine's admission rules (``Engine.admit``): a
request the engine would refuse for the plugin (a field newer than its plugin API, a
decoder's refusal, a processor refusing its arguments) is a skip with the engine's reason,
never a failure. The issue's case: a sampler written for plugin API 1.0 on the ``min_p``
case, which the engine refuses for it at admission."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tessellm.core.engine.engine import Engine
from tessellm.core.engine.processors import LogitsProcessors
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.plugins.decoding.sample import SampleDecoder
from tessellm.testing.conformance import DecodingConformance, LogitsConformance, SchedulerConformance
from tessellm.testing.conformance.decoding import SAMPLING_CASES
from tessellm.testing.conformance.logits import Subject
from tessellm.testing.conformance.pipeline import (admission_refusal, admitted_requests, build_llm,
                                                   skip_unless_admitted)


class OldSampler(SampleDecoder):
    """The built-in sampler as a plugin written for plugin API 1.0 (before min_p)."""

    name = "old-sample"
    api_version = "1.0"
    request_fields = None  # the fields its plugin API knows: no min_p


class OldSamplerSuite(DecodingConformance):
    plugin_class = OldSampler


@pytest.fixture(scope="module")
def old_llm(tessellm_tiny_model: Path):
    return build_llm(OldSamplerSuite, tessellm_tiny_model, OldSamplerSuite.engine, {"name": "old-sample"})


def bare_llm(decoder_class: type, vocab_size: int = 64, max_model_len: int = 32) -> SimpleNamespace:
    """An ``llm`` whose engine has the admission rules' parts only (no model, no cache):
    ``Engine.admit`` itself, the decoder, no logits processors."""
    engine = object.__new__(Engine)
    engine.decoder = decoder_class(decoder_class.Options(), None, torch.device("cpu"))
    engine.vocab_size, engine.max_model_len, engine.processors = vocab_size, max_model_len, LogitsProcessors([])
    return SimpleNamespace(engine=engine)


def test_the_engines_refusal_is_the_suites_skip_reason():
    """The rule without a model (the default set's case; the suites on a real pipeline are
    extended)."""
    llm = bare_llm(OldSampler)
    min_p = SamplingParams(max_tokens=2, temperature=1.0, min_p=0.3)
    with pytest.raises(pytest.skip.Exception) as skipped:
        skip_unless_admitted(OldSamplerSuite, llm, min_p)
    message = str(skipped.value)
    assert "the engine refuses {'max_tokens': 2, 'temperature': 1.0, 'min_p': 0.3} at admission" in message
    assert "written for plugin API 1.0" in message and "SamplingParams.min_p, added in plugin API 1.1" in message
    skip_unless_admitted(OldSamplerSuite, llm, SamplingParams(max_tokens=2, temperature=1.0, top_k=4))
    skip_unless_admitted(DecodingConformance, bare_llm(SampleDecoder), min_p)  # the built-in sampler knows min_p: admitted
    assert "outside the vocabulary" in admission_refusal(llm, SamplingParams(), [64])
    assert "leaving no room to generate" in admission_refusal(llm, SamplingParams(), [1] * 32)


@pytest.mark.extended
def test_the_decoding_suite_skips_min_p_for_a_1_0_sampler_with_the_engines_reason(old_llm):
    case = next(c for c in SAMPLING_CASES if c.params.get("min_p"))
    with pytest.raises(pytest.skip.Exception) as skipped:
        OldSamplerSuite().test_sampling_follows_the_target_distribution(old_llm, case)
    message = str(skipped.value)
    assert "the engine refuses {'temperature': 1.0, 'min_p': 0.3} at admission" in message
    assert "written for plugin API 1.0" in message and "SamplingParams.min_p, added in plugin API 1.1" in message
    top_k = next(c for c in SAMPLING_CASES if c.name == "top_k=4")
    OldSamplerSuite().test_sampling_follows_the_target_distribution(old_llm, top_k)  # what it knows still runs


@pytest.mark.extended
def test_the_scheduler_suite_leaves_out_what_the_engine_refuses(old_llm):
    min_p = SamplingParams(max_tokens=2, temperature=1.0, min_p=0.2)
    plain = SamplingParams(max_tokens=2)
    assert admission_refusal(old_llm, plain) is None and "min_p" in admission_refusal(old_llm, min_p)
    assert admitted_requests(SchedulerConformance, old_llm, [(0, [5, 6], min_p), (1, [7], plain)]) == \
        [(1, [7], plain)]
    with pytest.raises(pytest.skip.Exception, match="the engine refuses .* at admission"):
        admitted_requests(SchedulerConformance, old_llm, [(0, [5, 6], min_p)])
    with pytest.raises(pytest.skip.Exception, match="prompt token id 99999 is outside the vocabulary"):
        admitted_requests(SchedulerConformance, old_llm, [(0, [99999], plain)])


def test_the_logits_suite_skips_a_request_its_processor_refuses():
    from tessellm.plugins.logits.bias import LogitBias

    with pytest.raises(pytest.skip.Exception,
                       match="refuses the suite.s request 0 .* at admission.*token id 100 is outside the vocabulary"):
        Subject(LogitBias, LogitBias.Options(), [{"logit_bias": {100: 1.0}}], 64, 0)
    assert LogitsConformance.kind == "logits"
