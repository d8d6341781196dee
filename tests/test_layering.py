"""The architecture as the imports show it: core/ needs no plugin and no application library,
a plugin needs only core and helpers of its own kind, and the library with `tessellm generate`
runs without the apps' extras ([serve], [bench], [eval]) installed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP_LIBRARIES = ("fastapi", "uvicorn", "starlette", "prometheus_client", "httpx", "matplotlib", "lm_eval")


def imports(folder: Path) -> list[tuple[Path, str]]:
    """(file, imported module) for every import statement under ``folder``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(path, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append((path, node.module))
    return found


def top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("folder", ["core", "plugins"])
def test_no_application_library_under_core_or_plugins(folder):
    bad = [(str(p.relative_to(ROOT)), m) for p, m in imports(ROOT / folder) if top(m) in APP_LIBRARIES]
    assert bad == []


def test_core_imports_no_plugin_and_no_app():
    bad = [(str(p.relative_to(ROOT)), m) for p, m in imports(ROOT / "core")
           if m.startswith(("tessellm.plugins", "tessellm.serve", "tessellm.bench", "tessellm.cli", "tessellm.testing"))]
    assert bad == []


def test_a_plugin_imports_core_and_its_own_kind_only():
    bad = []
    for path, module in imports(ROOT / "plugins"):
        kind = path.relative_to(ROOT / "plugins").parts[0]
        if module.startswith("tessellm.") and not module.startswith(("tessellm.core", f"tessellm.plugins.{kind}")):
            bad.append((str(path.relative_to(ROOT)), module))
    assert bad == []


BLOCK_APPS = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {APP_LIBRARIES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""


def run_without_apps(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m tessellm ARGS`` in a process where the apps' libraries cannot be imported."""
    code = BLOCK_APPS + "import runpy; sys.argv = ['tessellm', *sys.argv[1:]]; runpy.run_module('tessellm', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_generate_runs_without_the_app_extras(tiny_model, tmp_path):
    done = run_without_apps("generate", "--set", f"model={tiny_model('llama')}", "--set", "device=cpu",
                            "--max-tokens", "3", "--ignore-eos", "Hello", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "3 tokens for 1 prompt" in done.stderr


@pytest.mark.parametrize("args, extra", [(["serve"], "serve"),
                                         (["bench", "--serve", "http://127.0.0.1:9"], "bench"),
                                         (["bench", "--plot", "out.png"], "bench"),
                                         (["ab", "--a", "seed=1", "--b", "seed=2", "--plot", "out.png"], "bench"),
                                         (["eval", "lm-eval", "--model", "tessellm", "--tasks", "x"], "eval")])
def test_a_command_whose_extra_is_missing_says_which_to_install(tiny_model, tmp_path, args, extra):
    """One line naming the pip command, exit 2, before any model is loaded."""
    done = run_without_apps(*args, "--set", f"model={tiny_model('llama')}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessellm: error:"), done.stderr
    assert f"pip install 'tessellm[{extra}]'" in lines[0]
