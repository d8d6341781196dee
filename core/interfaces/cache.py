"""The KV-cache manager interface: physical storage per layer (``KVStorage``, core/interfaces/kv.py)
and the logical-to-physical map of every sequence (its block table)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from tessellm.core.interfaces.kv import KVLayout, KVStorage
from tessellm.core.interfaces.sequence import Sequence
from tessellm.core.interfaces.spec import KVShape
from tessellm.core.plugin import Plugin, PluginOptions, SelectionContext


@dataclass(frozen=True)
class CacheSpec:
    """The model-side facts a cache needs to allocate storage. For an MLA model
    (``format`` "latent") ``num_kv_heads`` is 1 and ``head_dim`` the latent size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's compute dtype
    device: torch.device
    max_model_len: int
    format: str = "kv"  # the KVLayout format the model's attention needs (plugin API 1.4)
    layer_windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: the whole context); empty: no layer slides (plugin
    API 1.8). A cache may release what no window sees any more (`paged` does)."""
    fingerprint: str = ""
    """What the stored K/V values depend on besides the tokens (plugin API 1.12): a digest of
    the checkpoint, dtype, quantization, attention backend, tensor-parallel rank and tessellm
    version; K/V kept beyond the process (a disk tier) is keyed by it. Empty: unknown (such
    a cache keeps nothing beyond the process)."""
    layers: tuple[int, ...] = ()
    """The decoder layers whose K/V this cache stores (plugin API 1.13): a pipeline stage's
    run of layers, indexed as in the whole model; empty: every layer. A cache written for an
    older API stores every layer (correct, with idle memory for the other stages' layers)."""

    @property
    def held_layers(self) -> tuple[int, ...]:
        """The layers this cache stores (``layers``, or every one)."""
        return self.layers or tuple(range(self.num_layers))

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(self.format, self.num_kv_heads, self.head_dim)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups so far: prompt tokens looked up and tokens found cached (in any
    tier), and per lower tier (plugin API 1.12; e.g. "host", "disk") counters such as
    ``hit_tokens``, ``read_bytes``, ``written_bytes``, ``stored_blocks``."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class CacheManager(Plugin):
    """Owns KV storage and every sequence's block table.

    Contract:
    - ``kv_layout(options, ctx)`` declares the layout before construction.
    - ``reserve(seq, n)`` makes slots exist for tokens [0, n) of ``seq``, allocating blocks as
      needed; ``can_reserve`` answers first whether that fits. A shared (copy-on-write) block
      about to be written is copied here.
    - ``truncate(seq, n)`` drops slots past token n (speculative rollback); ``free(seq)``
      releases everything; ``fork(parent, child)`` gives the child the parent's tokens
      (sharing blocks where the layout allows); ``can_fork`` answers first whether it fits
      (if not, the engine lets the child recompute its prompt later instead).
    - ``match_prefix(seq)`` attaches cached blocks holding a prefix of the sequence's tokens
      (its prompt; also its output so far when it resumes after preemption) and returns how
      many tokens they cover (at most ``seq.num_tokens - 1``), and 0 for a sequence whose
      ``params.prompt_logprobs`` is set (every prompt position must run through the model to
      be scored; its blocks are still committed for others); ``commit(seq)`` is called after
      each step with ``seq.num_computed_tokens`` valid, so full blocks can be indexed.
    - ``max_seq_tokens`` is the most tokens one sequence can ever hold; the scheduler rejects
      requests above it at admission.
    """

    kind: ClassVar[str] = "cache"

    def __init__(self, options: PluginOptions, spec: CacheSpec, layout: KVLayout):
        self.options = options
        self.spec = spec
        self.layout = layout

    @classmethod
    @abstractmethod
    def kv_layout(cls, options: PluginOptions, ctx: SelectionContext) -> KVLayout:
        """The layout this cache will allocate for the pipeline in ``ctx``."""

    @abstractmethod
    def layer(self, index: int) -> KVStorage:
        """Storage of layer ``index``."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Total blocks."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including evictable cached ones)."""

    @property
    @abstractmethod
    def max_seq_tokens(self) -> int:
        """The most tokens a single sequence can ever occupy."""

    @abstractmethod
    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``reserve(seq, num_tokens)`` would succeed now."""

    @abstractmethod
    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Ensure slots for tokens [0, num_tokens) of ``seq``; raises RuntimeError if full."""

    def try_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """``reserve`` if it fits now, answering whether it did: one call for the common case
        of a scheduler's step (caches may override it to plan the reservation once)."""
        if not self.can_reserve(seq, num_tokens):
            return False
        self.reserve(seq, num_tokens)
        return True

    @abstractmethod
    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release slots of tokens at positions >= num_tokens."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every slot of ``seq``; a no-op for a sequence holding none."""

    @abstractmethod
    def can_fork(self, parent: Sequence) -> bool:
        """Whether ``fork(parent, child)`` would succeed now."""

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's cached tokens (its first ``parent.num_computed_tokens``)."""

    @abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """Physical block ids of ``seq``, in order."""

    @property
    def layer_groups(self) -> list[tuple[int, ...]]:
        """Layers that share a block table (plugin API 1.8): the first group's is
        ``block_table(seq)``, another's ``group_block_table(seq, group)``. One group of every
        layer by default; `paged` keeps a second one for sliding-window layers whose
        out-of-window blocks it releases. The engine builds a batch view and an attention plan
        per group."""
        return [self.spec.held_layers]

    def group_block_table(self, seq: Sequence, group: int) -> list[int]:
        """The block table of ``seq`` that layer group ``group`` reads (see ``layer_groups``)."""
        if group != 0:
            raise IndexError(f"cache {self.name!r} has one layer group; asked for group {group}")
        return self.block_table(seq)

    def limit_step_tokens(self, max_step_tokens: int | None) -> None:
        """The most query tokens a step gives one sequence (the scheduler's budget; None: no
        bound), told once the scheduler exists (plugin API 1.8): a cache that releases
        out-of-window blocks holds at most a window plus a step of them per sequence, so it may
        admit longer sequences (``max_seq_tokens``). Nothing by default."""

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks holding a prefix of ``seq``'s tokens; return tokens covered."""
        return 0

    def commit(self, seq: Sequence) -> None:
        """Note that ``seq.num_computed_tokens`` tokens of ``seq`` now hold valid KV."""

    def prefetch(self, seq: Sequence) -> None:
        """Start bringing what ``match_prefix(seq)`` will find in slow storage nearer, without
        waiting (plugin API 1.12): `paged` reads its disk tier's blocks on a background
        thread. The engine calls it when a request arrives. Nothing by default."""

    def prefix_ready(self, seq: Sequence) -> bool:
        """Whether ``match_prefix(seq)`` would find its blocks without waiting for a read still
        in flight (plugin API 1.12). A scheduler admits other sequences first while it is
        False; one that never asks is still served correctly (``match_prefix`` then waits).
        True by default."""
        return True

    def num_allocated_slots(self) -> int:
        """Slots held by live sequences (for KV-waste figures)."""
        return (self.num_blocks - self.num_free_blocks) * self.layout.block_size

    def num_used_slots(self) -> int | None:
        """Distinct slots holding valid KV of live sequences (a shared block counts once);
        None if the cache does not track it. Waste = 1 - used / allocated."""
        return None

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups and hits of the prefix cache (all zero for a cache without one)."""
        return PrefixCacheStats()

    def close(self) -> None:
        """Finish what outlives the process (plugin API 1.12): `paged` waits for its disk
        tier's queued writes. The pipeline calls it once, when it is closed; nothing by
        default."""

    @property
    def scratch_block(self) -> int | None:
        """A block of storage that no sequence ever holds, where padded rows of a replayed
        CUDA graph write and read (None: the cache has none, so decode graphs are off)."""
        return None
