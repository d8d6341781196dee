"""How a distributed run fails: a rank that lost its peers ends with ``TensorParallelError``
(below the group and the stages, which both raise it)."""

from __future__ import annotations

from typing import Any

from tessellm.core.errors import TessellmError


class TensorParallelError(TessellmError, RuntimeError):
    """A rank of a tensor-parallel run stopped answering or diverged: every rank ends with it."""


def lost_peer(tp: Any, what: str, exc: BaseException) -> TensorParallelError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return TensorParallelError(f"tensor parallel: rank {tp.rank} of {tp.size} lost its peers in {what} ({first}); "
                               f"the rank that failed printed its own error")
