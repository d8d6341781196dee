"""docs/reference.md: the fields of ``KVLayout``, ``Sequence`` and ``SamplingParams``, written
from their own docstrings so the page cannot drift from the code.

    python -m tessellm.scaffold.reference docs/reference.md

A field's docstring is the string literal on the line after it: after a dataclass or pydantic
field in the class body, or after ``self.name = ...`` in ``__init__``; a property's is its
own. A field without one is an error here, so a new field cannot go undocumented.
tests/test_public_surface.py checks that the committed page equals what this writes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

COMMAND = "python -m tessellm.scaffold.reference docs/reference.md"
"""What regenerates the committed page, run from the repository root."""

_BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}


def _markdown(text: str) -> str:
    """A docstring as one markdown table cell: reST ``code`` as `code`, lines joined, pipes escaped."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(inspect.cleandoc(text).split()))
    return text.replace("|", "\\|")


def _paragraphs(text: str) -> str:
    """A class docstring as markdown paragraphs (a reST bullet list stays a list)."""
    return re.sub(r"``(.+?)``", r"`\1`", inspect.cleandoc(text))


def _docstrings(body: list[ast.stmt], on_self: bool) -> dict[str, tuple[str | None, str]]:
    """name -> (annotation source or None, docstring) for each assignment in ``body`` followed
    by a string literal: to plain names (a class body) or to ``self.name`` (``__init__``)."""
    found: dict[str, tuple[str | None, str]] = {}
    for stmt, after in zip(body, body[1:]):
        if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            continue
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else (
            stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None)
        if on_self and isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                and target.value.id == "self":
            name = target.attr
        elif not on_self and isinstance(target, ast.Name):
            name = target.id
        else:
            continue
        annotation = ast.unparse(stmt.annotation) if isinstance(stmt, ast.AnnAssign) else None
        found[name] = (annotation, after.value.value)
    return found


def _class_tree(cls: type) -> ast.ClassDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef), cls
    return node


def _undocumented(cls: type, names: list[str], docs: dict[str, Any]) -> None:
    missing = [n for n in names if not docs.get(n)]
    if missing:
        raise ValueError(f"{cls.__name__}: field(s) {', '.join(missing)} have no docstring (a string literal on "
                         f"the line after the field); docs/reference.md is generated from them")


def _properties(cls: type) -> list[tuple[str, str, str]]:
    """(name, return annotation, docstring) of the class's own public properties."""
    rows = []
    for name, value in vars(cls).items():
        if isinstance(value, property) and not name.startswith("_"):
            _undocumented(cls, [name], {name: value.fget.__doc__})
            returns = value.fget.__annotations__.get("return", "")
            rows.append((name, returns if isinstance(returns, str) else getattr(returns, "__name__", str(returns)),
                         value.fget.__doc__))
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _code(text: str) -> str:
    return f"`{text}`".replace("|", "\\|")


def dataclass_section(cls: type) -> str:
    """A dataclass's section: its docstring, then a row per field (type, default, docstring)."""
    docs = _docstrings(_class_tree(cls).body, on_self=False)
    fields = dataclasses.fields(cls)
    _undocumented(cls, [f.name for f in fields], {n: d for n, (_, d) in docs.items()})
    rows = [[_code(f.name), _code(str(f.type)),
             "required" if f.default is dataclasses.MISSING else _code(repr(f.default)), _markdown(docs[f.name][1])]
            for f in fields]
    return "\n\n".join([f"## `{cls.__name__}`", _paragraphs(cls.__doc__),
                        _table(["field", "type", "default", "meaning"], rows)])


def kv_layout_section() -> str:
    from tessellm.core.interfaces.kv import KVLayout

    return dataclass_section(KVLayout)


def routing_sections() -> list[str]:
    """What a routing policy reads of a request and of each replica (plugin API 1.13)."""
    from tessellm.core.interfaces.routing import ReplicaState, RouteRequest

    return [dataclass_section(RouteRequest), dataclass_section(ReplicaState)]


