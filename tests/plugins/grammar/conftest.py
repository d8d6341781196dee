"""Fixtures of the grammar backends' own tests, on the conformance suite's byte-level
tokenizer. A test module names the backend under test with a ``backend_class`` fixture;
``make`` and ``backend`` build on it, ``allowed`` and ``takes`` read any backend's masks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tessellm.core.interfaces.grammar import GrammarBackend, GrammarSpec
from tessellm.testing.conformance.grammar import PADDING, byte_level_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def make(backend_class, tokenizer):
    """``make(padding=PADDING, **options)``: a new ``backend_class`` on the byte-level tokenizer,
    its logits ``padding`` ids wider than the tokenizer."""

    def make(padding: int = PADDING, **options: Any) -> GrammarBackend:
        return backend_class(backend_class.Options(**options), tokenizer, len(tokenizer) + padding)

    return make


@pytest.fixture(scope="module")
def backend(make) -> GrammarBackend:
    """The backend with its default options, shared by the module's tests."""
    return make()


def _allowed(backend: GrammarBackend, matcher) -> torch.Tensor:
    """[V] bool: the tokens the matcher's mask leaves finite."""
    mask = backend.new_mask(1)
    matcher.fill_mask(mask, 0)
    logits = torch.zeros(1, backend.vocab_size)
    backend.apply_mask(logits, mask, [0])
    return torch.isfinite(logits[0])


def _takes(backend: GrammarBackend, spec: GrammarSpec, text: str) -> bool:
    """Whether the masks let ``text`` through token by token, then the stop token."""
    matcher = backend.matcher(backend.compile(spec))
    for token in backend.tokenizer.encode(text, add_special_tokens=False) + [backend.tokenizer.eos_token_id]:
        if not _allowed(backend, matcher)[token]:
            return False
        assert matcher.accept(token)
    return matcher.is_terminated()


@pytest.fixture(scope="session")
def allowed():
    """``allowed(backend, matcher)``: [V] bool, the tokens the matcher's mask leaves finite."""
    return _allowed


@pytest.fixture(scope="session")
def takes():
    """``takes(backend, spec, text)``: whether the masks let ``text`` through token by token,
    then the stop token."""
    return _takes

