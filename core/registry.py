"""The plugin registry: loads plugin modules from the ``tessellm`` entry-point group (the
built-in ones included) and keeps every registered plugin class by kind and name.

A module that fails to import, names an unknown hook, registers something that is not a
plugin, or targets another plugin-API version is recorded as a ``LoadFailure`` with its
package and error; the rest keep working. Two packages registering the same kind and name
raise ``PluginConflictError`` naming both.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterable

import pluggy

from tessellm.core import hookspecs
from tessellm.core.errors import PluginConflictError, PluginLoadError
from tessellm.core.plugin import KINDS, Plugin
from tessellm.core.version import api_version_problem

ENTRY_POINT_GROUP = "tessellm"
DISABLE_ENV = "TESSELLM_DISABLE_PLUGINS"
"""Comma-separated entry-point names (or distribution names) not to load."""


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
    from tessellm.core.interfaces.quantizer import Quantizer
    from tessellm.core.interfaces.scheduler import Scheduler

    return {"attention": AttentionBackend, "cache": CacheManager, "scheduler": Scheduler,
            "decoding": Decoder, "quant": Quantizer}[kind]


class PluginRegistry:
    """Every plugin of every kind, keyed by (kind, name)."""

    def __init__(self, *, entry_points: bool = True, modules: Iterable[ModuleType | object] = ()):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._plugins: dict[str, dict[str, PluginEntry]] = {k: {} for k in KINDS}
        self.failures: list[LoadFailure] = []
        if entry_points:
            self._load_entry_points()
        for module in modules:
            self.add_module(module, package=getattr(module, "__name__", repr(module)))

    # ------------------------------------------------------------------ loading

    def _load_entry_points(self) -> None:
        disabled = {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            package = ep.dist.name if ep.dist is not None else "unknown"
            if ep.name in disabled or package in disabled:
                continue
            try:
                module = ep.load()
            except Exception as exc:  # any import-time error of a third-party plugin
                self.failures.append(LoadFailure(ep.name, package, f"{type(exc).__name__}: {exc}"))
                continue
            self.add_module(module, package=package, source=ep.name)

    def add_module(self, module: ModuleType | object, *, package: str, source: str | None = None) -> None:
        """Register a module (or object) of hookimpls and the plugin classes its hooks register."""
        source = source or getattr(module, "__name__", repr(module))
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
