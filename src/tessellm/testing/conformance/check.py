"""``tessellm plugins --check KIND:NAME``: run a kind's conformance suite on one installed
plugin, in this process, and report each property: cases tried, pass / fail / skip and why.

The suite runs under pytest with a hypothesis profile of its own (no deadline,
derandomized, ``examples`` cases a property), so a check repeats exactly."""

from __future__ import annotations

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
          "model": "ModelConformance"}
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

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.outcome != "fail" for r in self.results)

    def table(self) -> str:
        """The report as aligned text: one row a property, failures' details below."""
        width = max([len(r.name) for r in self.results] + [8])
        lines = [f"{'property':<{width}}  {'cases':>5}  result",
                 *(f"{r.name:<{width}}  {r.cases:>5}  {r.outcome}" + (f": {r.detail}" if r.outcome == "skip" else "")
                   for r in self.results)]
        failed = [r for r in self.results if r.outcome == "fail"]
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
'''

_CONFTEST = '''\
from hypothesis import settings

settings.register_profile("tessellm-check", deadline=None, derandomize=True, max_examples={examples},
                          print_blob=False)
settings.load_profile("tessellm-check")
'''


class _Collector:
    """A pytest plugin gathering each test's outcome (its call phase, or the phase that
    skipped or failed first)."""

    def __init__(self) -> None:
        self.reports: dict[str, Any] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.reports.setdefault(report.nodeid, report)


def _failure_detail(report: Any) -> str:
    """The assertion's message and hypothesis' shrunk example, not the whole traceback."""
    text = str(report.longrepr)
    keep = [line for line in text.splitlines()
            if line.startswith("E ") or "Falsifying example" in line or re.match(r"^\s*(\w+=|\)|[a-z_]+\()", line)]
    falsifying = text[text.find("Falsifying"):] if "Falsifying" in text else ""
    lines = [line[1:].strip() for line in keep if line.startswith("E ")][:12]
    if falsifying:
        lines.append(falsifying.split("\n\n")[0].strip())
    return "\n".join(lines) or text[-2000:]


def _current_profile() -> str | None:
    from hypothesis import settings

    getter = getattr(settings, "get_current_profile_name", None)
    return getter() if getter is not None else getattr(settings, "_current_profile", None)


def run_check(kind: str, name: str, options: dict[str, Any] | None = None, *, examples: int = 20,
              quiet: bool = True) -> CheckReport:
    """Run ``kind``'s suite on the installed plugin ``name`` with ``options``."""
    import pytest

    from tessellm.testing.conformance.base import CASES

    if kind not in SUITES:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(SUITES)}")
    options = dict(options or {})
    report = CheckReport(kind, name, options)
    collector = _Collector()
    with tempfile.TemporaryDirectory(prefix="tessellm-check-") as tmp:
        folder = Path(tmp)
        (folder / "conftest.py").write_text(_CONFTEST.format(examples=int(examples)))
        (folder / "test_conformance.py").write_text(
            _TEST_FILE.format(suite=SUITES[kind], name=name, options=json.dumps(options)))
        args = [str(folder), "-p", "no:cacheprovider", "--rootdir", str(folder), "--import-mode=importlib",
                "-o", "addopts=", "-q" if quiet else "-v", "-W", "ignore::DeprecationWarning"]
        if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
            args += ["-p", "tessellm.testing.conformance.pytest_plugin"]
        before = dict(CASES)
        profile = _current_profile()
        try:
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
            report.results.append(PropertyResult(prop, cases, "fail", _failure_detail(rep)))
    return report
