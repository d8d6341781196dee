"""``Quantizer.calibrate`` (plugin API 1.2), as a third-party quantizer sees it: the pipeline
calls it on the float model with a working ``ctx.run`` before ``apply``, and never on a
quantizer that does not override it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tessellm
from tessellm import LLM

EVENTS: list[tuple] = []


class RecordingQuantizer(tessellm.Quantizer):
    """Records what calibrate saw, then leaves the model as it is."""

    name = "recording"
    api_version = "1.2"

    def calibrate(self, model: nn.Module, ctx: tessellm.CalibrationContext) -> None:
        ids = ctx.tokenizer("the river runs past the mill")["input_ids"]
        logits = ctx.run(ids)
        linears = sum(type(m) is nn.Linear for m in model.modules())
        EVENTS.append(("calibrate", tuple(logits.shape), torch.is_inference_mode_enabled(), ctx.max_tokens, linears))

    def apply(self, model: nn.Module) -> nn.Module:
        EVENTS.append(("apply",))
        return model


class PlainQuantizer(tessellm.Quantizer):
    """Overrides apply only."""

    name = "plain"
    api_version = "1.0"

    def apply(self, model: nn.Module) -> nn.Module:
        EVENTS.append(("plain apply",))
        return model


@tessellm.hookimpl
def register_quant(register):
    register(RecordingQuantizer)
    register(PlainQuantizer)


@pytest.fixture(autouse=True)
def _fresh_events():
    EVENTS.clear()


def test_calibrate_runs_the_float_model_before_apply(authors_plugins, cpu_config, tiny_model):
    llm = LLM(cpu_config(tiny_model("llama"), quant={"name": "recording"}))
    (kind, shape, inference, max_tokens, linears), applied = EVENTS
    assert kind == "calibrate" and applied == ("apply",)
    assert shape[0] >= 4 and shape[1] == llm.pipeline.spec.vocab_size
    assert inference and max_tokens == llm.engine.max_model_len and linears > 0
    assert llm.pipeline.cache.num_free_blocks == llm.pipeline.cache.num_blocks  # calibration gave its room back
    assert llm.generate([[5, 6, 7]], {"max_tokens": 2, "ignore_eos": True})[0].token_ids


def test_a_quantizer_without_calibrate_is_applied_at_load(authors_plugins, cpu_config, tiny_model):
    LLM(cpu_config(tiny_model("llama"), quant={"name": "plain"}))
    assert EVENTS == [("plain apply",)]
