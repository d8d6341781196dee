"""The pytest plugin that brings tessellm's conformance suites to any repository where
tessellm is installed (entry point ``pytest11``: no conftest to copy). It registers the
``conformance`` marker, a hypothesis profile for the suites, and the fixtures they use.

Loaded into every pytest session of an environment with tessellm, so it imports nothing
heavy at load time and does nothing unless a suite runs."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: a property of tessellm's plugin contract "
                                       "(tessellm.testing.conformance)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from tessellm.testing.conformance.base import ConformanceSuite

    for item in items:
        if item.cls is not None and issubclass(item.cls, ConformanceSuite):
            item.add_marker(pytest.mark.conformance)


@pytest.fixture(scope="session")
def tessellm_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with its own tokenizer (tessellm.testing.models), built once per session."""
    from tessellm.testing.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tessellm-tiny-llama"))
