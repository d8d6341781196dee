"""``tessellm new-plugin KIND NAME``: for each of the five kinds the package it writes
installs through its entry point, imports only the plugin API, passes its own tests (the
kind's conformance suite, run by pytest in the package as its author would) and
``tessellm plugins --check``; bad kinds, names, folders and taken names are one-line errors."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessellm.cli import main
from tessellm.core import registry as registry_module
from tessellm.scaffold import SCAFFOLD_KINDS as KINDS  # the kinds with a template
from tessellm.core.registry import PluginRegistry
from tessellm.scaffold import new_plugin


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main(["new-plugin", "attn", "x"]) == 2
    assert main(["new-plugin", "attention", "My_Attention"]) == 2
    assert main(["new-plugin", "attention", "auto"]) == 2
    assert main(["new-plugin", "attention", "sdpa", "--dir", str(tmp_path / "a")]) == 2
    assert main(["new-plugin", "cache", "mine", "--dir", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.count("tessellm: error: new-plugin:") == 5, err
    assert "the kinds are attention, cache, scheduler, decoding, quant" in err
    assert "lowercase letters, digits and hyphens" in err and "not 'auto'" in err
    assert "attention plugin 'sdpa' already exists (package 'tessellm')" in err
    assert "already exists and is not an empty folder" in err
    assert (taken / "notes.txt").read_text() == "mine" and not (tmp_path / "a").exists()


def test_the_cli_writes_the_package_and_says_how_to_go_on(tmp_path, capsys):
    assert main(["new-plugin", "scheduler", "fair-share", "--dir", str(tmp_path / "pkg")]) == 0
    out = capsys.readouterr().out
    assert "wrote scheduler plugin 'fair-share'" in out and "tessellm plugins --check scheduler:fair-share" in out
    files = sorted(str(p.relative_to(tmp_path / "pkg")) for p in (tmp_path / "pkg").rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", "tessellm_fair_share/__init__.py",
                     "tessellm_fair_share/scheduler.py", "tests/test_fair_share.py"]
    code = (tmp_path / "pkg" / "tessellm_fair_share" / "scheduler.py").read_text()
    assert "class FairShareScheduler(tessellm.QueueScheduler)" in code and 'name = "fair-share"' in code


@pytest.fixture
def scaffolded(tmp_path, install_plugin_folder, monkeypatch):
    """Factory: ``scaffolded(kind)`` writes kind's package for plugin ``my-<kind>``, installs
    it as a distribution and makes a registry holding it the default; returns the folder."""

    def make(kind: str) -> Path:
        folder = new_plugin(kind, f"my-{kind}", tmp_path / f"tessellm-my-{kind}").directory
        install_plugin_folder(folder)
        monkeypatch.setattr(registry_module, "_default", PluginRegistry())
        return folder

    return make


def test_every_kind_installs_lists_and_imports_only_the_plugin_api(scaffolded, capsys):
    folders = {kind: scaffolded(kind) for kind in KINDS}
    registry = registry_module.get_registry()
    assert registry.failures == []
    for kind, folder in folders.items():
        entry = registry.get(kind, f"my-{kind}")
        assert entry is not None and entry.package == f"tessellm-my-{kind}"
        for path in folder.rglob("*.py"):
            for name in _imports(path):
                assert not name.startswith("tessellm.") or name.startswith("tessellm.testing"), \
                    f"{path.name} imports {name}: a generated plugin uses only the plugin API"
    assert main(["plugins"]) == 0
    listing = capsys.readouterr().out
    assert all(f"{kind}.my-{kind}" in listing and f"tessellm-my-{kind}" in listing for kind in KINDS)


@pytest.mark.extended
def test_each_generated_package_passes_its_own_tests(scaffolded, tmp_path):
    """pytest run in a fresh process over the five packages' tests/, as their authors would
    after ``pip install -e`` (here: dist-infos on PYTHONPATH)."""
    folders = [scaffolded(kind) for kind in KINDS]
    path = os.pathsep.join([str(tmp_path), *map(str, folders), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                           "ignore::DeprecationWarning", *(str(f / "tests") for f in folders)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " failed" not in done.stdout.splitlines()[-1] and " passed" in done.stdout.splitlines()[-1], tail


def test_the_registration_test_ignores_other_packages_failures(scaffolded, tmp_path):
    """One broken plugin installed elsewhere does not fail an author's registration test,
    which checks only its own package."""
    import importlib.util

    folder = scaffolded("cache")
    info = tmp_path / "tessellm_elsewhere_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tessellm-elsewhere-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tessellm]\ncache.elsewhere = tessellm_no_such_module_here\n")
    assert any(f.package == "tessellm-elsewhere-broken" for f in PluginRegistry().failures)
    spec = importlib.util.spec_from_file_location("generated_test_my_cache", folder / "tests" / "test_my_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.test_installed_through_its_entry_point()


@pytest.mark.parametrize("kind", KINDS)
def test_each_generated_plugin_passes_the_check(scaffolded, kind, capsys):
    scaffolded(kind)
    assert main(["plugins", "--check", f"{kind}:my-{kind}", "--examples", "3"]) == 0
    assert f"{kind} plugin 'my-{kind}' passes" in capsys.readouterr().out


def test_the_grammar_kind_has_no_template_and_the_error_says_what_to_do(tmp_path):
    from tessellm.core.errors import ConfigError
    from tessellm.scaffold import new_plugin

    with pytest.raises(ConfigError, match="no template for a grammar plugin.*GrammarBackend"):
        new_plugin("grammar", "my-grammar", tmp_path / "pkg")