def _bounds(field: Any) -> str:
    parts = []
    for item in field.metadata:
        for attr, sign in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def sampling_params_section() -> str:
    from tessellm.core.interfaces.sequence import SamplingParams

    docs = _docstrings(_class_tree(SamplingParams).body, on_self=False)
    fields = SamplingParams.model_fields
    _undocumented(SamplingParams, list(fields), {n: f.description for n, f in fields.items()})
    rows = []
    for name, field in fields.items():
        default = field.get_default(call_default_factory=True)
        rows.append([_code(name), _code(docs[name][0] or ""), _code(repr(default)), _bounds(field),
                     _markdown(field.description)])
    rows += [[_code(name), _code(returns), "(property)", "", _markdown(doc)]
             for name, returns, doc in _properties(SamplingParams)]
    return "\n\n".join(["## `SamplingParams`", _paragraphs(SamplingParams.__doc__),
                        _table(["field", "type", "default", "bounds", "meaning"], rows)])


def _init_types(init: ast.FunctionDef) -> dict[str, str]:
    """Parameter name -> annotation source, for ``__init__``'s annotated parameters."""
    params = [*init.args.args, *init.args.kwonlyargs]
    return {a.arg: ast.unparse(a.annotation) for a in params if a.annotation is not None}


def _attribute_type(stmt_value: ast.expr, params: dict[str, str], instance: Any, name: str) -> str:
    """An unannotated ``self.name = value``'s type: the parameter's annotation where the value
    is that parameter (or a list of it), else the type of the value on a fresh instance."""
    if isinstance(stmt_value, ast.Name) and stmt_value.id in params:
        return params[stmt_value.id]
    if isinstance(stmt_value, ast.Call) and isinstance(stmt_value.func, ast.Name) and stmt_value.func.id == "list" \
            and len(stmt_value.args) == 1 and isinstance(stmt_value.args[0], ast.Name) \
            and stmt_value.args[0].id in params:
        return params[stmt_value.args[0].id]
    return type(getattr(instance, name)).__name__


def sequence_section() -> str:
    from tessellm.core.interfaces.sequence import SamplingParams, Sequence

    init = next(n for n in _class_tree(Sequence).body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    docs = _docstrings(init.body, on_self=True)
    values = {}  # attribute -> the expression __init__ assigns it, in order
    for stmt in init.body:
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else stmt.targets[0] if isinstance(
            stmt, ast.Assign) else None
        if isinstance(target, ast.Attribute):
            values[target.attr] = stmt.value
    _undocumented(Sequence, list(values), {n: d for n, (_, d) in docs.items()})
    params = _init_types(init)
    instance = Sequence("reference", [1], SamplingParams())
    rows = []
    for name in values:
        annotation, doc = docs[name]
        kind = annotation or _attribute_type(values[name], params, instance, name)
        read_only = doc.startswith("Read only.")
        rows.append([_code(name), _code(kind), "read" if read_only else "read, write",
                     _markdown(doc.removeprefix("Read only.").strip() if read_only else doc)])
    rows += [[_code(name), _code(returns), "read (property)", _markdown(doc)]
             for name, returns, doc in _properties(Sequence)]
    return "\n\n".join(["## `Sequence`", _paragraphs(Sequence.__doc__),
                        _table(["attribute", "type", "a plugin may", "meaning (and who writes it)"], rows)])


def render() -> str:
    """The whole page, as committed at docs/reference.md."""
    intro = ("# Field reference\n\n"
             "The fields of the data plugins exchange most, with what each means, generated from their "
             "docstrings in core/interfaces/kv.py and core/interfaces/sequence.py (import the classes from "
             "`tessellm`). Do not edit this page: edit the docstrings and run\n"
             f"`{COMMAND}` from the repository root. [plugins.md](plugins.md) describes the contracts they "
             "belong to.")
    return "\n\n".join([intro, kv_layout_section(), sequence_section(), sampling_params_section(),
                        *routing_sections()]) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: {COMMAND}", file=sys.stderr)
        return 2
    Path(args[0]).write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
