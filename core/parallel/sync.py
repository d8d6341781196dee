"""Rank 0 decides, the other ranks follow: how the ranks of a tensor-parallel pipeline stay
in lockstep.

Every rank runs the same engine over its own shard, and the cache managers, schedulers and
decoders of all ranks do the same work (each rank's cache holds its own heads' K/V, so each
must reserve, copy-on-write and roll back the same slots). What could make them differ is
sent from rank 0 with ``torch.distributed.broadcast_object_list``:

- the requests added and aborted since the last step (only rank 0 takes requests), sent at
  the start of each step;
- the scheduler's choice: rank 0's is sent and every follower checks its own against it
  (the same state gives the same choice; a difference is a bug, reported, never run);
- the decoder's drafts and the tokens it accepted: rank 0's replace the followers' own, so
  sampling (seeded identically anyway) cannot diverge on rounding.

Followers run ``follow``: take a message, act on it, until rank 0 says stop (at its exit).
"""

from __future__ import annotations

import atexit
import logging
from typing import TYPE_CHECKING, Any

from tessellm.core.parallel.group import TensorParallel, TensorParallelError, lost_peer

if TYPE_CHECKING:
    from tessellm.core.interfaces.batch import SchedulerOutput

logger = logging.getLogger(__name__)


class RankSync:
    """The engine's side of the lockstep: ``record`` (rank 0, as requests come and go),
    ``begin_step``, ``schedule``, ``drafts``, ``tokens`` and ``score`` (every rank, at the
    same points of a step: collectives in the same order on every rank)."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self.pending: list[tuple[str, dict[str, Any]]] = []
        self.broken = False  # a step failed mid-way: the ranks' collectives no longer line up
        if tp.is_leader:
            atexit.register(self.stop)

    def _share(self, value: Any, what: str) -> Any:
        """Rank 0's ``value``, on every rank."""
        import torch.distributed as dist

        box = [value if self.tp.is_leader else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.tp.group)
        except RuntimeError as exc:
            self.broken = True
            raise lost_peer(self.tp, what, exc) from exc
        return box[0]

    # ------------------------------------------------------------------ rank 0

    def record(self, op: str, **kwargs: Any) -> None:
        """Rank 0 admitted a request (``add``), aborted one (``abort``) or loaded or unloaded
        a LoRA adapter: the followers replay it before the next step (``FOLLOWED_OPS``)."""
        if self.tp.is_leader:
            self.pending.append((op, kwargs))

    def begin_step(self) -> None:
        if self.tp.is_leader:
            ops, self.pending = self.pending, []
            self._share(("step", ops), "sending the step's requests")

    def score(self, token_ids: list[int]) -> None:
        if self.tp.is_leader:
            self._share(("score", token_ids), "sending a scoring request")

    def stop(self) -> None:
        """Rank 0 is done (at its exit): the followers leave ``follow``."""
        if self.tp.is_leader and not self.broken:
            self.broken = True  # once
            try:
                self._share(("stop", None), "stopping the followers")
            except TensorParallelError as exc:  # the followers are gone already
                logger.warning("%s", exc)

    # ------------------------------------------------------------------ every rank

    def schedule(self, out: "SchedulerOutput") -> None:
        """Check this rank's scheduler chose what rank 0's did."""
        mine = [(i.seq.request_id, i.seq.sample_index, i.num_query_tokens) for i in out.scheduled]
        mine.append(sorted(s.request_id for s in out.preempted))
        theirs = self._share(mine, "comparing the step's schedule")
        if mine != theirs:
            self.broken = True
            raise TensorParallelError(f"tensor parallel: rank {self.tp.rank}'s scheduler chose {mine[:4]}..., rank "
                                      f"0's {theirs[:4]}...; the ranks diverged (a scheduler or cache plugin that "
                                      f"is not deterministic?)")

    def drafts(self, out: "SchedulerOutput", drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """Rank 0's drafts, keyed by this rank's sequence ids (sequence ids are per process:
        the ranks name a sequence by its request id and sample index)."""
        seqs = {i.seq.seq_id: (i.seq.request_id, i.seq.sample_index) for i in out.scheduled}
        shared = self._share({seqs[k]: v for k, v in drafts.items()}, "sharing the step's drafts")
        ids = {key: seq_id for seq_id, key in seqs.items()}
        return {ids[k]: v for k, v in shared.items()}

    def tokens(self, tokens: list[list[int]]) -> list[list[int]]:
        return self._share(tokens, "sharing the step's tokens")


FOLLOWED_OPS = {"add": "add_request", "abort": "abort", "load_lora": "load_lora", "unload_lora": "unload_lora"}
"""What rank 0 records (``RankSync.record``) -> the engine method a follower replays it with."""


def follow(engine: Any, sync: RankSync) -> None:  # engine: core/engine/engine.py's Engine (above this layer)
    """A follower's loop: replay rank 0's requests and run each step (or scoring) with it,
    until rank 0 stops."""
    while True:
        kind, body = sync._share(None, "waiting for rank 0")
        if kind == "stop":
            return
        if kind == "score":
            engine.score(body)
            continue
        for op, kwargs in body:
            getattr(engine, FOLLOWED_OPS[op])(**kwargs)
        engine.step()
