"""Import paths of tessellm 0.1's flat layout, kept working for plugins written against them.

Plugin API 1.x promises that a plugin written for 1.0 installs and runs unchanged, and its
modules import from paths such as ``tessellm.core.attention`` or
``tessellm.plugins.cache.block_pool``. Each such path is served by a module made on import
whose names resolve, lazily, to where they live now; importing it warns with a
DeprecationWarning naming the new home. ``tessellm.core.engine`` and ``tessellm.core.model``,
once modules and now packages, hand out their old names the same way. New code imports from
``tessellm`` (plugin authors) or from the new modules.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Callable

MOVED: dict[str, tuple[str, ...]] = {
    "tessellm.core.attention": ("tessellm.core.interfaces.attention",),
    "tessellm.core.cache": ("tessellm.core.interfaces.cache", "tessellm.core.interfaces.kv"),
    "tessellm.core.kv_storage": ("tessellm.core.interfaces.kv",),
    "tessellm.core.scheduler": ("tessellm.core.interfaces.scheduler",),
    "tessellm.core.decoding": ("tessellm.core.interfaces.decoder",),
    "tessellm.core.quant": ("tessellm.core.interfaces.quantizer",),
    "tessellm.core.batch": ("tessellm.core.interfaces.batch", "tessellm.core.engine.batch_builder"),
    "tessellm.core.sequence": ("tessellm.core.interfaces.sequence",),
    "tessellm.core.llm": ("tessellm.core.engine.llm", "tessellm.core.engine.pipeline"),
    "tessellm.core.heap": ("tessellm.core.engine.gc_freeze",),
    "tessellm.core.model_spec": ("tessellm.core.model.spec",),
    "tessellm.core.model_loader": ("tessellm.core.model.loader",),
    "tessellm.core.model_runner": ("tessellm.core.model.runner", "tessellm.core.model.loader"),
    "tessellm.core.cuda_graphs": ("tessellm.core.model.cuda_graphs",),
    "tessellm.core.fused_ops": ("tessellm.core.model.fused_ops", "tessellm.plugins.attention.flash.rope_store"),
    "tessellm.core.kernel_builds": ("tessellm.core.model.kernel_builds",),
    "tessellm.core.cli": ("tessellm.cli",),
    "tessellm.core.server": ("tessellm.serve.app",),
    "tessellm.core.async_engine": ("tessellm.serve.engine_thread",),
    "tessellm.core.server_metrics": ("tessellm.serve.metrics",),
    "tessellm.core.openai_schema": ("tessellm.serve.schema",),
    "tessellm.core.bench": ("tessellm.bench.offline", "tessellm.bench.plots"),
    "tessellm.core.bench_serve": ("tessellm.bench.serving",),
    "tessellm.core.bench_workloads": ("tessellm.bench.workloads",),
    "tessellm.core.ab": ("tessellm.bench.ab", "tessellm.bench.plots"),
    "tessellm.core.hf_baseline": ("tessellm.bench.hf_baseline",),
    "tessellm.plugins.attention.flash_kernels": ("tessellm.plugins.attention.flash.prefill",
                                                 "tessellm.plugins.attention.flash.decode",
                                                 "tessellm.plugins.attention.flash.common"),
    "tessellm.plugins.cache.block_pool": ("tessellm.plugins.cache.paged.block_pool",),
    "tessellm.core.model.llama": ("tessellm.core.model.decoder",),
    "tessellm.core.model.deepseek": ("tessellm.core.model.mla", "tessellm.core.model.moe",
                                     "tessellm.plugins.model.deepseek", "tessellm.core.model.decoder"),
}
"""Old module -> the modules its names now live in, searched in order."""

RENAMED: dict[str, str] = {"AsyncEngine": "EngineThread"}
"""Old names that changed along with their module."""

PACKAGES: dict[str, tuple[str, ...]] = {
    "tessellm.core.engine": ("tessellm.core.engine.engine", "tessellm.core.engine.request",
                             "tessellm.core.engine.stats"),
    "tessellm.core.model": ("tessellm.core.model.decoder",),
}
"""Old modules that are packages now: their old names, looked up in these modules."""


def _resolver(old: str, homes: tuple[str, ...]) -> Callable[[str], Any]:
    def resolve(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for home in homes:
            try:
                module = importlib.import_module(home)
            except ImportError:
                continue  # an app's home whose extra is missing: the name may be in the next one
            value = getattr(module, RENAMED.get(name, name), _MISSING)
            if value is not _MISSING:
                return value
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {', '.join(homes)})")

    return resolve


_MISSING = object()


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``MOVED``'s old modules (see the module docstring)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        homes = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} is deprecated: its names moved to {', '.join(homes)}; plugin authors "
                      f"import them from tessellm", DeprecationWarning, stacklevel=2)
        module.__getattr__ = _resolver(module.__name__, homes)  # type: ignore[attr-defined]


def package_getattr(package: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of a package that replaced a module of the same name."""
    resolve = _resolver(package, PACKAGES[package])

    def getattr_(name: str) -> Any:
        value = resolve(name)
        warnings.warn(f"{package}.{name} is deprecated: import it from {getattr(value, '__module__', package)} "
                      f"(plugin authors: from tessellm)", DeprecationWarning, stacklevel=2)
        setattr(sys.modules[package], name, value)  # warned once; later lookups find it
        return value

    return getattr_


def install() -> None:
    """Serve the old paths (idempotent)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
