"""``prefix-aware``: a request goes to the replica most likely to hold its prompt's prefix in
its prefix cache, unless the load is out of balance (SGLang's cache-aware routing).

The router cannot see the replicas' caches, so the policy keeps, per replica, an approximate
record of the prompt prefixes it sent there: the chained hashes of the prompt's
``block_chars``-character blocks (block i's hash covers blocks 0..i, so a recorded hash stands
for its whole prefix), at most ``max_blocks`` of them per replica, least recently used
evicted first. A prompt is recorded with its first block most recent, so eviction takes the
ends of long prompts before their shared beginnings, and a prefix match never has holes.

Choosing, for a request whose prompt is ``text``:

1. Load out of balance (the most loaded replica has more than ``balance_abs_threshold``
   requests in flight beyond the least loaded, and more than ``balance_rel_threshold`` times
   as many): the least loaded replica, whatever the prefixes.
2. Else the replica whose record matches the longest prefix of ``text``, if that prefix is
   more than ``match_threshold`` of the text (ties: the least loaded of them).
3. Else the least loaded replica: a new prefix starts where it costs least.

Text, not tokens: the router does not tokenize; characters are a close stand-in for a
tokenizer's prefix (a shared text prefix is a shared token prefix but for its last token).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from pydantic import Field

from tessellm.core.hookspecs import hookimpl
from tessellm.core.interfaces.routing import ReplicaState, RouteRequest, RoutingPolicy, least_loaded
from tessellm.core.plugin import PluginOptions


class PrefixAwareOptions(PluginOptions):
    block_chars: int = Field(64, ge=1, le=1 << 16)
    """Characters per hashed block: prefixes are matched in whole blocks (a prompt shorter than
    one block is never matched, only balanced)."""
    max_blocks: int = Field(1 << 16, ge=1, le=1 << 26)
    """Blocks recorded per replica at most (a few dozen bytes each); the least recently sent
    go first."""
    match_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """Route by prefix only when the best match covers more than this share of the prompt's text."""
    balance_abs_threshold: int = Field(8, ge=0)
    """The load counts as out of balance when the most loaded replica has more than this many
    requests in flight beyond the least loaded ..."""
    balance_rel_threshold: float = Field(1.5, ge=1.0)
    """... and more than this many times as many."""


def block_hashes(text: str, block_chars: int) -> list[int]:
    """The chained hashes of ``text``'s whole ``block_chars``-character blocks: hash i depends
    on blocks 0..i, so equal hashes at i mean (but for a collision) equal prefixes."""
    hashes, previous = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hash((previous, text[start:start + block_chars]))
        hashes.append(previous)
    return hashes


class PrefixRecord:
    """The prefixes sent to one replica, as block hashes in least-recently-used order (the
    dict's order: oldest first), at most ``max_blocks`` of them."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def matched(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` are recorded."""
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count

    def insert(self, hashes: list[int]) -> None:
        """Record a prompt's blocks, its first block most recent (so a prefix outlives its
        continuations), then evict the least recent beyond ``max_blocks``."""
        for h in reversed(hashes):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


class PrefixAware(RoutingPolicy):
    """The replica whose recorded prefixes match the prompt longest, while the load is balanced."""

    name = "prefix-aware"
    api_version = "1.19"
    description = "to the replica most likely to hold the prompt's prefix, while the load is balanced"
    Options = PrefixAwareOptions

    def __init__(self, options: PrefixAwareOptions, num_replicas: int):
        super().__init__(options, num_replicas)
        self.records = [PrefixRecord(options.max_blocks) for _ in range(num_replicas)]
        self._last: tuple[str, list[int]] = ("", [])  # the last text hashed, and its hashes
        self.counts = {"looked_up_chars": 0, "matched_chars": 0, "routed_by_prefix": 0, "routed_by_load": 0,
                       "routed_for_balance": 0}

    def hashes(self, text: str) -> list[int]:
        """``block_hashes(text)``, computed once for choose and routed of one request."""
        if self._last[0] is not text:
            self._last = (text, block_hashes(text, self.options.block_chars))
        return self._last[1]

    def imbalanced(self, replicas: Sequence[ReplicaState]) -> bool:
        low = min(r.in_flight for r in replicas)
        high = max(r.in_flight for r in replicas)
        o = self.options
        return high - low > o.balance_abs_threshold and high > o.balance_rel_threshold * low

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        hashes = self.hashes(request.text)
        matched = {r.index: self.records[r.index].matched(hashes) for r in replicas}
        best = max(replicas, key=lambda r: (matched[r.index], -r.in_flight, -r.routed, -r.index))
        self.counts["looked_up_chars"] += len(request.text)
        if self.imbalanced(replicas):
            self.counts["routed_for_balance"] += 1
            chosen = least_loaded(replicas)
        elif request.text and matched[best.index] * self.options.block_chars > self.options.match_threshold * len(
                request.text):
            self.counts["routed_by_prefix"] += 1
            chosen = best
        else:
            self.counts["routed_by_load"] += 1
            chosen = least_loaded(replicas)
        self.counts["matched_chars"] += matched[chosen.index] * self.options.block_chars
        return chosen.index

    def routed(self, request: RouteRequest, index: int) -> None:
        self.records[index].insert(self.hashes(request.text))

    def replica_down(self, index: int) -> None:
        self.records[index].clear()  # a replica that comes back has lost its cache, or may have

    def stats(self) -> dict[str, float]:
        looked = self.counts["looked_up_chars"]
        return {**self.counts, "prefix_match_ratio": self.counts["matched_chars"] / looked if looked else 0.0,
                "recorded_blocks": sum(len(r) for r in self.records)}


@hookimpl
def register_routing(register):
    register(PrefixAware)
