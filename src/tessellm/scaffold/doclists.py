"""The lists in docs/ that name what the code has, written from the code so they cannot go
stale: the hooks (core/hookspecs.py), the built-in model plugins with their model types, and
the built-in plugins as ``tessellm plugins`` lists them.

    python -m tessellm.scaffold.doclists docs/plugins.md docs/guide.md

Each list sits between two markers in its page, and only what lies between them is
rewritten:

    <!-- generated: hooks (python -m tessellm.scaffold.doclists) -->
    ...
    <!-- end generated -->

tests/test_doc_lists.py checks that the committed pages equal what this writes; a new hook,
kind or built-in plugin then fails that test until the command is run.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Callable

COMMAND = "python -m tessellm.scaffold.doclists docs/plugins.md docs/guide.md"
"""What rewrites the generated lists of the committed pages, run from the repository root."""

BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) \(python -m tessellm\.scaffold\.doclists\) -->\n)"
                   r"(?P<body>.*?)(<!-- end generated -->)", re.S)


def builtin_entries() -> list:
    """The plugins tessellm itself ships (package "tessellm"), as a fresh registry loads them."""
    from tessellm.core.registry import PluginRegistry

    return [e for e in PluginRegistry().entries() if e.package == "tessellm"]


def hooks() -> str:
    """The hook table: every hook spec of core/hookspecs.py, the class it registers, and its
    docstring's first sentence."""
    from tessellm.core import hookspecs
    from tessellm.core.plugin import KINDS
    from tessellm.core.registry import _base_class

    rows = ["| hook | registers subclasses of | what |", "|---|---|---|"]
    for kind in KINDS:
        spec = getattr(hookspecs, f"register_{kind}")
        summary = " ".join(inspect.getdoc(spec).split()).split(": subclasses of")[0].rstrip(".")
        rows.append(f"| `register_{kind}(register)` | `tessellm.{_base_class(kind).__name__}` | {summary} |")
    return "\n".join(rows) + "\n"


def builtin_models() -> str:
    """One sentence naming each built-in model plugin with the model types it builds."""
    models = sorted((e for e in builtin_entries() if e.kind == "model"), key=lambda e: e.name)
    named = [f"`{e.name}` ({', '.join(e.cls.model_types)})" for e in models]
    return f"Built in: {', '.join(named[:-1])} and {named[-1]}.\n"


def plugins_listing() -> str:
    """``tessellm plugins``' output for the built-in plugins, as a console block."""
    from tessellm.cli import plugin_lines

    lines = plugin_lines([e.describe() for e in builtin_entries()])
    return "```\n$ tessellm plugins\n" + "\n".join(lines) + "\n```\n"


GENERATORS: dict[str, Callable[[], str]] = {"hooks": hooks, "builtin-models": builtin_models,
                                            "plugins-listing": plugins_listing}
"""Each list's name (as its markers give it) and what writes it."""


def render(text: str) -> str:
    """``text`` with every generated list rewritten from the code; a ValueError for a marker
    naming no list."""
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise ValueError(f"unknown generated list {name!r}; known: {', '.join(GENERATORS)}")
        return match[1] + GENERATORS[name]() + match[4]

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(f"usage: {COMMAND}", file=sys.stderr)
        return 2
    for path in map(Path, paths):
        path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
