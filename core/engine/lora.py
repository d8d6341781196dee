"""Which LoRA adapters a pipeline serves and which of them sit in the device's slots.

Every registered adapter is held in host memory; ``max_loras`` of them at once are copied
into the wrapped layers' device slots. A request pins its adapter's slot from admission to
finish (``acquire`` / ``release``); an adapter nobody pins stays resident until a request
for another one needs its slot, the least recently used first. When every slot is pinned,
``acquire`` returns None and the engine holds that request back (the others run on).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from pathlib import Path

from tessellm.core.errors import LoraAdapterError
from tessellm.core.model.lora import AdapterReader, LoraAdapter, LoraLinear

logger = logging.getLogger(__name__)
_uids = itertools.count(1)


class LoraAdapters:
    """The registered adapters (by name) and the device slots they occupy.

    ``register`` reads and validates a PEFT folder (``LoraAdapterError`` naming what is
    wrong); ``unregister`` refuses new requests for the name at once and frees its slot when
    the last request using it finishes. ``acquire(name)`` makes the adapter resident and pins
    it, returning its slot (None: every slot is pinned); ``release(slot)`` unpins."""

    def __init__(self, layers: dict[str, LoraLinear], reader: AdapterReader, num_slots: int):
        self.layers = layers
        self.reader = reader
        self.num_slots = num_slots
        self.adapters: dict[str, LoraAdapter] = {}
        self._resident: OrderedDict[int, int] = OrderedDict()  # uid -> slot, least recently used first
        self._slot_uid: list[int | None] = [None] * num_slots
        self._pins = [0] * num_slots
        self.loads = 0
        """Adapters copied into a slot so far (a resident adapter's next request copies nothing)."""

    @property
    def max_rank(self) -> int:
        return self.reader.max_rank

    def register(self, name: str, path: str | Path, adapter: LoraAdapter | None = None) -> LoraAdapter:
        """Register the adapter in the PEFT folder ``path`` as ``name``; ``adapter``, if given,
        is that folder already read by ``reader.read(name, path)`` (on another thread, say)."""
        if not name or not isinstance(name, str):
            raise LoraAdapterError("a LoRA adapter needs a non-empty name")
        if name in self.adapters:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded (from {self.adapters[name].path!r}); "
                                   f"unload it first to load another under that name")
        adapter = adapter if adapter is not None else self.reader.read(name, path)
        adapter.uid = next(_uids)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %r registered from %s (rank %d, %d layers)", name, adapter.path, adapter.rank,
                    len(adapter.modules))
        return adapter

    def unregister(self, name: str) -> None:
        adapter = self.get(name)
        del self.adapters[name]
        slot = self._resident.get(adapter.uid)
        if slot is not None and not self._pins[slot]:
            self._free(slot)

    def get(self, name: str) -> LoraAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded; loaded adapters: {known}")
        return adapter

    def acquire(self, name: str) -> int | None:
        """Pin ``name``'s slot, copying it in first if it is not resident; None if every slot
        is pinned by requests still running."""
        adapter = self.get(name)
        slot = self._resident.get(adapter.uid)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._load(slot, adapter)
        self._resident.move_to_end(adapter.uid)
        self._pins[slot] += 1
        return slot

    def pin(self, slot: int) -> None:
        """One more holder of a slot already pinned (a forked sample of the same request)."""
        self._pins[slot] += 1

    def release(self, slot: int) -> None:
        self._pins[slot] -= 1
        uid = self._slot_uid[slot]
        if not self._pins[slot] and uid not in {a.uid for a in self.adapters.values()}:
            self._free(slot)  # unloaded while requests used it

    def resident(self) -> list[str]:
        """Names of the adapters in device slots, least recently used first."""
        names = {a.uid: a.name for a in self.adapters.values()}
        return [names[uid] for uid in self._resident if uid in names]

    def num_pinned(self) -> int:
        return sum(1 for p in self._pins if p)

    def _free_slot(self) -> int | None:
        for slot, uid in enumerate(self._slot_uid):
            if uid is None:
                return slot
        for uid, slot in self._resident.items():  # least recently used first
            if not self._pins[slot]:
                self._free(slot)
                return slot
        return None

    def _free(self, slot: int) -> None:
        uid = self._slot_uid[slot]
        self._slot_uid[slot] = None
        self._resident.pop(uid, None)

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        for path, layer in self.layers.items():
            layer.load_slot(slot, adapter.modules.get(path, {}))
        self._slot_uid[slot] = adapter.uid
        self._resident[adapter.uid] = slot
        self.loads += 1
