"""``cpu_compile``: one-stream CPU decode steps through the model compiled as one graph,
chosen against eager by timing at the first such step, eager for every other step, and back
to eager (logged once) when compiling or a compiled call fails."""

from __future__ import annotations

import logging

import pytest
import torch

from tessellm import LLM
from tessellm.core.model import compiled as compiled_module

PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]
PARAMS = {"max_tokens": 6, "ignore_eos": True, "temperature": 0.0}


def _pipelines(cpu_config, tiny_model, **options):
    model = tiny_model("llama")
    eager = LLM(cpu_config(model, **options))
    compiled = LLM(cpu_config(model, cpu_compile=True, **options))
    return eager, compiled


def _tokens(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, PARAMS)]


@pytest.fixture
def traced_only(monkeypatch):
    """torch.compile with dynamo's tracing and no code generation: the runner's plumbing and
    the model's traceability, in seconds."""
    real = torch.compile
    monkeypatch.setattr(compiled_module.torch, "compile", lambda model, **kw: real(model, backend="eager", **kw))


@pytest.mark.extended  # dynamo traces the tiny model: the slowest of the module
def test_one_stream_decode_runs_compiled_with_the_same_tokens(cpu_config, tiny_model, traced_only):
    eager, compiled = _pipelines(cpu_config, tiny_model)
    choice = compiled.pipeline.runner.compiled
    assert choice.state == "untried" and eager.pipeline.runner.compiled is None
    assert _tokens(compiled, PROMPTS[:1]) == _tokens(eager, PROMPTS[:1])
    assert choice.state in ("compiled", "eager") and set(choice.timings) == {"compiled", "eager"}
    # several sequences at once run eagerly, whatever was chosen
    assert _tokens(compiled, PROMPTS) == _tokens(eager, PROMPTS)


@pytest.mark.extended  # a second traced pipeline pair
def test_with_a_scratch_block_the_choice_is_made_at_start_up(cpu_config, tiny_model, traced_only):
    paged = {"cache": {"name": "paged", "options": {"num_blocks": 64}}}
    eager, compiled = _pipelines(cpu_config, tiny_model, **paged)
    assert compiled.pipeline.runner.compiled.state in ("compiled", "eager")
    assert _tokens(compiled, PROMPTS[:1]) == _tokens(eager, PROMPTS[:1])


def test_a_failed_compile_keeps_eager_with_one_log_line(cpu_config, tiny_model, monkeypatch, caplog):
    def broken(model, **kw):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled_module.torch, "compile", broken)
    eager, compiled = _pipelines(cpu_config, tiny_model)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        assert _tokens(compiled, PROMPTS[:1]) == _tokens(eager, PROMPTS[:1])
        _tokens(compiled, PROMPTS[:1])
    assert compiled.pipeline.runner.compiled.state == "eager"
    assert [r.getMessage() for r in caplog.records] == [
        "compiling the decode step failed (RuntimeError: no C++ compiler); CPU decode steps run eagerly"]


def test_a_compiled_step_that_fails_later_falls_back_to_eager(cpu_config, tiny_model, monkeypatch, caplog):
    calls = []

    def flaky(model, **kw):
        def forward(*args, **kwargs):
            calls.append(1)
            if len(calls) > 3:  # compiles, is timed, runs the choosing step, then breaks
                raise RuntimeError("recompile failed")
            return model(*args, **kwargs)
        return forward

    times = iter([1.0, 0.0])  # eager, then compiled: compiled is kept
    monkeypatch.setattr(compiled_module.torch, "compile", flaky)
    monkeypatch.setattr(compiled_module, "median_seconds", lambda fn: (fn(), next(times))[1])
    eager, compiled = _pipelines(cpu_config, tiny_model)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        assert _tokens(compiled, PROMPTS[:1]) == _tokens(eager, PROMPTS[:1])
    assert compiled.pipeline.runner.compiled.state == "eager" and len(calls) == 4
    assert [r.getMessage() for r in caplog.records] == [
        "a compiled decode step failed (RuntimeError: recompile failed); CPU decode steps run eagerly"]


def test_cpu_compile_is_refused_off_the_cpu_runner():
    from tessellm.core.model.runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.stage = torch.device("meta"), None
    with pytest.raises(ValueError, match="single-process CPU pipeline"):
        runner.compile_decode()


@pytest.mark.extended
def test_inductor_compiles_the_tiny_model_and_keeps_its_tokens(cpu_config, tiny_model):
    """The real compile (Inductor's C++ backend): slow, so under make test-all."""
    eager, compiled = _pipelines(cpu_config, tiny_model)
    assert _tokens(compiled, PROMPTS[:1]) == _tokens(eager, PROMPTS[:1])
    assert compiled.pipeline.runner.compiled.state in ("compiled", "eager")
