"""The plugin registry: loads plugin modules from the ``tessellm`` entry-point group (the
built-in ones included) and keeps every registered plugin class by kind and name.

A module that fails to import, names an unknown hook, registers something that is not a
plugin, targets another plugin-API version (or states it as anything but a string), or
declares an option without a default is recorded as a ``LoadFailure`` with its
package and error; the rest keep working. Two packages registering the same kind and name
raise ``PluginConflictError`` naming both.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterable

import pluggy

from tessellm.core import hookspecs
from tessellm.core.errors import PluginConflictError, PluginLoadError
from tessellm.core.plugin import KINDS, Plugin, PluginOptions
from tessellm.core.version import api_minor, api_version_problem

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tessellm"
DISABLE_ENV = "TESSELLM_DISABLE_PLUGINS"
"""Comma-separated entry-point names (or distribution names) not to load."""
MODULES_ENV = "TESSELLM_PLUGINS"
"""Comma-separated importable modules of hookimpls to load besides the entry points (as
pytest's ``PYTEST_PLUGINS``): a plugin not installed as a package, in every process a run
starts (a server's engine core, data-parallel replicas)."""


@dataclass(frozen=True)
class PluginEntry:
    """A registered plugin class and where it came from."""

    cls: type[Plugin]
    package: str  # distribution name, or the module for plugins registered by hand

    @property
    def kind(self) -> str:
        return self.cls.kind

    @property
    def name(self) -> str:
        return self.cls.name

    def describe(self) -> dict[str, Any]:
        return {**self.cls.describe(), "package": self.package}


@dataclass(frozen=True)
class LoadFailure:
    """A plugin module that could not be loaded."""

    source: str  # entry point or module name
    package: str
    error: str

    def __str__(self) -> str:
        return f"plugin {self.source!r} from package {self.package!r} failed to load: {self.error}"


def _base_class(kind: str) -> type[Plugin]:
    from tessellm.core.interfaces.attention import AttentionBackend
    from tessellm.core.interfaces.cache import CacheManager
    from tessellm.core.interfaces.decoder import Decoder
    from tessellm.core.interfaces.grammar import GrammarBackend
    from tessellm.core.interfaces.logits import LogitsProcessor
    from tessellm.core.interfaces.lora import LoraKernel
    from tessellm.core.interfaces.model import ModelArchitecture
    from tessellm.core.interfaces.pooling import Pooler
    from tessellm.core.interfaces.quantizer import Quantizer
    from tessellm.core.interfaces.routing import RoutingPolicy
    from tessellm.core.interfaces.scheduler import Scheduler

    return {"attention": AttentionBackend, "cache": CacheManager, "scheduler": Scheduler,
            "decoding": Decoder, "quant": Quantizer, "grammar": GrammarBackend, "model": ModelArchitecture,
            "logits": LogitsProcessor, "lora": LoraKernel, "routing": RoutingPolicy, "pooling": Pooler}[kind]


HOOK_NAMES = tuple(f"register_{kind}" for kind in KINDS)


def _hook_problem(module: object) -> str | None:
    """A hook an author meant to write but pluggy would miss: a ``register_<kind>`` function
    without ``@tessellm.hookimpl`` (never called), or a marked function whose name is close to
    a hook's (a typo pluggy reports without a suggestion)."""
    marker = f"{hookspecs.PROJECT}_impl"
    for attr in dir(module):
        value = getattr(module, attr, None)
        if not callable(value) or isinstance(value, type):
            continue
        marked = hasattr(value, marker)
        if attr in HOOK_NAMES and not marked:
            return (f"{attr} is not decorated with @tessellm.hookimpl, so tessellm never calls it and its "
                    f"plugins are not registered; add @tessellm.hookimpl above it")
        if marked and attr not in HOOK_NAMES:
            close = difflib.get_close_matches(attr, HOOK_NAMES, n=1)
            hint = f"did you mean {close[0]}?" if close else f"the hooks are {', '.join(HOOK_NAMES)}"
            return f"{attr} is marked @tessellm.hookimpl but is no tessellm hook; {hint}"
    return None


REQUIRED_OPTIONS_REFUSED_SINCE = 7
"""The plugin-API minor version from which an Options field without a default is a load
failure (a plugin written for an older one keeps loading, with a warning)."""


def _options_problem(cls: type[Plugin]) -> str | None:
    """Why the plugin's ``Options`` cannot serve as its options model, or None: it must
    subclass ``tessellm.PluginOptions`` (which rejects unknown keys), every field must have a
    default (a config that names the plugin without options must be valid), and the defaults
    must validate against their own declared types (else every user would be blamed for them)."""
    options = cls.Options
    if not (isinstance(options, type) and issubclass(options, PluginOptions)):
        return (f"Options is {options!r}; it must be a subclass of tessellm.PluginOptions (a pydantic model "
                f"that rejects misspelt option names)")
    required = [name for name, field in options.model_fields.items() if field.is_required()]
    if required and api_minor(cls.api_version) < REQUIRED_OPTIONS_REFUSED_SINCE:
        logger.warning("%s plugin %r: its Options field(s) %s have no default, so a config naming it without "
                       "options fails; plugin API 1.%d refuses such a plugin at load", cls.kind, cls.name,
                       ", ".join(map(repr, required)), REQUIRED_OPTIONS_REFUSED_SINCE)
        return None  # written when required options were allowed: it keeps loading
    if required:
        return (f"its Options field{'s' if len(required) > 1 else ''} {', '.join(map(repr, required))} "
                f"{'have' if len(required) > 1 else 'has'} no default; every option needs one (Field(default, ...)), "
                f"so that a config giving no options is valid")
    # pydantic does not validate defaults: validate them as if a user had given them
    defaults = {name: field.get_default(call_default_factory=True) for name, field in options.model_fields.items()}
    try:
        options.model_validate(defaults)
    except Exception as exc:
        return f"its Options' defaults do not validate against their own declared types: {exc}"
    return None


def _unimplemented(base: type[Plugin], cls: type[Plugin]) -> str | None:
    """Which of its interface's ``required`` methods the plugin class leaves as the base's
    (a model plugin without ``build`` fails here, not with a traceback when a pipeline loads)."""
    missing = [m for m in getattr(base, "required", ()) if getattr(cls, m) is getattr(base, m)]
    if missing:
        return f"it does not implement {', '.join(missing)} (required of every {cls.kind} plugin)"
    return None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' when ``name`` is close to one of ``choices``, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class PluginRegistry:
    """Every plugin of every kind, keyed by (kind, name)."""

    def __init__(self, *, entry_points: bool = True, modules: Iterable[ModuleType | object] = ()):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._plugins: dict[str, dict[str, PluginEntry]] = {k: {} for k in KINDS}
        self.failures: list[LoadFailure] = []
        if entry_points:
            self._load_entry_points()
            self._load_env_modules()
        for module in modules:
            self.add_module(module, package=getattr(module, "__name__", repr(module)))

    # ------------------------------------------------------------------ loading

    def _load_entry_points(self) -> None:
        disabled = {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}
        conflicts: list[str] = []
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            package = ep.dist.name if ep.dist is not None else "unknown"
            if ep.name in disabled or package in disabled:
                continue
            try:
                module = ep.load()
            except Exception as exc:  # any import-time error of a third-party plugin
                self.failures.append(LoadFailure(ep.name, package, f"{type(exc).__name__}: {exc}"))
                continue
            try:
                self.add_module(module, package=package, source=ep.name)
            except PluginConflictError as exc:  # every clash is reported at once, not one per fix
                conflicts.append(str(exc))
        if len(conflicts) == 1:
            raise PluginConflictError(conflicts[0])
        if conflicts:
            raise PluginConflictError(f"{len(conflicts)} plugin name clashes: " + " | ".join(conflicts))

    def _load_env_modules(self) -> None:
        for name in (s.strip() for s in os.environ.get(MODULES_ENV, "").split(",")):
            if not name:
                continue
            try:
                module = importlib.import_module(name)
            except Exception as exc:  # as an entry point that fails to import: recorded, the rest load
                self.failures.append(LoadFailure(name, MODULES_ENV, f"{type(exc).__name__}: {exc}"))
                continue
            if not self.pm.is_registered(module):
                self.add_module(module, package=MODULES_ENV, source=name)

    def add_module(self, module: ModuleType | object, *, package: str, source: str | None = None) -> None:
        """Register a module (or object) of hookimpls and the plugin classes its hooks register."""
        source = source or getattr(module, "__name__", repr(module))
        problem = _hook_problem(module)
        if problem:
            self.failures.append(LoadFailure(source, package, problem))
            return
        try:
            # entry-point names are unique only within a package: qualify them
            self.pm.register(module, name=f"{package}:{source}")
            self.pm.check_pending()  # a hookimpl named after no hook spec fails here
        except Exception as exc:
            if self.pm.is_registered(module):
                self.pm.unregister(module)
            self.failures.append(LoadFailure(source, package, f"{type(exc).__name__}: {exc}"))
            return
        pending: list[PluginEntry] = []
        try:
            for kind in KINDS:
                for impl in getattr(self.pm.hook, f"register_{kind}").get_hookimpls():
                    if impl.plugin is module:
                        impl.function(register=lambda cls, kind=kind: pending.append(self._check(kind, cls, package)))
        except PluginLoadError as exc:
            self.pm.unregister(module)
            self.failures.append(LoadFailure(source, package, str(exc)))
            return
        except Exception as exc:
            self.pm.unregister(module)
            self.failures.append(LoadFailure(source, package, f"{type(exc).__name__}: {exc}"))
            return
        seen: set[type] = set()
        for entry in pending:
            if entry.cls in seen:
                self.pm.unregister(module)
                self.failures.append(LoadFailure(source, package, f"{entry.kind} plugin {entry.name!r} "
                                                 f"({entry.cls.__qualname__}) is registered twice by this module; "
                                                 f"call register() once per class"))
                return
            seen.add(entry.cls)
        for entry in pending:
            self._add(entry)

    @staticmethod
    def _check(kind: str, cls: Any, package: str) -> PluginEntry:
        base = _base_class(kind)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PluginLoadError(f"register_{kind} was given {cls!r}, which is not a subclass of {base.__name__}")
        name = cls.__dict__.get("name")  # its own: a subclass must not pass as its parent
        if not isinstance(name, str) or not name or name == "auto":
            raise PluginLoadError(f"{kind} plugin {cls.__qualname__} must set its own class attribute name "
                                  f"(a non-empty string other than 'auto'; it is not inherited)")
        problem = api_version_problem(cls.__dict__.get("api_version"))
        if problem:
            raise PluginLoadError(f"{kind} plugin {name!r}: {problem}")
        problem = _options_problem(cls) or _unimplemented(base, cls)
        if problem:
            raise PluginLoadError(f"{kind} plugin {name!r}: {problem}")
        return PluginEntry(cls, package)

    def _add(self, entry: PluginEntry) -> None:
        existing = self._plugins[entry.kind].get(entry.name)
        if existing is not None and existing.cls is not entry.cls:
            raise PluginConflictError(
                f"{entry.kind} plugin {entry.name!r} is registered twice: by package {existing.package!r} "
                f"({existing.cls.__module__}.{existing.cls.__qualname__}) and by package {entry.package!r} "
                f"({entry.cls.__module__}.{entry.cls.__qualname__}); uninstall one or disable it with "
                f"{DISABLE_ENV}=<entry point name>")
        self._plugins[entry.kind][entry.name] = entry

    # ------------------------------------------------------------------ queries

    def names(self, kind: str) -> list[str]:
        return sorted(self._plugins[kind])

    def get(self, kind: str, name: str) -> PluginEntry | None:
        return self._plugins[kind].get(name)

    def entries(self, kind: str | None = None) -> list[PluginEntry]:
        kinds = [kind] if kind else list(KINDS)
        return [self._plugins[k][n] for k in kinds for n in sorted(self._plugins[k])]

    def auto_order(self, kind: str) -> list[PluginEntry]:
        """Candidates for ``auto``: plugins with an ``auto_priority``, highest first, then by name."""
        ranked = [e for e in self._plugins[kind].values() if e.cls.auto_priority is not None]
        return sorted(ranked, key=lambda e: (-e.cls.auto_priority, e.name))

    def model_types(self) -> dict[str, list[str]]:
        """Every Hugging Face model_type a model plugin builds -> those plugins' names, in
        ``auto`` order."""
        served: dict[str, list[str]] = {}
        for entry in self.auto_order("model") + [e for e in self.entries("model") if e.cls.auto_priority is None]:
            for model_type in entry.cls.model_types:
                served.setdefault(model_type, []).append(entry.name)
        return dict(sorted(served.items()))

    def architecture_for(self, hf_config: Any, name: str = "auto", options: dict[str, Any] | None = None) -> Any:
        """The model plugin (an instance, with ``options``) that builds ``hf_config``: the one
        named, which must declare its model_type (or take any, ``any_model_type``), or under
        ``auto`` the first in priority order that declares it, else the first that takes any
        type (logged). A ModelLoadError lists the supported model types and how to add one."""
        return self._instantiate(self._model_candidates(hf_config, name)[0], options)

    def model_for(self, hf_config: Any, name: str = "auto", options: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """(the model plugin, its ``load_spec(hf_config)``): as ``architecture_for``, and under
        ``auto`` a checkpoint the plugin declaring its type refuses (a variant it does not
        build) goes to a plugin taking any type, saying so; if that refuses too, the error
        gives both reasons."""
        from tessellm.core.errors import ModelLoadError

        candidates = self._model_candidates(hf_config, name)
        refusals: list[str] = []
        for entry in candidates:
            architecture = self._instantiate(entry, options)
            try:
                spec = architecture.load_spec(hf_config)
            except ModelLoadError as exc:
                if entry is candidates[-1]:
                    if refusals:
                        raise ModelLoadError("; ".join([*refusals, f"model plugin {architecture.name!r}: {exc}"])) \
                            from exc
                    raise
                refusals.append(f"model plugin {architecture.name!r}: {exc}")
                continue
            if refusals:
                logger.info("model_type %r: %s; serving it with model plugin %r instead",
                            getattr(hf_config, "model_type", None), "; ".join(refusals), architecture.name)
            return architecture, spec
        raise AssertionError("no candidates")  # _model_candidates returns at least one

    def _model_candidates(self, hf_config: Any, name: str) -> list[PluginEntry]:
        """The model plugins to try for ``hf_config``, in order: the one named; under ``auto``
        the best declaring its type, then (or only) the first taking any type."""
        from tessellm.core.errors import ConfigError, ModelLoadError

        model_type = getattr(hf_config, "model_type", None)
        if name == "auto":
            ranked = [e for e in self.auto_order("model") if model_type in e.cls.model_types][:1]
            fallback = [e for e in self.auto_order("model") if getattr(e.cls, "any_model_type", False)][:1]
            if not ranked and fallback:
                logger.info("model_type %r: no model plugin declares it; model plugin %r runs transformers' own model "
                            "code for it, with tessellm's attention and cache", model_type, fallback[0].name)
            ranked += [e for e in fallback if e not in ranked]
            if not ranked:
                served = ", ".join(self.model_types()) or "none (no model plugin is installed)"
                failures = "".join(f"; note: {f}" for f in self.failures if f.source.startswith("model."))
                raise ModelLoadError(
                    f"model_type {model_type!r} is not supported; supported: {served}. To add an architecture, "
                    f"write a model plugin (`tessellm new-plugin model NAME`, docs/plugins.md 'Writing a model "
                    f"plugin') declaring model_types = ({model_type!r},){failures}")
        else:
            entry = self.get("model", name)
            if entry is None:
                raise ConfigError(f"architecture.name: unknown model plugin {name!r}"
                                  f"{did_you_mean(name, self.names('model'))}; valid choices: "
                                  f"{', '.join(['auto', *self.names('model')])}")
            if model_type not in entry.cls.model_types and not getattr(entry.cls, "any_model_type", False):
                raise ConfigError(f"architecture.name: model plugin {name!r} builds model types "
                                  f"{', '.join(entry.cls.model_types) or '(none)'}, not this checkpoint's "
                                  f"{model_type!r}")
            ranked = [entry]
        return ranked

    @staticmethod
    def _instantiate(entry: PluginEntry, options: dict[str, Any] | None) -> Any:
        from tessellm.core.errors import ConfigError

        try:
            opts = entry.cls.Options.model_validate(options or {})
        except Exception as exc:  # pydantic's ValidationError
            raise ConfigError(f"architecture.options: invalid for model plugin {entry.name!r}: {exc}") from None
        return entry.cls(opts)

    def failures_for(self, kind: str, name: str) -> list[LoadFailure]:
        """Load failures that may explain a missing plugin (same name in the entry point)."""
        return [f for f in self.failures if f.source in (f"{kind}.{name}", name) or f.source.endswith(f".{name}")]


_default: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry, loaded on first use."""
    global _default
    if _default is None:
        _default = PluginRegistry()
    return _default
