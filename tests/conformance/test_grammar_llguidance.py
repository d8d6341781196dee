"""The grammar conformance suite on the second built-in grammar backend, llguidance, with its
default options (JSON kept to one line, as the xgrammar backend keeps it) and with any
whitespace allowed."""

from __future__ import annotations

import pytest

from tessellm.testing.conformance import GrammarConformance

pytest.importorskip("llguidance")


class TestLLGuidance(GrammarConformance):
    plugin = "llguidance"


class TestLLGuidanceAnyWhitespace(GrammarConformance):
    plugin = "llguidance"
    options = {"any_whitespace": True}
