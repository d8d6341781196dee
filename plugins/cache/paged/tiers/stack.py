"""The tiers below a paged cache's device blocks: host memory and a disk directory.

Where blocks move (keys are the prefix cache's content keys, prefix_cache.py):

- down, on eviction (write-back): a cached block the device pool evicts is copied into the
  host tier (when it is not there already);
- down, on commit (write-through): a newly full block is queued for the disk tier's writer
  thread, so the directory holds every prefix the process computed, and a restart (even
  after a crash) finds them;
- up, on a prefix lookup: where the device index misses, the host tier and then the disk
  tier are asked in turn; a hit is copied into a freshly allocated device block, which is
  indexed again, and a disk hit is kept in the host tier too.

On CUDA every copy runs on one copy stream: a write-back waits (on the GPU) for the steps
that wrote the block and the compute stream waits (on the GPU) for the copy before the block
is written again, so the host never blocks on a copy; loads are ordered the same way before
the step that reads them. On the CPU copies are plain memory copies on the step's thread.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from tessellm.plugins.cache.paged.block_pool import BlockPool
from tessellm.plugins.cache.paged.tiers.codec import BlockCodec
from tessellm.plugins.cache.paged.tiers.disk import DiskTier
from tessellm.plugins.cache.paged.tiers.host import HostTier


@dataclass
class TierCounters:
    hit_tokens: int = 0
    """Prompt tokens whose blocks this tier served to the device."""
    read_bytes: int = 0
    written_bytes: int = 0
    stored_blocks: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        return {"hit_tokens": self.hit_tokens, "read_bytes": self.read_bytes, "written_bytes": self.written_bytes,
                "stored_blocks": self.stored_blocks, **self.extra}


class TierStack:
    """The host and disk tiers (either may be None) of one paged cache's ``pool``."""

    def __init__(self, pool: BlockPool, codec: BlockCodec, block_size: int, host: HostTier | None,
                 disk: DiskTier | None):
        self.pool = pool
        self.codec = codec
        self.block_size = block_size
        self.host = host
        self.disk = disk
        self.cuda = codec.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(codec.device) if self.cuda else None
        self.counters = {t.name: TierCounters() for t in (host, disk) if t is not None}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tessellm-disk-read") if disk else None
        self._reads: dict[bytes, Future] = {}  # key -> its disk read, started by prefetch
        self._waits: dict[int, list[bytes]] = {}  # owner (a sequence id) -> the reads it waits for

    @property
    def writes_through(self) -> bool:
        """Whether newly full blocks go down at commit (``on_commit``)."""
        return self.disk is not None

    # ------------------------------------------------------------------ copies

    @contextlib.contextmanager
    def _on_copy_stream(self):
        """Run the copies inside on the copy stream, ordered after the compute stream's work
        so far and before its work from now on (both on the GPU; the host does not wait)."""
        if self._copy_stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.codec.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            yield
        compute.wait_stream(self._copy_stream)

    def _ready_event(self) -> Callable[[], None] | None:
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event.synchronize

    # ------------------------------------------------------------------ down

    def on_device_evict(self, block: int, key: bytes) -> None:
        """Write-back: the pool is about to reuse cached ``block`` (content ``key``)."""
        host = self.host
        if host is None:
            return
        if key in host:
            host.get(key)  # refreshed: it was just in use
            return
        buffer = host.slot_for(key)
        with self._on_copy_stream():
            self.codec.pack(block, buffer, non_blocking=self.cuda)
        counters = self.counters["host"]
        counters.written_bytes += self.codec.block_bytes
        counters.stored_blocks = len(host)

    def on_commit(self, block: int, key: bytes) -> None:
        """Write-through: ``block`` just became full with content ``key``."""
        disk = self.disk
        if disk is None or disk.known(key):  # no filesystem access on the step's thread
            return
        buffer = self.codec.empty(pin=self.cuda)
        with self._on_copy_stream():
            self.codec.pack(block, buffer, non_blocking=self.cuda)
        disk.write(key, buffer, self._ready_event())

    # ------------------------------------------------------------------ up

    def fetch(self, key: bytes) -> int | None:
        """A device block holding ``key``'s content, loaded from the host or disk tier
        (reference count 1, indexed), or None when no tier holds it or no block is free."""
        host, disk = self.host, self.disk
        in_host = host is not None and key in host
        if not in_host and (disk is None or key not in disk):
            return None
        if self.pool.num_free == 0:
            return None
        block = self.pool.allocate()  # may write back an evicted block to the host tier first
        source, tier = self._read(key)
        if source is None:  # gone meanwhile (the eviction above, another process, a bad file)
            self.pool.decref(block)
            return None
        with self._on_copy_stream():
            self.codec.unpack(source, block, non_blocking=self.cuda)
        self.pool.register(block, key)
        counters = self.counters[tier]
        counters.hit_tokens += self.block_size
        counters.read_bytes += self.codec.block_bytes
        return block

    def _read(self, key: bytes) -> tuple[torch.Tensor | None, str]:
        if self.host is not None:
            buffer = self.host.get(key)
            if buffer is not None:
                return buffer, "host"
        if self.disk is None:
            return None, "host"
        pending = self._reads.pop(key, None)
        data = pending.result() if pending is not None else self.disk.read(key)
        if data is None:
            return None, "disk"
        if self.host is not None:  # keep it nearer for the next hit
            slot = self.host.slot_for(key)
            if self._copy_stream is not None:  # the slot's last transfer may still be reading it
                self._copy_stream.synchronize()
            slot.copy_(data)
            data = slot
            self.counters["host"].stored_blocks = len(self.host)
        elif self.cuda:
            data = data.pin_memory()
        return data, "disk"

    # ------------------------------------------------------------------ reading ahead

    def prefetch(self, owner: int, keys: list[bytes]) -> None:
        """Start reading ``keys`` from the disk tier on the reader thread; ``owner`` (a
        sequence) is ``ready`` once they are all read."""
        for key in keys:
            if key not in self._reads:
                self._reads[key] = self._reader.submit(self.disk.read, key)
        self._waits[owner] = list(keys)

    def ready(self, owner: int) -> bool:
        keys = self._waits.get(owner)
        if keys is None:
            return True
        if all(key not in self._reads or self._reads[key].done() for key in keys):
            del self._waits[owner]
            return True
        return False

    def forget(self, owner: int) -> None:
        """``owner`` no longer waits; reads nobody else waits for are dropped once done."""
        keys = self._waits.pop(owner, None)
        if not keys:
            return
        wanted = {k for ks in self._waits.values() for k in ks}
        for key in keys:
            read = self._reads.get(key)
            if read is not None and key not in wanted and read.done():
                del self._reads[key]

    # ------------------------------------------------------------------ upkeep

    def stats(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, counters in self.counters.items():
            if name == "disk" and self.disk is not None:
                s = self.disk.stats
                counters.written_bytes = s["write_bytes"]
                counters.stored_blocks = self.disk.num_blocks
                counters.extra = {k: s[k] for k in ("dropped_writes", "unreadable", "evictions")}
            out[name] = counters.as_dict()
        return out

    def flush(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        if self.disk is not None:
            self.disk.flush()

    def clear(self) -> int:
        """Drop every block of every tier (the weights changed); returns how many."""
        self.flush()
        return (self.host.clear() if self.host else 0) + (self.disk.clear() if self.disk else 0)

    def close(self) -> None:
        self.flush()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reads.clear()
            self._waits.clear()
        if self.disk is not None:
            self.disk.close()
