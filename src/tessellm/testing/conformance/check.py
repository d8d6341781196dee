"""``tessellm plugins --check KIND:NAME``: run a kind's conformance suite on one installed
plugin, in this process, and report each property: cases tried, pass / fail / skip and why.

A plugin that does not load (or options it refuses) is one line, and no property runs. The
suite runs under pytest with a hypothesis profile of its own (no deadline, derandomized,
``examples`` cases a property), so a check repeats exactly; a parametrized property with
more parameter sets than ``examples`` runs ``examples`` of them, spread evenly over its
list. pytest's own output is shown only when ``verbose``; a failure is reported as its
one-line reason and hypothesis' shrunk case (with ``verbose``: the whole traceback)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUITES = {"attention": "AttentionConformance", "cache": "CacheConformance", "scheduler": "SchedulerConformance",
          "decoding": "DecodingConformance", "quant": "QuantConformance", "grammar": "GrammarConformance",
          "model": "ModelConformance", "logits": "LogitsConformance",
          "lora": "LoraConformance", "routing": "RoutingConformance", "pooling": "PoolingConformance"}
"""The conformance class of each kind, in tessellm.testing.conformance."""


@dataclass
class PropertyResult:
    """One property of the suite (a test, with its parameters) and how it went."""

    name: str
    cases: int
    outcome: str  # "pass", "fail" or "skip"
    detail: str = ""  # a skip's reason; a failure's message and hypothesis' shrunk case


@dataclass
class CheckReport:
    """Every property checked for one plugin; ``ok`` when none failed."""

    kind: str
    name: str
    options: dict[str, Any]
    results: list[PropertyResult] = field(default_factory=list)
    error: str = ""
    """Why nothing could be checked (the plugin does not load, its options are refused, the
    suite did not collect): one line; no property ran."""
    sampled: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Parametrized properties cut to ``examples`` parameter sets: name -> (run, of)."""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.results) and all(r.outcome != "fail" for r in self.results)

    def table(self) -> str:
        """The report as aligned text: one row a property, failures' details below (or the
        one line saying why nothing ran)."""
        if self.error:
            return f"{self.kind} plugin {self.name!r} cannot be checked: {self.error}"
        width = max([len(r.name) for r in self.results] + [8])
        lines = [f"{'property':<{width}}  {'cases':>5}  result",
                 *(f"{r.name:<{width}}  {r.cases:>5}  {r.outcome}" + (f": {r.detail}" if r.outcome == "skip" else "")
                   for r in self.results)]
        failed = [r for r in self.results if r.outcome == "fail"]
        if self.sampled:
            lines += ["", "parameter sets run (--examples): " + ", ".join(
                f"{name} {run} of {total}" for name, (run, total) in self.sampled.items())]
        for r in failed:
            lines += ["", f"FAILED {r.name}:", textwrap.indent(r.detail, "  ")]
        verdict = "passes" if self.ok else (f"fails {len(failed)} of {len(self.results)} properties" if failed
                                            else "ran no property")
        lines += ["", f"{self.kind} plugin {self.name!r} {verdict}"]
        return "\n".join(lines)


_TEST_FILE = '''\
import json
from tessellm.testing import conformance


class TestConformance(getattr(conformance, {suite!r})):
    plugin = {name!r}
    options = json.loads({options!r})
{settings}'''

_CONFTEST = '''\
from hypothesis import Phase, settings

from tessellm.testing.conformance.check import sample_parameter_sets

# no explain phase: it reruns a failing case many times to name the lines only failures run
settings.register_profile("tessellm-check", deadline=None, derandomize=True, max_examples={examples},
                          print_blob=False, phases=[p for p in Phase if p.name != "explain"])
settings.load_profile("tessellm-check")


def pytest_collection_modifyitems(config, items):
    sample_parameter_sets(config, items, {examples})
'''


SAMPLED: dict[str, tuple[int, int]] = {}
"""The last check's parametrized properties cut to ``examples`` parameter sets."""


