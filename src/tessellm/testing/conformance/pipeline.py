"""Real pipelines for the suites that need a whole model (decoding, quant, scheduler, model):
the plugin under test resolved into a pipeline on the tiny model, installed or given only as
a class; and the engine's admission rules, which every suite applies to its requests before
running them (a request the engine would refuse is a skip with the engine's reason, never a
failure)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tessellm.core.plugin import SelectionContext
from tessellm.testing.conformance.base import ConformanceSuite


def registry_for(suite: type[ConformanceSuite]) -> Any:
    """The registry a pipeline under test resolves against: the installed one when the plugin
    is installed, else a fresh one with the suite's ``plugin_class`` registered as if by its
    own package (so a plugin defined in a test runs in a real pipeline)."""
    import tessellm
    from tessellm.core.registry import PluginRegistry, get_registry

    cls = suite.under_test()
    installed = get_registry().get(suite.kind, cls.name)
    if installed is not None and installed.cls is cls:
        return get_registry()
    if installed is not None:
        pytest.fail(f"{suite.label()}: plugin_class {cls.__qualname__} shares the name {cls.name!r} with an "
                    f"installed {suite.kind} plugin; give it a name of its own")

    @tessellm.hookimpl
    def hook(register: Callable[[type], None]) -> None:
        register(cls)

    registry = PluginRegistry()
    registry.add_module(types.SimpleNamespace(**{f"register_{suite.kind}": hook}), package="conformance",
                        source=f"{suite.kind}.{cls.name}")
    if registry.get(suite.kind, cls.name) is None:
        pytest.fail(f"{suite.label()} could not be registered: "
                    + "; ".join(str(f) for f in registry.failures))
    return registry


def selection_context(suite: type[ConformanceSuite], model_dir: Path, engine: dict[str, Any]) -> SelectionContext:
    """What the plugin under test is shown when asked whether it serves the suite's pipeline."""
    from tessellm.core.model.loader import load_hf_config
    from tessellm.core.model.spec import ModelSpec
    from tessellm.core.resolve import DTYPES

    spec = ModelSpec.from_hf_config(load_hf_config(model_dir))
    return SelectionContext(device=torch.device(engine.get("device", "cpu")),
                            dtype=DTYPES[engine.get("dtype", "float32")], model=spec,
                            options=suite.plugin_options(), max_model_len=spec.max_position_embeddings)


def build_llm(suite: type[ConformanceSuite], model_dir: Path, engine: dict[str, Any], part: dict[str, Any]) -> Any:
    """An LLM on ``model_dir`` with ``engine``'s config pieces and ``part`` (the config section
    of the plugin under test), resolved against ``registry_for(suite)``."""
    from tessellm import LLM
    from tessellm.core.engine.pipeline import Pipeline

    config = {"model": str(model_dir), **engine, suite.kind: part}
    return LLM(pipeline=Pipeline.from_config(config, registry=registry_for(suite)))


def sequence_capacity(llm: Any) -> int:
    """The most tokens (prompt and output) one request may have in ``llm``'s pipeline: its
    context length, or less where its cache declares less (``max_seq_tokens``), less the
    decoder's draft slots. A property draws its requests within it."""
    pipeline = llm.pipeline
    return min(pipeline.resolved.max_model_len, pipeline.cache.max_seq_tokens) - pipeline.decoder.num_lookahead_tokens


def require_capacity(suite: type[ConformanceSuite], llm: Any, tokens: int, what: str) -> int:
    """``sequence_capacity(llm)``, after skipping the running property (saying why) when a
    request of ``tokens`` tokens does not fit."""
    capacity = sequence_capacity(llm)
    if capacity < tokens:
        pytest.skip(f"{suite.label()}: the pipeline holds {capacity} tokens per sequence; {what} needs {tokens}")
    return capacity


def admission_refusal(llm: Any, params: Any, prompt: list[int] | None = None) -> str | None:
    """Why ``llm``'s engine refuses a request of ``params`` (``SamplingParams``) on ``prompt``
    (default three tokens) when it arrives (``Engine.admit``: fields newer than the
    decoder's plugin API, its ``check`` and ``extra_args``, the logits processors'
    arguments, ...); None when it admits it."""
    from tessellm.core.errors import InvalidRequestError

    try:
        llm.engine.admit(list(prompt or [1, 2, 3]), params)
    except InvalidRequestError as exc:
        return str(exc)
    return None


def skip_unless_admitted(suite: type[ConformanceSuite], llm: Any, params: Any, prompt: list[int] | None = None) -> None:
    """Skip the running property, with the engine's reason, where ``llm``'s engine would
    refuse ``params`` at admission (``admission_refusal``)."""
    reason = admission_refusal(llm, params, prompt)
    if reason is not None:
        pytest.skip(f"{suite.label()}: the engine refuses {params.model_dump(exclude_defaults=True)} at "
                    f"admission, so the suite does not run it: {reason}")


def admitted_requests(suite: type[ConformanceSuite], llm: Any, requests: list[tuple]) -> list[tuple]:
    """The ``(arrival, prompt, params, ...)`` requests ``llm``'s engine admits; when it admits
    none, the running property is skipped with the engine's reason for the first."""
    kept = [r for r in requests if admission_refusal(llm, r[2], r[1]) is None]
    if requests and not kept:
        skip_unless_admitted(suite, llm, requests[0][2], requests[0][1])
    return kept
