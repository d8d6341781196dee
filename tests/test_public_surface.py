"""The plugin author's public surface: what the plugin docs name is importable from
``tessellm``, nothing a plugin author reads or generates points into ``tessellm.core``, and
docs/reference.md is what its generator writes from the docstrings today.

The rule for ``tessellm.core``: docs/plugins.md, docs/reference.md and the ``new-plugin``
templates never give an import path into it (``tessellm.core.x``, ``from tessellm.core import``,
``from tessellm import core``), since those modules may move between releases; a link to a
source file (``../core/interfaces/kv.py``) is fine, for reading the contract, not importing it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch

import tessellm
from tessellm.core.registry import HOOK_NAMES
from tessellm.scaffold import reference

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DOCS = [ROOT / "docs" / "plugins.md", ROOT / "docs" / "reference.md"]
TEMPLATES = sorted((ROOT / "src" / "tessellm" / "scaffold" / "templates").glob("*.tmpl"))
INTO_CORE = re.compile(r"tessellm\.core\.[A-Za-z_]|from\s+tessellm\.core\s+import|from\s+tessellm\s+import\s+core\b")


def core_definitions() -> tuple[set[str], set[str]]:
    """The public top-level class and function names defined anywhere in ``tessellm.core``."""
    import tessellm.core

    classes, functions = set(), set()
    for folder in map(Path, tessellm.core.__path__):
        for path in folder.rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if node.name.startswith("_") if hasattr(node, "name") else True:
                    continue
                if isinstance(node, ast.ClassDef):
                    classes.add(node.name)
                elif isinstance(node, ast.FunctionDef):
                    functions.add(node.name)
    return classes, functions


def public(name: str) -> bool:
    """Whether ``tessellm.<name>`` is a name tessellm exports or one of its public subpackages
    (``tessellm.testing``, ``tessellm.bench``). ``tessellm.core`` itself is left to
    ``INTO_CORE``: the docs name it only to warn against it."""
    if name == "core":
        return True
    return hasattr(tessellm, name) or importlib.util.find_spec(f"tessellm.{name}") is not None


def backticked_names(text: str) -> set[tuple[str, bool, bool]]:
    """(identifier, written as ``tessellm.X``, written as a call ``X(``) for every identifier
    that starts a dotted name inside backticks."""
    names = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for match in re.finditer(r"(?<![\w.])(tessellm\.)?([A-Za-z_]\w*)(\()?", span):
            names.add((match.group(2), bool(match.group(1)), bool(match.group(3))))
    return names


def test_every_core_class_or_function_the_plugin_docs_name_is_importable_from_tessellm():
    """A tessellm class (or a function written as a call) that docs/plugins.md names must be
    reachable as ``tessellm.Name``, so no author needs the modules behind it (hooks are
    functions a plugin writes, not names it imports)."""
    classes, functions = core_definitions()
    assert {"KVLayout", "Sequence", "SamplingParams", "PluginCallError"} <= classes  # the scan sees core
    missing = set()
    for doc in PLUGIN_DOCS:
        for name, qualified, call in backticked_names(doc.read_text()):
            if name in classes or (call and name in functions and name not in HOOK_NAMES) or qualified:
                if not public(name):
                    missing.add(f"{doc.name}: {name}")
    assert not missing, f"named by the plugin docs but not importable from tessellm: {sorted(missing)}"


@pytest.mark.parametrize("name", ["PluginCallError", "LatentProjection", "LatentKVStorage", "dense_storage",
                                  "LoadFailure", "EngineStats", "LoraKernel", "LoraMapping", "LoraWeights"])
def test_names_the_docs_use_are_exported(name):
    assert name in tessellm.__all__ and getattr(tessellm, name) is not None


def test_every_tessellm_name_in_the_guide_resolves():
    missing = {name for name, qualified, _ in backticked_names((ROOT / "docs" / "guide.md").read_text())
               if qualified and not public(name)}
    assert not missing, f"docs/guide.md names tessellm.X that does not exist: {sorted(missing)}"


@pytest.mark.parametrize("path", PLUGIN_DOCS + TEMPLATES, ids=lambda p: p.name)
def test_no_plugin_doc_or_template_points_into_tessellm_core(path):
    hits = [line.strip() for line in path.read_text().splitlines() if INTO_CORE.search(line)]
    assert not hits, (f"{path.relative_to(ROOT)} points into tessellm.core (export the name from tessellm, or "
                      f"link the source file for reading): {hits}")


def test_templates_use_only_names_tessellm_exports():
    missing = {(path.name, name) for path in TEMPLATES
               for name in re.findall(r"\btessellm\.([A-Za-z_]\w*)", path.read_text())
               if not public(name)}
    assert not missing


def test_the_committed_field_reference_is_current():
    committed = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    assert committed == reference.render(), (f"docs/reference.md is stale: regenerate it with "
                                             f"`{reference.COMMAND}` from the repository root")


def test_the_reference_covers_every_field_and_the_plugin_docs_link_it():
    text = reference.render()
    for name in (*tessellm.SamplingParams.model_fields, "format", "block_size", "extras", "num_computed_tokens",
                 "status", "generator", "num_pending", "num_tokens"):
        assert f"| `{name}` |" in text, name
    for doc in ("plugins.md", "guide.md"):
        assert "(reference.md)" in (ROOT / "docs" / doc).read_text(), doc


def test_a_field_without_a_docstring_stops_the_generator():
    tree = ast.parse("class C:\n    a: int = 1\n    \"\"\"Documented.\"\"\"\n    b: int = 2\n").body[0]
    docs = reference._docstrings(tree.body, on_self=False)
    assert docs == {"a": ("int", "Documented.")}
    with pytest.raises(ValueError, match="field\\(s\\) b have no docstring"):
        reference._undocumented(tessellm.KVLayout, ["a", "b"], {n: d for n, (_, d) in docs.items()})


def test_sequence_docstrings_say_who_may_write_each_attribute():
    """Every attribute is "Read only." or names its writer; the writable ones are the scheduler's
    two and the decoder's generator."""
    text = reference.sequence_section()
    writable = set(re.findall(r"^\| `(\w+)` \| [^|]*(?:\\\|[^|]*)* \| read, write \|", text, re.M))
    assert writable == {"num_computed_tokens", "status", "generator"}


@pytest.mark.parametrize("storage", [
    tessellm.DenseKVStorage(tessellm.KVLayout("kv", 4, torch.float32), 16, 2, 8, torch.device("cpu")),
    tessellm.LatentKVStorage(tessellm.KVLayout("latent", 4, torch.float32), 16, 6, torch.device("cpu")),
], ids=["dense", "latent"])
def test_copy_slots_is_a_declared_exact_copy_with_a_default(storage):
    """``KVStorage.copy_slots`` is part of the storage contract (the cache scaffold's fork calls
    it): the built-ins' own copy and the base class's gather-then-store both copy exactly."""
    assert "copy_slots" in vars(tessellm.KVStorage)
    width = storage.layout.format == "kv"
    shape = (8, 2, 8) if width else (8, 1, 6)
    k = torch.randn(shape)
    storage.store(k, torch.randn(shape) if width else None, torch.arange(8))
    before = storage.gather(torch.arange(4))
    for copy in (storage.copy_slots, lambda s, d: tessellm.KVStorage.copy_slots(storage, s, d)):
        copy(torch.arange(4), torch.arange(8, 12))
        after = storage.gather(torch.arange(8, 12))
        assert torch.equal(after[0], before[0])
        assert (after[1] is None) if not width else torch.equal(after[1], before[1])
