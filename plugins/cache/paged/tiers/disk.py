"""The disk tier: blocks as files under a directory, keyed by content and fingerprinted by
model and layout, so they outlive the process and serve the next one.

Layout: ``<path>/<fingerprint>/<key[:2]>/<key>.kv``, one file a block: a header (magic,
fingerprint, key, payload length, CRC-32 of the payload) and the packed block (codec.py).
The fingerprint (model weights, dtype, quantization, attention backend, cache layout, tensor-
parallel rank) names the directory and is checked again in every header: a different model
or layout never reads these files. A file that is truncated, corrupt or foreign is a miss,
logged once and removed, never an error or a wrong answer.

Writes run on one background thread (the step never waits for the disk): each goes to a
temporary file in the same directory and is renamed into place, so a reader, in this
process or another on the same directory, sees a whole file or none. The tier keeps its
directory under ``capacity_bytes``, evicting the least recently used files (a hit touches
the file's modification time, so the order survives a restart).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)
_open_tiers: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()


@atexit.register
def _flush_open_tiers() -> None:
    """At exit, queued writes still reach the disk (the writer thread is a daemon)."""
    for tier in list(_open_tiers):
        tier.flush()

MAGIC = b"TSLMKV01"
HEADER = struct.Struct("<8s16s16sQI")  # magic, fingerprint, key, payload bytes, crc32 of the payload
_STALE_TEMP_S = 600.0  # a temporary file this old belongs to a writer that died


class DiskTier:
    """Blocks of ``block_bytes`` under ``root / fingerprint``, at most ``capacity_bytes``.

    Thread-safe: the engine's thread, the writer thread and a reader thread (prefetch) share
    it. Contract: ``write(key, buffer, ready)`` queues a block for the writer thread (``ready``,
    if given, is waited on before the buffer is read: an asynchronous device copy), or drops
    it when ``max_pending`` writes wait already; ``read(key)`` returns the block's buffer or
    None (missing, or unreadable: logged and removed); ``flush()`` returns once every queued
    write is on disk.
    """

    name = "disk"

    def __init__(self, root: str | Path, fingerprint: bytes, capacity_bytes: int, block_bytes: int,
                 max_pending: int = 256):
        if len(fingerprint) != 16:
            raise ValueError("a disk tier's fingerprint is 16 bytes")
        self.fingerprint = fingerprint
        self.dir = Path(root).expanduser() / fingerprint.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.capacity_bytes = capacity_bytes
        if capacity_bytes < self.file_bytes:
            raise ValueError(f"disk tier capacity {capacity_bytes} bytes holds no block of {self.file_bytes}")
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, None] = OrderedDict()  # keys on disk, least recently used first
        self._pending: set[bytes] = set()
        self.stats = {"writes": 0, "write_bytes": 0, "dropped_writes": 0, "reads": 0, "read_bytes": 0,
                      "unreadable": 0, "evictions": 0}
        self._scan()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._writer = threading.Thread(target=self._write_loop, name="tessellm-disk-tier", daemon=True)
        self._writer.start()
        _open_tiers.add(self)

    # ------------------------------------------------------------------ index

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.kv"

    def _scan(self) -> None:
        """Index the files already here (a restart), oldest use first; drop dead temporaries."""
        found = []
        now = time.time()
        for path in self.dir.glob("*/*"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if path.name.startswith(".tmp-"):
                if now - st.st_mtime > _STALE_TEMP_S:
                    path.unlink(missing_ok=True)
                continue
            if path.suffix == ".kv" and len(path.stem) == 32:
                found.append((st.st_mtime, bytes.fromhex(path.stem)))
        for _, key in sorted(found):
            self._files[key] = None

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    @property
    def used_bytes(self) -> int:
        return len(self._files) * self.file_bytes

    def known(self, key: bytes) -> bool:
        """Whether this process knows ``key`` is on disk or queued (no filesystem access)."""
        with self._lock:
            return key in self._files or key in self._pending

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._files:
                return True
        if self.path(key).exists():  # written by another process on the same directory
            with self._lock:
                self._files[key] = None
            return True
        return False

    # ------------------------------------------------------------------ reads

    def read(self, key: bytes) -> torch.Tensor | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:  # unreadable (permissions, I/O error): a miss, never a failed step
            logger.warning("disk tier: %s cannot be read (%s): treated as a miss", path, exc)
            self._forget(key)
            return None
        problem = self._check(data, key)
        if problem is not None:
            logger.warning("disk tier: %s is unreadable (%s): treated as a miss and removed", path, problem)
            path.unlink(missing_ok=True)
            with self._lock:
                self._files.pop(key, None)
                self.stats["unreadable"] += 1
            return None
        with contextlib.suppress(OSError):  # gone meanwhile, or read-only: the order is a hint
            os.utime(path)  # most recently used, also for the next process
        with self._lock:
            self._files[key] = None
            self._files.move_to_end(key)
            self.stats["reads"] += 1
            self.stats["read_bytes"] += self.block_bytes
        return torch.frombuffer(bytearray(data[HEADER.size:]), dtype=torch.uint8)

    def _check(self, data: bytes, key: bytes) -> str | None:
        if len(data) < HEADER.size:
            return f"{len(data)} bytes, shorter than a header"
        magic, fingerprint, stored_key, length, crc = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a tessellm block file"
        if fingerprint != self.fingerprint:
            return "written for another model or cache layout"
        if stored_key != key:
            return "holds another block"
        if length != self.block_bytes or len(data) != HEADER.size + length:
            return f"payload of {len(data) - HEADER.size} bytes, expected {self.block_bytes}"
        if zlib.crc32(memoryview(data)[HEADER.size:]) != crc:
            return "checksum mismatch"
        return None

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._files.pop(key, None)

    # ------------------------------------------------------------------ writes

    def write(self, key: bytes, buffer: torch.Tensor, ready: Callable[[], None] | None = None) -> bool:
        """Queue ``buffer`` (block_bytes uint8 on the host) to be written as ``key``; False if
        it is on disk or queued already, or was dropped because the writer is behind."""
        with self._lock:
            if key in self._files or key in self._pending:
                return False
            self._pending.add(key)
        try:
            self._queue.put_nowait((key, buffer, ready))
        except queue.Full:
            with self._lock:
                self._pending.discard(key)
                self.stats["dropped_writes"] += 1
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, buffer, ready = item
                if ready is not None:
                    ready()
                if not self.path(key).exists():  # another process may have written it
                    self._write_file(key, buffer)
            except OSError as exc:
                logger.warning("disk tier: writing a block failed (%s); it stays uncached on disk", exc)
            finally:
                if item is not None:
                    with self._lock:
                        self._pending.discard(item[0])
                self._queue.task_done()

    def _write_file(self, key: bytes, buffer: torch.Tensor) -> None:
        payload = buffer.numpy().tobytes()
        header = HEADER.pack(MAGIC, self.fingerprint, key, len(payload), zlib.crc32(payload))
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        temp = path.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{path.name}"
        with open(temp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(temp, path)  # atomic: readers see the whole file or none
        with self._lock:
            self._files[key] = None
            self.stats["writes"] += 1
            self.stats["write_bytes"] += len(payload)
            victims = []
            while len(self._files) * self.file_bytes > self.capacity_bytes:
                victims.append(self._files.popitem(last=False)[0])
            self.stats["evictions"] += len(victims)
        for victim in victims:
            self.path(victim).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self.flush()
            self._queue.put(None)
            self._writer.join()

    def clear(self) -> int:
        """Remove every block file of this fingerprint; returns how many."""
        self.flush()
        with self._lock:
            keys = list(self._files)
            self._files.clear()
        for key in keys:
            self.path(key).unlink(missing_ok=True)
        return len(keys)
