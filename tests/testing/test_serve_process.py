"""``ServeProcess``: a ``tessellm serve`` that exits before it is ready is a RuntimeError
naming its exit status, and its process is reaped."""

from __future__ import annotations

import pytest

from tessellm.testing.serving import ServeProcess

pytest.importorskip("httpx")


def test_a_server_that_exits_first_says_so(tmp_path):
    server = ServeProcess(["--config", str(tmp_path / "missing.json")], start_timeout=120)
    with pytest.raises(RuntimeError, match=r"tessellm serve exited with status [1-9]\d* before it was ready"):
        with server:
            pass
    assert server.proc.returncode not in (None, 0)
