"""The grammar conformance suite on the built-in grammar backend, xgrammar (with its default
options, and with JSON kept to one line)."""

from __future__ import annotations

import pytest

from tessellm.testing.conformance import GrammarConformance

pytest.importorskip("xgrammar")


class TestXGrammar(GrammarConformance):
    plugin = "xgrammar"


class TestXGrammarCompactJson(GrammarConformance):
    plugin = "xgrammar"
    options = {"any_whitespace": False, "max_threads": 1}
