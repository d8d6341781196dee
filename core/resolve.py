"""Validate-then-select: turn a ``PipelineConfig`` into concrete plugin classes and options.

Every named plugin must exist and accept its options; every chosen plugin is asked for the
reasons it cannot serve this pipeline. ``auto`` takes the first plugin in priority order
(``tessellm plugins`` shows it) with no reasons, given the choices for the other kinds; a
plugin named explicitly that has reasons fails with them, never falling back to another.
Kinds are chosen in the order quant, cache, attention, scheduler, decoding, grammar, lora, so a later kind
sees the earlier choices (an attention backend sees the cache's layout); a named attention
backend's ``kv_extras`` reach the cache first, so its layout can include them. A pipeline
may do without an optional kind (``OPTIONAL_KINDS``: grammar, lora, pooling) that ``auto`` finds no plugin
for; a pooler is chosen by what the checkpoint's files say (``CheckpointPooling``, passed in).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.config import PipelineConfig
from tessellm.core.errors import ConfigError
from tessellm.core.model.spec import ModelSpec
from tessellm.core.plugin import OPTIONAL_KINDS, PluginOptions, SelectionContext
from tessellm.core.registry import PluginEntry, PluginRegistry, did_you_mean

ORDER = ("quant", "cache", "attention", "scheduler", "decoding", "grammar", "lora", "pooling")
logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class Choice:
    """The plugin chosen for one kind."""

    entry: PluginEntry
    options: PluginOptions

    @property
    def cls(self) -> type:
        return self.entry.cls


@dataclass
class ResolvedPipeline:
    """A config with everything decided: device, dtype, length limit and one plugin per kind."""

    config: PipelineConfig
    device: torch.device
    dtype: torch.dtype
    model: ModelSpec
    max_model_len: int
    choices: dict[str, Choice] = field(default_factory=dict)
    kv_layout: KVLayout | None = None
    pooling: Any = None
    """What the checkpoint says about pooling (a ``CheckpointPooling``), None where not read."""

    @property
    def async_scheduling(self) -> bool:
        """The config's ``async_scheduling``; unset (None), on where the device is CUDA."""
        chosen = self.config.async_scheduling
        return chosen if chosen is not None else self.device.type == "cuda"

    def summary(self) -> dict[str, Any]:
        one_rank = self.config.parallel.tensor == self.config.parallel.pipeline == 1
        return {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "max_model_len": self.max_model_len,
                "async_scheduling": self.async_scheduling and one_rank,
                "parallel": self.config.parallel.model_dump(),
                "architecture": self.model.architecture,
                **{k: {"name": c.entry.name, "options": c.options.model_dump()} for k, c in self.choices.items()}}


def resolve_device(value: str) -> torch.device:
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(value)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {value!r} requested but CUDA is not available here; use cpu or auto")
    return device


def resolve_dtype(value: str, device: torch.device) -> torch.dtype:
    if value == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[value]


