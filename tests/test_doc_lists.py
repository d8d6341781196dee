"""Every list in docs/ that names what the code has is written from the code or checked
against it, so none goes stale: the hooks table, the built-in model plugins and the
``tessellm plugins`` listing are generated (``tessellm.scaffold.doclists``); the guide's table of
kinds names each kind's built-ins; every flag of every command is documented where its
command is, and every flag a flags table names exists; every name the examples import from
``tessellm`` is exported and named on the plugin page."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

import tessellm
from tessellm.cli import build_parser
from tessellm.scaffold import doclists

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])\b")


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md") if "<!-- generated:" in p.read_text()))
def test_generated_lists_are_current(page):
    text = (DOCS / page).read_text(encoding="utf-8")
    assert text == doclists.render(text), (f"docs/{page}: a generated list is stale (a hook, kind or built-in "
                                           f"plugin changed): run `{doclists.COMMAND}` from the repository root")


def test_the_generated_lists_hold_what_the_issue_found_missing():
    plugins = (DOCS / "plugins.md").read_text()
    for hook in ("register_model(register)", "register_routing(register)", "register_grammar(register)"):
        assert f"`{hook}`" in plugins
    assert "`phi3` (phi3)" in plugins and "`gemma` (gemma, gemma2" in plugins
    assert "decoding.beam " in (DOCS / "guide.md").read_text()


def test_an_unknown_generated_list_is_an_error():
    text = "<!-- generated: nonesuch (python -m tessellm.scaffold.doclists) -->\nx\n<!-- end generated -->\n"
    with pytest.raises(ValueError, match="unknown generated list 'nonesuch'"):
        doclists.render(text)


def test_the_guides_kinds_table_names_each_kinds_built_ins():
    builtins: dict[str, set[str]] = {}
    for entry in doclists.builtin_entries():
        builtins.setdefault(entry.kind, set()).add(entry.name)
    guide = (DOCS / "guide.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `tessellm\.\w+` \|.*\| ([^|]+) \|$", guide, re.M)
    assert len(rows) >= 6, rows
    for kind, cell in rows:
        named = set(re.findall(r"`([\w-]+)`", cell))
        assert named == builtins.get(kind, set()), f"guide.md's kinds table, row {kind}"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def guide_section(command: str) -> str:
    guide = (DOCS / "guide.md").read_text()
    match = re.search(r"^### `tessellm %s`.*?$(.*?)(?=^### |\Z)" % re.escape(command), guide, re.M | re.S)
    return match.group(1) if match else ""


DOC_HOMES = {"plugins": ["guide", "plugins.md"], "new-plugin": ["plugins.md"], "serve": ["guide", "serving.md"],
             "router": ["serving.md"], "bench": ["guide", "serving.md"]}
"""Where each command's flags are documented besides its section of the guide."""


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_flag_is_documented_where_its_command_is(command):
    parser = subcommands()[command]
    flags = {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}
    homes = DOC_HOMES.get(command, ["guide"])
    text = "".join(guide_section(command) if home == "guide" else (DOCS / home).read_text() for home in homes)
    missing = flags - set(FLAG.findall(text))
    assert not missing, f"tessellm {command}: flags {sorted(missing)} are not documented in {homes}"


@pytest.mark.parametrize("command", ["generate", "ab"])
def test_every_flag_a_flags_table_names_exists(command):
    parser = subcommands()[command]
    flags = {o for a in parser._actions for o in a.option_strings}
    cells = re.findall(r"^\| ([^|]*) \|", guide_section(command), re.M)
    named = {flag for cell in cells for flag in FLAG.findall(cell)}
    assert named and not named - flags, f"tessellm {command}: the guide's table names {sorted(named - flags)}"
    if command == "generate":
        assert {"--sampling", "--lora"} <= named, "the generate table lacks --sampling or --lora"


def example_imports() -> set[str]:
    """The names the examples/ packages take from ``tessellm`` (``from tessellm import X``, ``tessellm.X``)."""
    names = set()
    for path in (ROOT / "examples").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "tessellm":
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tessellm":
                names.add(node.attr)
    return names


def test_everything_the_examples_import_is_exported_and_documented():
    names = example_imports()
    assert {"Attention", "DecoderLayer", "decoder_spec", "hookimpl"} <= names
    plugins = (DOCS / "plugins.md").read_text()
    lead = plugins[plugins.index("**The plugin API is `tessellm`.**"):plugins.index("This page follows")]
    for name in sorted(names):
        assert name in tessellm.__all__, f"the examples import tessellm.{name}, which tessellm does not export"
        assert f"`{name}`" in lead or f"`tessellm.{name}`" in lead, \
            f"docs/plugins.md's list of the plugin API lacks `{name}`"
