"""A request as the engine tracks it: its sequences and whether it has forked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessellm.core.interfaces.sequence import SamplingParams, Sequence


@dataclass
class RequestState:
    """A request's sequences: one, or ``params.n`` once the first forks after its prompt
    (parallel sampling). It is finished when every sequence is and the fork has happened."""

    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    forked: bool = False
    pooled: Any = None
    """A pooling pipeline's output for the request once it finished: its embedding or scores
    (a 1-D float32 tensor)."""

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.n == 1)