def sample_parameter_sets(config: Any, items: list[Any], examples: int) -> None:
    """Keep at most ``examples`` parameter sets of each parametrized property (``spread``
    over its list, in collection order); deselect the rest."""
    from tessellm.testing.conformance.base import spread

    groups: dict[str, list[Any]] = {}
    for item in items:
        groups.setdefault(item.nodeid.split("[")[0], []).append(item)
    keep: set[int] = set()
    SAMPLED.clear()
    for base, group in groups.items():
        chosen = [group[i] for i in spread(len(group), max(examples, 1))] if "[" in group[0].nodeid else group
        keep.update(id(item) for item in chosen)
        if len(chosen) < len(group):
            SAMPLED[base.split("::")[-1]] = (len(chosen), len(group))
    dropped = [item for item in items if id(item) not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in keep]


class _Collector:
    """A pytest plugin gathering each test's outcome (its call phase, or the phase that
    skipped or failed first) and the first collection error."""

    def __init__(self) -> None:
        self.reports: dict[str, Any] = {}
        self.collect_error = ""

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.reports.setdefault(report.nodeid, report)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed and not self.collect_error:
            self.collect_error = _reason(report)


def _crash_message(report: Any) -> str:
    """The exception's message with hypothesis' notes (the shrunk case) below it."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    text = str(report.longrepr).strip()
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    if errors:
        return "\n".join(errors)
    return text.splitlines()[-1] if text else ""


def _reason(report: Any) -> str:
    """The failure's first line: the exception type and message."""
    lines = [line for line in _crash_message(report).splitlines() if line.strip()]
    return lines[0].strip() if lines else "failed (no message)"


def _shrunk_case(message: str) -> str:
    """Hypothesis' smallest failing case from its note ("Falsifying example: ...", or
    "Failing test case: ..." in newer releases), on one line; "" when there is none."""
    lines = message.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("Falsifying example", "Failing test case")):
            parts = [line.split(":", 1)[1].strip()]
            for following in lines[i + 1:]:
                if not following.strip() or following.startswith(("Explanation", "You can ", "Falsifying", "Failing")):
                    break
                parts.append(re.sub(r"\s+#.*$", "", following).strip())
                if following == ")":
                    break
            case = " ".join(p for p in parts if p)
            case = re.sub(r"\(\s+", "(", re.sub(r",?\s*\)$", ")", case))
            return case if len(case) <= 600 else case[:600] + " ..."
    return ""


def _failure_detail(report: Any, verbose: bool) -> str:
    """The one-line reason and hypothesis' shrunk case; with ``verbose`` the whole report."""
    if verbose:
        return str(report.longrepr)
    detail = [_reason(report)]
    case = _shrunk_case(_crash_message(report))
    if case:
        detail.append(f"shrunk case: {case}")
    return "\n".join(detail)


def _unavailable(kind: str, name: str, options: dict[str, Any]) -> str:
    """Why the plugin cannot be checked (it does not load, or refuses ``options``), on one
    line; "" when it can."""
    from pydantic import ValidationError

    from tessellm.core.errors import validation_problems

    try:
        from tessellm.core.registry import get_registry

        registry = get_registry()
    except Exception as exc:  # a name clash between installed packages, or a broken registry
        return " ".join(f"{type(exc).__name__}: {exc}".split())
    entry = registry.get(kind, name)
    if entry is None:
        failures = registry.failures_for(kind, name)
        if failures:
            return " ".join("; ".join(str(f) for f in failures).split())
        return (f"no installed {kind} plugin named {name!r} "
                f"(installed: {', '.join(registry.names(kind)) or 'none'})")
    try:
        entry.cls.Options.model_validate(options)
    except ValidationError as exc:
        return f"options {json.dumps(options)} are invalid: {validation_problems(exc)}"
    except Exception as exc:  # a broken Options model
        return " ".join(f"its Options model fails on {json.dumps(options)}: {type(exc).__name__}: {exc}".split())
    return ""


_KEPT = ("base", "check", "pytest_plugin")  # counters, this runner and the fixtures: shared with the caller


@contextlib.contextmanager
def _fresh_suites() -> Any:
    """The suites imported anew for the check, and the caller's modules put back after. A
    property's example cap is fixed when its class is defined, under the hypothesis profile
    loaded then: a suite module a test session imported earlier (under its own profile)
    would ignore ``--examples``."""
    package = "tessellm.testing.conformance"
    saved = {name: module for name, module in sys.modules.items()
             if (name == package or name.startswith(package + ".")) and name.rsplit(".", 1)[-1] not in _KEPT}
    for name in saved:
        del sys.modules[name]
    parent = sys.modules.get("tessellm.testing")
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            if name.rsplit(".", 1)[-1] not in _KEPT:
                del sys.modules[name]
        sys.modules.update(saved)
        if parent is not None and package in saved:
            parent.conformance = saved[package]


