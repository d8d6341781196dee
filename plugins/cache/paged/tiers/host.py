"""The host-memory tier: blocks evicted from the device, kept in a fixed arena of host
memory (pinned when the device is a GPU, so copies run asynchronously) with least-recently-
used eviction."""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    """``capacity`` block buffers of ``block_bytes`` each, indexed by content key.

    Contract: ``slot_for(key)`` returns the buffer to write a new block into (evicting the
    least recently used entry when full; the evicted key is reported by ``last_evicted``);
    ``get(key)`` returns a stored block's buffer and marks it most recently used; a key is
    stored at most once.
    """

    name = "host"

    def __init__(self, capacity: int, block_bytes: int, pin: bool):
        if capacity < 1:
            raise ValueError(f"the host tier holds no block: {capacity} blocks of {block_bytes} bytes")
        self.capacity = capacity
        # torch.empty: on the CPU, pages are committed only as blocks are written
        self.arena = torch.empty(capacity, block_bytes, dtype=torch.uint8, pin_memory=pin)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.last_evicted: bytes | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def get(self, key: bytes) -> torch.Tensor | None:
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        self._slot_of.move_to_end(key)
        return self.arena[slot]

    def slot_for(self, key: bytes) -> torch.Tensor:
        """The buffer ``key``'s block is to be written into, now indexed under ``key``."""
        self.last_evicted = None
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            return self.arena[self._slot_of[key]]
        if self._free:
            slot = self._free.pop()
        else:
            self.last_evicted, slot = self._slot_of.popitem(last=False)
        self._slot_of[key] = slot
        return self.arena[slot]

    def discard(self, key: bytes) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> int:
        dropped = len(self._slot_of)
        self._free.extend(self._slot_of.values())
        self._slot_of.clear()
        return dropped