def _validate_options(kind: str, entry: PluginEntry, raw: dict[str, Any]) -> PluginOptions:
    try:
        return entry.cls.Options.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                allowed = ", ".join(entry.cls.Options.model_fields) or "none"
                problems.append(f"{kind}.options.{loc}: {entry.name!r} has no such option; allowed: {allowed}")
            else:
                problems.append(f"{kind}.options.{loc}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("; ".join(problems)) from None


def _candidates(kind: str, config: PipelineConfig, registry: PluginRegistry) -> list[PluginEntry]:
    name = config.section(kind).name
    if name == "auto":
        ranked = registry.auto_order(kind)
        if not ranked and kind in OPTIONAL_KINDS:
            return []
        if not ranked:
            raise ConfigError(f"{kind}.name: auto, but no registered {kind} plugin takes part in auto "
                              f"selection; name one of: {', '.join(registry.names(kind)) or '(none registered)'}")
        return ranked
    entry = registry.get(kind, name)
    if entry is None:
        hint = "".join(f"; note: {f}" for f in registry.failures_for(kind, name))
        raise ConfigError(f"{kind}.name: unknown {kind} plugin {name!r}{did_you_mean(name, registry.names(kind))}; "
                          f"valid choices: {', '.join(['auto', *registry.names(kind)])}{hint}")
    return [entry]


def precheck(config: PipelineConfig, registry: PluginRegistry) -> dict[str, list[PluginEntry]]:
    """What can be checked without the model: device, plugin names, and the options of every
    plugin named explicitly (so a typo is reported as such, before a model is loaded).
    Returns the candidates per kind."""
    resolve_device(config.device)
    candidates = {kind: _candidates(kind, config, registry) for kind in ORDER}
    name = config.architecture.name
    if name != "auto" and registry.get("model", name) is None:
        raise ConfigError(f"architecture.name: unknown model plugin {name!r}{did_you_mean(name, registry.names('model'))}; "
                          f"valid choices: {', '.join(['auto', *registry.names('model')])}")
    for kind in ORDER:
        if config.section(kind).name != "auto":
            _validate_options(kind, candidates[kind][0], config.section(kind).options)
    return candidates


def resolve(config: PipelineConfig, registry: PluginRegistry, model: ModelSpec, pooling: Any = None) -> ResolvedPipeline:
    """Choose a plugin for every kind, or raise ConfigError naming the field and the reasons;
    ``pooling``: what the checkpoint says about pooling (a ``CheckpointPooling``)."""
    candidates = precheck(config, registry)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    limit = model.max_position_embeddings
    max_len = config.max_model_len or limit
    if max_len > limit:
        raise ConfigError(f"max_model_len: {max_len} exceeds the model's max_position_embeddings ({limit})")
    resolved = ResolvedPipeline(config, device, dtype, model, max_len, pooling=pooling)
    _choose(0, resolved, candidates, registry)
    return resolved


def _requested_extras(config: PipelineConfig, candidates: dict[str, list[PluginEntry]]) -> frozenset[str]:
    """The cache side data a named attention backend asks for (``kv_extras``); none under
    ``auto``, where every candidate must read a plain layout."""
    if config.section("attention").name == "auto":
        return frozenset()
    return frozenset(getattr(candidates["attention"][0].cls, "kv_extras", frozenset()))


def _choose(depth: int, resolved: ResolvedPipeline, candidates: dict[str, list[PluginEntry]],
            registry: PluginRegistry) -> None:
    if depth == len(ORDER):
        return
    kind = ORDER[depth]
    section = resolved.config.section(kind)
    rejected: list[str] = []
    downstream: ConfigError | None = None
    for entry in candidates[kind]:
        try:
            options = _validate_options(kind, entry, section.options)
        except ConfigError as exc:
            rejected.append(f"{entry.name}: {exc}")
            continue
        ctx = SelectionContext(device=resolved.device, dtype=resolved.dtype, model=resolved.model, options=options,
                               max_model_len=resolved.max_model_len, kv_layout=resolved.kv_layout,
                               chosen={k: (c.cls, c.options) for k, c in resolved.choices.items()},
                               auto=section.name == "auto", config=resolved.config,
                               kv_extras=_requested_extras(resolved.config, candidates), pooling=resolved.pooling)
        reasons = entry.cls.unsupported_reasons(ctx)
        if reasons:
            rejected.append(f"{entry.name}: {'; '.join(reasons)}")
            continue
        resolved.choices[kind] = Choice(entry, options)
        saved_layout = resolved.kv_layout
        if kind == "cache":
            resolved.kv_layout = entry.cls.kv_layout(options, ctx)
        try:
            _choose(depth + 1, resolved, candidates, registry)
            return
        except ConfigError as exc:
            downstream = downstream or exc
            del resolved.choices[kind]
            resolved.kv_layout = saved_layout
    if downstream is not None:
        raise downstream
    if section.name == "auto" and kind in OPTIONAL_KINDS:  # the pipeline runs without one
        logger.info("%s.name: auto found no %s plugin that can serve (%s); requests that need one are refused",
                    kind, kind, " | ".join(rejected) or "none installed")
        _choose(depth + 1, resolved, candidates, registry)
        return
    if section.name == "auto":
        raise ConfigError(f"{kind}.name: auto found no {kind} plugin that can serve this pipeline ("
                          + " | ".join(rejected) + ")")
    raise ConfigError(f"{kind}.name: {section.name!r} cannot serve this pipeline: "
                      + rejected[0].split(": ", 1)[1])


def model_dir_for(config: PipelineConfig) -> Path:
    """The Hugging Face folder holding ``config.model`` (converting a GGUF once)."""
    from tessellm.core.model.loader import model_folder, resolve_model

    cache_dir = Path(config.model_cache_dir).expanduser() if config.model_cache_dir else None
    return model_folder(resolve_model(config.model), cache_dir)
