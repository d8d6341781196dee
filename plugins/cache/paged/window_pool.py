"""The allocator of a paged cache that frees what sliding windows no longer see: one arena of
layer-blocks shared by the full-attention layers and the sliding-window ones.

A *unit* is one layer's K and V for ``block_size`` tokens. A logical block of a sequence
holds a *full run* (one unit per full-attention layer: unit ``t`` of the run is full layer
``t``'s) and, while some window still sees it, a *sliding run* (the same for the sliding
layers). A run is named by its first unit, so the layer at index ``t`` of its kind reads
block id ``p`` at unit ``p + t``: each layer's storage is a view of the arena offset by ``t``
units, and one block table per kind serves all its layers.

Runs are carved from superblocks of ``lcm(full, sliding)`` units, each given whole to one
kind when that kind runs out (Gemma 3's 4 full and 22 sliding layers: 11 full runs or 2
sliding ones a superblock; Gemma 2's and GPT-OSS's equal counts: one run of either). A
superblock whose runs are all free is whole again; one whose runs are all free or cached can
be reclaimed by the other kind (its cached runs evicted). So memory flows between the kinds:
short sequences use memory as a cache without freeing would, and the sliding runs long
sequences release become full runs for more tokens.

Each kind's ``RunPool`` keeps ``BlockPool``'s contract (free, in use, cached by content,
least recently released evicted first) over its run ids.
"""

from __future__ import annotations

import math
from collections import OrderedDict

FULL, SLIDING = 0, 1
KIND_NAMES = ("full-attention", "sliding-window")


