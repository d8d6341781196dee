"""The block allocator behind paged caches: a free list, reference counts and an index of
full blocks by content hash, with least-recently-used eviction of cached blocks.

A block is in exactly one of three states:

- free: on the free list, holding nothing anyone wants (reference count 0, no hash);
- in use: referenced by one or more sequences' block tables (count >= 1, maybe hashed);
- cached: unreferenced but holding a full block of known content (count 0, hashed), kept
  for a later request with the same prefix and evicted, oldest release first, when an
  allocation finds the free list empty.

Free plus cached blocks are what can be handed out; the property tests check the three
states partition the pool at every step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable


class BlockPool:
    """Hands out block ids in [0, num_blocks) and takes them back.

    Contract: ``allocate`` returns a block with reference count 1 (evicting the least
    recently released cached block if nothing is free; RuntimeError if neither exists);
    ``incref``/``decref`` count table references (a cached block revived by ``incref`` leaves
    the eviction queue; a block whose count drops to 0 goes back to the free list, or to the
    eviction queue if it is hashed); ``register(block, key)`` indexes a full in-use block by
    its content key (the first block registered for a key keeps it); ``lookup(key)`` finds one.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, not {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest release first
        self._key_of: dict[int, bytes] = {}  # block -> content key
        self._block_of: dict[bytes, int] = {}  # content key -> block
        self.evictions = 0
        self.on_evict: Callable[[int, bytes], None] | None = None
        """Told (block, content key) just before a cached block is reused: a tiered cache
        writes the content down there (tiers/stack.py)."""

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their content (evictable)."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free

    def free_blocks(self) -> set[int]:
        return set(self._free)

    def cached_blocks(self) -> set[int]:
        return set(self._evictable)

    # ------------------------------------------------------------------ allocation

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(block)
            del self._block_of[key]
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(block, key)
        else:
            raise RuntimeError(f"no free KV block: all {self.num_blocks} are in use")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            if block not in self._evictable:
                raise RuntimeError(f"block {block} is free; only in-use or cached blocks can be shared")
            del self._evictable[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        count = self.ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"block {block} released more often than it was referenced")
        self.ref_counts[block] = count - 1
        if count == 1:
            if block in self._key_of:
                self._evictable[block] = None  # newest release: evicted last
            else:
                self._free.append(block)

    # ------------------------------------------------------------------ content index

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is indexed by content (so must never be written again)."""
        return block in self._key_of

    def register(self, block: int, key: bytes) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} is not in use; only written blocks can be indexed")
        if key in self._block_of or block in self._key_of:
            return  # the same content is cached already (or this block is): keep the first
        self._block_of[key] = block
        self._key_of[block] = key

    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's content (freeing the unreferenced ones); return how
        many were dropped. In-use blocks stay in use but will not be matched again."""
        dropped = len(self._key_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        return dropped
