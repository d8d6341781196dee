"""The grammar conformance suite on the built-in grammar backend, xgrammar (with its default
options, JSON kept to one line, and with any whitespace allowed)."""

from __future__ import annotations

import pytest

from tessellm.testing.conformance import GrammarConformance

pytest.importorskip("xgrammar")


class TestXGrammar(GrammarConformance):
    plugin = "xgrammar"


class TestXGrammarAnyWhitespace(GrammarConformance):
    plugin = "xgrammar"
    options = {"any_whitespace": True, "max_threads": 1}
