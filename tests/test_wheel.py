"""A built wheel imports the same way as the editable install: ``tessellm.core`` and
``tessellm.plugins.<kind>.<name>``, with the built-in plugins found through its entry points."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _source_files() -> list[Path]:
    """What a fresh clone holds: git's tracked and untracked-but-not-ignored files."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: take the tree minus build outputs
        skip = {".venv", ".git", "build", "dist", ".pytest_cache", ".hypothesis", "__pycache__"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def _deps_dir(tmp: Path) -> Path:
    """This environment's packages minus tessellm itself (its editable install would shadow
    the wheel): linked into a folder the clean venv puts on its path."""
    site = Path(sysconfig.get_paths()["purelib"])
    deps = tmp / "deps"
    deps.mkdir()
    for entry in site.iterdir():
        if entry.name.lower().startswith(("tessellm", "__editable__")) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    return deps


def test_wheel_installs_into_clean_venv_and_imports(tmp_path):
    src = tmp_path / "src"
    for f in _source_files():
        target = src / f.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True)
    wheel = next(dist.glob("tessellm-*.whl"))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    venv_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    (venv_site / "deps.pth").write_text(str(_deps_dir(tmp_path)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, text=True)

    probe = (
        "import json, tessellm, tessellm.core.engine.engine, tessellm.plugins.attention.sdpa, "
        "tessellm.plugins.cache.contiguous, tessellm.plugins.scheduler.static, tessellm.plugins.decoding.sample, "
        "tessellm.plugins.quant.none, tessellm.testing.attention\n"
        "from tessellm.core.registry import PluginRegistry\n"
        "from tessellm.core.config import default_config_data\n"
        "r = PluginRegistry()\n"
        "print(json.dumps({'file': tessellm.core.engine.engine.__file__, 'failures': [str(f) for f in r.failures],"
        " 'plugins': sorted(f'{e.kind}.{e.name}:{e.package}' for e in r.entries()),"
        " 'default_model': default_config_data()['model']}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TESSELLM_DISABLE_PLUGINS")}
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["file"].startswith(str(venv_site)), result["file"]
    assert result["failures"] == []
    assert {"attention.sdpa:tessellm", "cache.contiguous:tessellm", "scheduler.static:tessellm",
            "decoding.greedy:tessellm", "decoding.sample:tessellm", "quant.none:tessellm"} <= set(result["plugins"])
    assert result["default_model"] == "smollm2-135m"
    cli = subprocess.run([str(venv / "bin" / "tessellm"), "plugins", "--json"], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert cli.returncode == 0, cli.stderr
    assert {p["name"] for p in json.loads(cli.stdout)} >= {"sdpa", "contiguous", "static", "greedy", "sample", "none",
                                                          "int8-weight"}
    # the scaffold's templates are package data of the wheel
    made = subprocess.run([str(venv / "bin" / "tessellm"), "new-plugin", "cache", "from-wheel"], capture_output=True,
                          text=True, cwd=tmp_path, env=env)
    assert made.returncode == 0, made.stderr
    assert "class FromWheelCache(tessellm.CacheManager)" in (tmp_path / "tessellm-from-wheel" / "tessellm_from_wheel"
                                                              / "cache.py").read_text()
    # so are the bundled evaluation texts and their notice
    texts = subprocess.run([str(py), "-c", "from tessellm.eval.texts import BUNDLED, load_text; from importlib import "
                            "resources; print(sum(len(load_text(n)[1]) for n in BUNDLED), "
                            "resources.files('tessellm.eval.texts').joinpath('NOTICE.md').is_file())"],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert texts.returncode == 0, texts.stderr
    size, notice = texts.stdout.split()
    assert int(size) > 100_000 and notice == "True"
