"""Fault isolation: when a step's forward or decode raises, find the requests whose own run
raises, so only they fail and the rest of the batch goes on.

Without it, a request that breaks a plugin (an odd length a kernel mishandles, a sampling
setting a decoder rejects late) would take every request batched beside it down too.
"""

from __future__ import annotations

from typing import Callable

from tessellm.core.interfaces.batch import ScheduledSeq
from tessellm.core.interfaces.sequence import Sequence


def find_culprits(items: list[ScheduledSeq], others: list[Sequence],
                  run_alone: Callable[[ScheduledSeq], object]) -> dict[str, BaseException]:
    """Run each scheduled item alone through ``run_alone``; return, per request id, the first
    error a request's own run raised. Every random generator of the items' sequences and of
    ``others`` (their forked children) is restored afterwards, so a request that did not fail
    draws the same tokens when its step runs again."""
    seqs = [item.seq for item in items] + others
    saved = [(s, s.generator.get_state()) for s in seqs if s.generator is not None]
    culprits: dict[str, BaseException] = {}
    try:
        for item in items:
            try:
                run_alone(item)
            except Exception as exc:
                culprits.setdefault(item.seq.request_id, exc)
    finally:
        for seq, state in saved:
            seq.generator.set_state(state)
    return culprits