class RunPool:
    """One kind's runs (``SplitArena.pools[kind]``), with ``BlockPool``'s contract over run
    ids, for the block tables, the prefix cache and copy-on-write."""

    def __init__(self, arena: "SplitArena", kind: int):
        self.arena = arena
        self.kind = kind
        self.size = arena.sizes[kind]
        self.per_superblock = arena.width // self.size
        self.ref_counts = arena.ref_counts  # indexed by run id (first unit); both kinds share it
        self._free: OrderedDict[int, None] = OrderedDict()  # runs of this kind's superblocks, free
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached runs, oldest release first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Runs ``allocate`` can hand out now (free, from whole or reclaimable superblocks,
        or cached)."""
        arena = self.arena
        return (len(self._free) + len(self._evictable)
                + (len(arena.whole) + arena.num_reclaimable(self.kind)) * self.per_superblock)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_blocks(self) -> int:
        """Superblocks this cache can hand out (the reserved one excluded)."""
        return self.arena.num_superblocks - 1

    @property
    def num_used(self) -> int:
        return sum(self.arena.in_use[s] for s in range(self.arena.num_superblocks) if self.arena.owner[s] == self.kind)

    def free_blocks(self) -> set[int]:
        return set(self._free)

    def cached_blocks(self) -> set[int]:
        return set(self._evictable)

    # ------------------------------------------------------------------ allocation

    def allocate(self) -> int:
        arena = self.arena
        if not self._free and not arena.whole and not self._evictable:
            arena.reclaim_for(self.kind)
        if self._free:
            run, _ = self._free.popitem(last=False)
        elif arena.whole:
            run = arena.split(arena.whole.popitem(last=False)[0], self.kind)
        elif self._evictable:
            run, _ = self._evictable.popitem(last=False)
            self._forget(run)
            self.evictions += 1
        else:
            raise RuntimeError(f"no free KV block for the {KIND_NAMES[self.kind]} layers: all "
                               f"{self.num_blocks} superblocks are in use")
        self.ref_counts[run] = 1
        arena.in_use[arena.superblock_of(run)] += 1
        arena.units_in_use += self.size
        return run

    def incref(self, run: int) -> None:
        if self.ref_counts[run] == 0:
            if run not in self._evictable:
                raise RuntimeError(f"block {run} is free; only in-use or cached blocks can be shared")
            del self._evictable[run]
            self.arena.in_use[self.arena.superblock_of(run)] += 1
            self.arena.units_in_use += self.size
        self.ref_counts[run] += 1

    def decref(self, run: int) -> None:
        count = self.ref_counts[run]
        if count <= 0:
            raise RuntimeError(f"block {run} released more often than it was referenced")
        self.ref_counts[run] = count - 1
        if count == 1:
            self.arena.in_use[self.arena.superblock_of(run)] -= 1
            self.arena.units_in_use -= self.size
            if run in self._key_of:
                self._evictable[run] = None
            else:
                self._free[run] = None
                self.arena.merge_if_free(self.arena.superblock_of(run))

    def _forget(self, run: int) -> None:
        """Drop a run's content key (it is being reused or reclaimed)."""
        del self._block_of[self._key_of.pop(run)]

    # ------------------------------------------------------------------ content index

    def is_cached(self, run: int) -> bool:
        return run in self._key_of

    def register(self, run: int, key: bytes) -> None:
        if self.ref_counts[run] <= 0:
            raise RuntimeError(f"block {run} is not in use; only written blocks can be indexed")
        if key in self._block_of or run in self._key_of:
            return
        self._block_of[key] = run
        self._key_of[run] = key

    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def reset_prefix_cache(self) -> int:
        dropped = len(self._key_of)
        evictable = list(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        for run in evictable:
            self._free[run] = None
        for superblock in {self.arena.superblock_of(r) for r in evictable}:
            self.arena.merge_if_free(superblock)
        return dropped


class SplitArena:
    """``num_superblocks`` superblocks of ``width`` units (the lcm of the two kinds' run
    sizes ``sizes``; a kind without layers has size 0 and no pool), superblock 0 kept out of
    every table: its first units are the null run a table's released entries point at (zeros,
    never written)."""

    def __init__(self, num_superblocks: int, sizes: tuple[int, int]):
        if num_superblocks < 2:
            raise ValueError(f"the arena needs at least 2 superblocks (one is reserved), not {num_superblocks}")
        self.num_superblocks = num_superblocks
        self.sizes = sizes
        self.width = math.lcm(*(s for s in sizes if s))
        self.ref_counts = [0] * (num_superblocks * self.width)
        self.owner: list[int | None] = [None] * num_superblocks
        self.in_use = [0] * num_superblocks  # runs with a reference, per superblock
        self.units_in_use = 0  # units of runs with a reference
        self.whole: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, num_superblocks))
        self.pools: dict[int, RunPool] = {kind: RunPool(self, kind) for kind in (FULL, SLIDING) if sizes[kind]}

    @property
    def num_units(self) -> int:
        return self.num_superblocks * self.width

    @property
    def null(self) -> int:
        """The run a released table entry points at (superblock 0's first units)."""
        return 0

    def superblock_of(self, run: int) -> int:
        return run // self.width

    def runs(self, superblock: int, kind: int) -> range:
        size = self.sizes[kind]
        return range(superblock * self.width, (superblock + 1) * self.width, size)

    def split(self, superblock: int, kind: int) -> int:
        """Give a whole superblock to ``kind``: its first run, the others free."""
        self.owner[superblock] = kind
        first, *rest = self.runs(superblock, kind)
        self.pools[kind]._free.update((run, None) for run in rest)
        return first

    def merge_if_free(self, superblock: int) -> None:
        """A superblock whose runs are all free is whole again."""
        kind = self.owner[superblock]
        pool = self.pools[kind]
        if self.in_use[superblock] or any(run in pool._evictable for run in self.runs(superblock, kind)):
            return
        for run in self.runs(superblock, kind):
            del pool._free[run]
        self.owner[superblock] = None
        self.whole[superblock] = None

    def reclaimable(self, kind: int) -> list[int]:
        """Superblocks of the other kinds with no run in use (only free and cached ones)."""
        return [s for s in range(1, self.num_superblocks)
                if self.owner[s] is not None and self.owner[s] != kind and not self.in_use[s]]

    def num_reclaimable(self, kind: int) -> int:
        return len(self.reclaimable(kind))

    def reclaim_for(self, kind: int, count: int = 1) -> int:
        """Make up to ``count`` superblocks of other kinds whole for ``kind``, evicting their
        cached runs, least recently released first; how many were made."""
        made = 0
        for superblock in self.reclaimable(kind)[:count]:
            pool = self.pools[self.owner[superblock]]
            for run in self.runs(superblock, pool.kind):
                if run in pool._evictable:
                    del pool._evictable[run]
                    pool._forget(run)
                    pool.evictions += 1
                    pool._free[run] = None
            self.merge_if_free(superblock)
            made += 1
        return made
