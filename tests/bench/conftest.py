"""The bench/ scripts, imported as modules for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


@pytest.fixture(scope="session")
def bench_script():
    """Factory: ``bench_script("mla.py")`` -> that script as a module (loaded once, and
    registered in ``sys.modules`` while the session runs: its dataclasses look it up there)."""
    loaded: dict[str, object] = {}

    def load(filename: str):
        if filename not in loaded:
            spec = importlib.util.spec_from_file_location(f"bench_{Path(filename).stem}", BENCH / filename)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded[filename] = module
        return loaded[filename]

    yield load
    for module in loaded.values():
        sys.modules.pop(module.__name__, None)
