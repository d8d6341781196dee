"""Pipeline parallelism: the decoder layers split into contiguous stages, one per group of
``parallel.tensor`` ranks, each holding only its layers' weights and KV cache.

A step runs on every rank in lockstep (sync.py), as under tensor parallelism; only the
forward differs. The step's sequences are cut into micro-batches; stage 0 embeds each,
runs its layers and sends the hidden states on (without waiting for them to arrive), stage s
receives micro-batch k from stage s-1 while stage s+1 still runs k-1, and the last stage
runs the final norm and the LM head. Its logits are then broadcast to every rank, so that
every rank's decoder, logits processors and stop rules see the same rows and keep the same
state (beams, penalties, grammars, drafts), exactly as one rank would. Sending the logits
rather than sampled tokens costs rows x vocabulary values per step, which keeps every
decoder working unchanged; sampling on the last stage alone would send only tokens.

What stays idle: each step waits for its last micro-batch to leave the last stage before
the scheduler can pick the next, so with P stages and M micro-batches a stage idles for
(P-1)/(M+P-1) of a step (vLLM's virtual engines instead keep P disjoint sets of requests,
each with its own scheduler and share of the cache, in flight; one scheduler and one cache
keep prefix sharing and admission whole here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from tessellm.core.errors import ConfigError
from tessellm.core.parallel.errors import lost_peer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def plan_stages(num_layers: int, stages: int, layers: list[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's decoder layers [lo, hi): ``layers`` per stage as given, or as even as
    the count allows with the earlier stages taking the extra ones (the last also runs the
    LM head). A ConfigError names the allowed values."""
    if stages > num_layers:
        raise ConfigError(f"parallel.pipeline {stages} is more stages than this model's {num_layers} decoder "
                          f"layers; allowed: 1 to {num_layers}")
    if layers is None:
        base, extra = divmod(num_layers, stages)
        layers = [base + (1 if s < extra else 0) for s in range(stages)]
    elif len(layers) != stages or min(layers) < 1 or sum(layers) != num_layers:
        raise ConfigError(f"parallel.stage_layers {layers} must give each of the {stages} stages at least one "
                          f"layer and sum to the model's {num_layers} decoder layers")
    bounds, start = [], 0
    for count in layers:
        bounds.append((start, start + count))
        start += count
    return bounds


@dataclass
class PipelineStage:
    """Stage ``index`` of ``size``: its decoder layers [lo, hi), its neighbours (the rank of
    the same tensor-parallel index in the stage before and after) and ``group``, the process
    group activations and logits travel on. ``world`` names the run in errors."""

    index: int
    size: int
    tensor: int
    rank: int
    group: Any
    device: torch.device
    world: Any
    layers: tuple[int, int] = (0, 0)
    dtype: torch.dtype = torch.float32
    """The model's compute dtype: what activations travel in."""
    logits_dtype: torch.dtype = torch.float32
    _sends: list = field(default_factory=list)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    @property
    def logits_source(self) -> int:
        """The rank whose logits every rank takes: the last stage's first."""
        return (self.size - 1) * self.tensor

    def holds(self, name: str, tied_embedding: bool) -> bool:
        """Whether this stage keeps parameter ``name`` (the module's name): its layers', the
        embedding on the first stage (and on the last where the LM head shares it), the final
        norm and LM head on the last, and whatever else a family keeps at the top level."""
        match = _LAYER.match(name)
        if match:
            return self.layers[0] <= int(match[1]) < self.layers[1]
        if name.startswith("model.embed_tokens."):
            return self.first or (self.last and tied_embedding)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.last
        return True

    def receive(self, num_tokens: int, hidden: int) -> torch.Tensor:
        """The previous stage's hidden states for this micro-batch's ``num_tokens`` tokens."""
        import torch.distributed as dist

        x = torch.empty(num_tokens, hidden, dtype=self.dtype, device=self.device)
        self._guard(lambda: dist.recv(x, src=self.rank - self.tensor, group=self.group),
                    "receiving activations from the stage before")
        return x

    def send(self, x: torch.Tensor) -> None:
        """Hand ``x`` to the next stage without waiting for it to arrive (``finish``)."""
        import torch.distributed as dist

        x = x.contiguous()
        work = self._guard(lambda: dist.isend(x, dst=self.rank + self.tensor, group=self.group),
                           "sending activations to the next stage")
        self._sends.append((work, x))

    def share_logits(self, logits: torch.Tensor | None, rows: int, vocab: int) -> torch.Tensor:
        """The last stage's logits [rows, vocab] on every rank (``logits`` there, None elsewhere)."""
        import torch.distributed as dist

        if logits is None:
            logits = torch.empty(rows, vocab, dtype=self.logits_dtype, device=self.device)
        else:
            logits = logits.to(self.logits_dtype).contiguous()
        if self.size == 1:  # a lone stage (tests of the micro-batch path in one process)
            return logits
        self._guard(lambda: dist.broadcast(logits, src=self.logits_source, group=self.group),
                    "sharing the last stage's logits")
        return logits

    def finish(self) -> None:
        """Wait until every activation this step sent has been received."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            self._guard(work.wait, "sending activations to the next stage")

    def _guard(self, op: Any, what: str) -> Any:
        try:
            return op()
        except RuntimeError as exc:
            self._sends = []
            raise lost_peer(self.world, f"{what} (pipeline stage {self.index} of {self.size})", exc) from exc


def split_for_microbatches(token_counts: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut items with ``token_counts`` (in order) into at most ``parts`` contiguous, non-empty
    runs of near-equal token totals: the [start, end) of each run."""
    parts = max(1, min(parts, len(token_counts)))
    total = sum(token_counts)
    bounds, start, running = [], 0, 0
    for i, count in enumerate(token_counts):
        running += count
        left_items, left_parts = len(token_counts) - i - 1, parts - len(bounds) - 1
        # close a run once it reaches its share, keeping an item for every run still to come
        if left_parts and (running * parts >= total * (len(bounds) + 1) or left_items == left_parts):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(token_counts)))
    return [b for b in bounds if b[1] > b[0]]