def _current_profile() -> str | None:
    from hypothesis import settings

    getter = getattr(settings, "get_current_profile_name", None)
    return getter() if getter is not None else getattr(settings, "_current_profile", None)


def _checkpoints_too_large(name: str, shapes: dict[str, dict[str, Any]]) -> str:
    """For a model plugin: why a tiny checkpoint of one of its model types cannot be built
    within the memory limit (one line), before the suite allocates anything; "" when all can."""
    from tessellm.core.registry import get_registry
    from tessellm.testing.models import CheckpointTooLarge, tiny_config

    plugin = get_registry().get("model", name).cls
    declared = getattr(plugin, "tiny_config", None) or {}
    for model_type in plugin.model_types:
        try:
            tiny_config(model_type, **{**declared.get(model_type, {}), **shapes.get(model_type, {})})
        except CheckpointTooLarge as exc:
            return str(exc)
        except Exception:  # a config transformers refuses: the suite reports it with its traceback
            continue
    return ""


def run_check(kind: str, name: str, options: dict[str, Any] | None = None, *, examples: int = 20,
              verbose: bool = False, shapes: dict[str, dict[str, Any]] | None = None) -> CheckReport:
    """Run ``kind``'s suite on the installed plugin ``name`` with ``options``: at most
    ``examples`` cases a property. ``shapes`` (model plugins only) sets the model suite's
    tiny checkpoint fields per model_type. pytest's output is printed only when ``verbose``,
    and then a failure's detail is its whole traceback."""
    import pytest

    from tessellm.testing.conformance.base import CASES

    if kind not in SUITES:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(SUITES)}")
    if shapes and kind != "model":
        raise ValueError(f"shapes are for the model suite, not the {kind} suite")
    options = dict(options or {})
    report = CheckReport(kind, name, options)
    report.error = _unavailable(kind, name, options)
    if not report.error and kind == "model":
        report.error = _checkpoints_too_large(name, shapes or {})
    if report.error:
        return report
    suite_settings = {"shapes": shapes} if shapes else {}
    collector = _Collector()
    with tempfile.TemporaryDirectory(prefix="tessellm-check-") as tmp:
        folder = Path(tmp)
        (folder / "conftest.py").write_text(_CONFTEST.format(examples=int(examples)))
        (folder / "test_conformance.py").write_text(
            _TEST_FILE.format(suite=SUITES[kind], name=name, options=json.dumps(options),
                              settings="".join(f"    {key} = json.loads({json.dumps(value)!r})\n"
                                               for key, value in suite_settings.items())))
        args = [str(folder), "-p", "no:cacheprovider", "--rootdir", str(folder), "--import-mode=importlib",
                "-o", "addopts=", "-v" if verbose else "-q", "-W", "ignore::DeprecationWarning"]
        if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
            args += ["-p", "tessellm.testing.conformance.pytest_plugin"]
        before = dict(CASES)
        profile = _current_profile()
        try:
            with _fresh_suites():
                if verbose:
                    pytest.main(args, plugins=[collector])
                else:
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        pytest.main(args, plugins=[collector])
        finally:  # neither the check's profile nor its module may outlive it (a second check in
            # this process would otherwise find the first one's test module under the same name)
            for module_name, module in list(sys.modules.items()):
                if str(getattr(module, "__file__", None) or "").startswith(tmp):
                    del sys.modules[module_name]
            if profile is not None:
                from hypothesis import settings

                settings.load_profile(profile)
    for nodeid, rep in collector.reports.items():
        prop = nodeid.split("::")[-1]
        cases = CASES.get(nodeid, 0) - before.get(nodeid, 0)
        if rep.outcome == "passed":
            report.results.append(PropertyResult(prop, cases, "pass"))
        elif rep.outcome == "skipped":
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            report.results.append(PropertyResult(prop, cases, "skip", reason.removeprefix("Skipped: ")))
        else:
            report.results.append(PropertyResult(prop, cases, "fail", _failure_detail(rep, verbose)))
    report.sampled = dict(SAMPLED)
    if not report.results and collector.collect_error:
        report.error = f"the suite did not collect: {collector.collect_error}"
    return report
