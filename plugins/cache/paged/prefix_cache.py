"""The prefix cache of `paged`: full blocks indexed by content, so a request whose prompt
starts like an earlier one reuses its blocks instead of recomputing them.

A full block's key is a hash chained over every token before it and the request's
``cache_salt``, so equal keys mean equal whole prefixes under the same tenant. A block that
an image of the prompt overlaps has the image's content key in its own (``images_key``): the
placeholder ids of two images are the same, so only the same image there shares it. Keys live in
the block pool (``BlockPool.register`` / ``lookup``); this class keeps, per sequence, the keys
of its leading full blocks (so each block is hashed once) and the lookup statistics.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Callable

from tessellm.core.interfaces.cache import PrefixCacheStats
from tessellm.core.interfaces.multimodal import images_key
from tessellm.core.interfaces.sequence import Sequence
from tessellm.plugins.cache.paged.block_pool import BlockPool

_ROOT = b"tessellm-prefix-v1"


def block_key(parent: bytes | None, tokens: list[int], salt: str | None, images: bytes = b"") -> bytes:
    """Content key of a full block: a hash of the key before it (or of the salt, for the
    first block), its token ids and the images it overlaps (``images_key``; b"" for none),
    so equal keys mean equal whole prefixes."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(_ROOT)
        h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    else:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    if images:
        h.update(b"\x1fimages")
        h.update(images)
    return h.digest()


def _images_of(seq: Sequence, index: int, block_size: int) -> bytes:
    """What the prompt's images add to block ``index``'s key (b"" for a text prompt)."""
    return images_key(seq.images, index * block_size, (index + 1) * block_size) if seq.multimodal else b""


class PrefixCache:
    """Per-sequence content keys over a ``BlockPool``'s index.

    Contract: ``match(seq)`` returns the cached blocks holding the longest prefix of the
    sequence's tokens (each referenced once more for it), leaving at least one token to
    compute; ``index(seq, table)`` registers the blocks that ``seq.num_computed_tokens`` has
    newly filled; a lookup counts in ``stats`` at the sequence's first ``index`` (a sequence
    that could not start after all, and is looked up again, is not a second query).
    """

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool):
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.keys: dict[int, list[bytes]] = {}  # seq_id -> content keys of its leading full blocks
        self.lookups: dict[int, tuple[int, int]] = {}
        """seq_id -> (tokens looked up, tokens hit), from ``match`` until the sequence first runs."""
        self.stats = PrefixCacheStats()
        self.null: int | None = None
        """A table entry that holds nothing (a released one) and is never indexed."""
        self.fetch: Callable[[bytes], int | None] | None = None
        """Where the device index misses: a block loaded from a lower tier (referenced once,
        indexed) or None (tiers/stack.py)."""
        self.on_full: Callable[[int, bytes], None] | None = None
        """Told (block, key) when a block is first indexed: a tier writes it through."""

    def chain(self, seq: Sequence):
        """The content keys of the full blocks a match may reuse, in order (lazily)."""
        bs = self.block_size
        tokens = seq.token_ids
        parent = None
        for i in range((len(tokens) - 1) // bs):  # the last token is computed: its logits sample
            parent = block_key(parent, tokens[i * bs:(i + 1) * bs], seq.cache_salt, _images_of(seq, i, bs))
            yield parent

    def match(self, seq: Sequence) -> list[int]:
        blocks: list[int] = []
        keys: list[bytes] = []
        for key in self.chain(seq):
            block = self.pool.lookup(key)
            if block is not None:
                self.pool.incref(block)
            elif self.fetch is None or (block := self.fetch(key)) is None:
                break
            blocks.append(block)
            keys.append(key)
        self.keys[seq.seq_id] = keys
        self.lookups[seq.seq_id] = (len(seq.token_ids), len(blocks) * self.block_size)
        return blocks

    def index(self, seq: Sequence, table: list[int]) -> None:
        lookup = self.lookups.pop(seq.seq_id, None) if self.lookups else None
        if lookup is not None:
            self.stats.queried_tokens += lookup[0]
            self.stats.hit_tokens += lookup[1]
        if not self.enabled:
            return
        full = seq.num_computed_tokens // self.block_size
        keys = self.keys.get(seq.seq_id)
        if keys is None:
            keys = self.keys[seq.seq_id] = []
        elif len(keys) >= full:  # no block newly full: the usual decode step
            return
        bs = self.block_size
        for i in range(len(keys), min(full, len(table))):
            key = block_key(keys[-1] if keys else None, seq.token_ids[i * bs:(i + 1) * bs], seq.cache_salt,
                            _images_of(seq, i, bs))
            if table[i] != self.null:
                self.pool.register(table[i], key)
                if self.on_full is not None and self.pool.lookup(key) == table[i]:
                    self.on_full(table[i], key)
            keys.append(key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if parent.seq_id in self.keys:
            self.keys[child.seq_id] = list(self.keys[parent.seq_id])

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        keys = self.keys.get(seq.seq_id)
        if keys is not None:
            del keys[num_tokens // self.block_size:]

    def forget(self, seq: Sequence) -> None:
        self.keys.pop(seq.seq_id, None)
        self.lookups.pop(seq.seq_id, None)

    def reset(self) -> int:
        """Forget all cached content; returns the blocks whose content was dropped."""
        for keys in self.keys.values():
            keys.clear()
        return self.pool.reset_prefix_cache()
