"""What every kind's conformance suite shares: which plugin is under test, its validated
options, skipping a case the plugin declares unsupported (with the plugin's own reasons),
and counting the cases each property tried (``tessellm plugins --check`` prints them)."""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar, Iterator

import pytest

from tessellm.core.plugin import Plugin, PluginOptions, SelectionContext


def property_settings(**overrides: Any) -> Any:
    """Hypothesis settings for a conformance property: no deadline (kernels compile or run
    interpreted on first use), the slow-data health checks off; the number of examples and
    the randomness come from the profile loaded (a CI profile should derandomize)."""
    from hypothesis import HealthCheck, settings

    if "max_examples" in overrides:  # a cap: a profile loaded with fewer (plugins --check --examples) lowers it
        overrides["max_examples"] = min(overrides["max_examples"], settings().max_examples)
    # differing_executors: one inherited property runs under each subclass of a suite
    return settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture,
                                                          HealthCheck.differing_executors], **overrides)


def example_budget() -> int:
    """The cases a property may run under the loaded hypothesis profile (``--examples`` in a
    check): what bounds a property that loops over a list of its own (``spread`` it)."""
    from hypothesis import settings

    return settings().max_examples


def spread(count: int, keep: int) -> list[int]:
    """``keep`` indices of ``range(count)`` spread evenly, first and last included (all of
    them when ``keep >= count``): a deterministic sample of a list."""
    if keep >= count:
        return list(range(count))
    if keep <= 1:
        return [0][:keep]
    return sorted({round(i * (count - 1) / (keep - 1)) for i in range(keep)})


CASES: Counter[str] = Counter()
"""Cases tried per test node id, across the session (hypothesis examples and parameters)."""


class ConformanceSuite:
    """Base of the per-kind suites. A subclass names the plugin under test:

    - ``plugin``: its name, as a config selects it (looked up among installed plugins), or
    - ``plugin_class``: the class itself (a plugin not installed, e.g. one defined in a test);
    - ``options``: the options it is tested with (validated by its ``Options`` model).

    A property that needs a capability the plugin does not declare (a head dim, a device, a
    cache format) is skipped with the reasons the plugin's own ``unsupported_reasons`` gives,
    never passed silently. The suites are written against the interfaces alone: a plugin
    that passes its kind's suite honours the contract the engine relies on.
    """

    kind: ClassVar[str]
    plugin: ClassVar[str | None] = None
    plugin_class: ClassVar[type[Plugin] | None] = None
    options: ClassVar[dict[str, Any]] = {}

    torch_threads: ClassVar[int | None] = 1
    """CPU threads torch uses while the suite runs (restored after it): the suites' tensors
    are far too small to share among threads, which on a busy machine only wait for each
    other. None leaves torch's setting alone."""

    @pytest.fixture(autouse=True)
    def _conformance_node(self, request: pytest.FixtureRequest) -> None:
        self._node_id = request.node.nodeid

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _torch_threads(cls) -> Iterator[None]:
        import torch

        threads = torch.get_num_threads()
        if cls.torch_threads is not None:
            torch.set_num_threads(cls.torch_threads)
        yield
        torch.set_num_threads(threads)

    def case(self) -> None:
        """Count one case of the running property (call once per hypothesis example)."""
        CASES[getattr(self, "_node_id", "?")] += 1

    @classmethod
    def under_test(cls) -> type[Plugin]:
        """The plugin class under test; a clear failure when it cannot be found."""
        if cls.plugin_class is not None:
            if cls.plugin_class.kind != cls.kind:
                pytest.fail(f"{cls.__name__} checks {cls.kind} plugins, but plugin_class "
                            f"{cls.plugin_class.__qualname__} is a {cls.plugin_class.kind} plugin")
            return cls.plugin_class
        if not cls.plugin:
            pytest.fail(f"{cls.__name__}: set the class attribute plugin (the {cls.kind} plugin's name) "
                        f"or plugin_class")
        from tessellm.core.registry import get_registry

        registry = get_registry()
        entry = registry.get(cls.kind, cls.plugin)
        if entry is None:
            failures = "; ".join(str(f) for f in registry.failures_for(cls.kind, cls.plugin))
            pytest.fail(f"no installed {cls.kind} plugin named {cls.plugin!r} (installed: "
                        f"{', '.join(registry.names(cls.kind)) or 'none'})" + (f"; {failures}" if failures else ""))
        return entry.cls

    @classmethod
    def plugin_options(cls) -> PluginOptions:
        """``options`` validated by the plugin's ``Options`` model."""
        plugin = cls.under_test()
        try:
            return plugin.Options.model_validate(cls.options)
        except Exception as exc:  # pydantic's ValidationError, or a broken Options
            pytest.fail(f"{cls.kind} plugin {plugin.name!r}: options {cls.options!r} are invalid: {exc}")

    @classmethod
    def require(cls, ctx: SelectionContext, case: str) -> None:
        """Skip the running test, with the plugin's reasons, when it cannot serve ``ctx``."""
        plugin = cls.under_test()
        reasons = plugin.unsupported_reasons(ctx)
        if reasons:
            pytest.skip(f"{cls.kind} plugin {plugin.name!r} declares {case} unsupported: {'; '.join(reasons)}")

    @classmethod
    def label(cls) -> str:
        plugin = cls.plugin_class.name if cls.plugin_class is not None else cls.plugin
        return f"{cls.kind} plugin {plugin!r}"
