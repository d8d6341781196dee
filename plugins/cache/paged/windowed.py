"""The `paged` cache for models with sliding-window layers: blocks no window sees any more are
released for the sliding layers, while full-attention layers keep the whole context.

Two block tables per sequence, over one arena (window_pool.py): the *full* table (group 0,
``block_table(seq)``) addresses the full-attention layers' K/V, the *window* table (group 1,
``group_block_table(seq, 1)``) the sliding layers'. Both have an entry per logical block;
after each step the window table's entries that end before ``num_computed - W + 1`` (W the
largest window) are released and point at the arena's null run (zeros, masked out by every
window). A model whose every layer slides has the window table only (group 0).

Prefix caching indexes both kinds of runs under the same content keys; a prefix hit of m
blocks needs the full runs of all m and the sliding runs of the last window before them.
Copy-on-write, forks, preemption and speculative rollback work as in `paged`; a rollback to
tokens some window has passed is refused (the engine only rolls back drafts, inside it).
"""

from __future__ import annotations

import copy
import math

import torch

from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.cache import CacheManager, CacheSpec
from tessellm.core.interfaces.kv import KVLayout, KVStorage
from tessellm.core.interfaces.sequence import Sequence
from tessellm.plugins.cache.paged.key_bounds import make_layer_storage
from tessellm.plugins.cache.paged.manager import PagedCache, PagedOptions, _budget_blocks
from tessellm.plugins.cache.paged.prefix_cache import PrefixCache
from tessellm.plugins.cache.paged.window_pool import FULL, SLIDING, SplitArena


def storage_view(storage: KVStorage, offset: int, num_slots: int) -> KVStorage:
    """``storage`` seen from slot ``offset`` on: a shallow copy whose per-slot tensors (those
    with ``num_slots`` rows) are views starting there."""
    view = copy.copy(storage)
    for name, value in vars(storage).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == num_slots:
            setattr(view, name, value[offset:])
    return view


class WindowedPagedCache(PagedCache):
    """`paged` with out-of-window freeing (made by ``PagedCache`` for a model with sliding
    layers and ``free_out_of_window``); see the module docstring."""

    def __init__(self, options: PagedOptions, spec: CacheSpec, layout: KVLayout):
        CacheManager.__init__(self, options, spec, layout)
        if options.tiered:
            raise ConfigError("cache.options: host and disk tiers are not built for caches that release "
                              "out-of-window blocks (this model has sliding-window layers); set "
                              "cache.options.free_out_of_window=false to keep tiers, or turn the tiers off")
        self.tiers = None
        windows = list(spec.layer_windows)
        self.window = max(w for w in windows if w is not None)
        held = spec.held_layers  # a pipeline stage stores its own layers only
        self.num_held = len(held)
        full = [i for i in held if windows[i] is None]
        sliding = [i for i in held if windows[i] is not None]
        self.kinds = [FULL, SLIDING] if full else [SLIDING]
        self.groups = [tuple(full), tuple(sliding)] if full else [tuple(sliding)]
        # the budget in blocks of every layer (num_blocks, or what the memory budget holds), as
        # superblocks of the arena's width, + the reserved one
        blocks = _budget_blocks(options, spec, spec.device, spec.dtype, layout.extras)
        sizes = (len(full), len(sliding))
        self.arena = SplitArena(blocks * self.num_held // math.lcm(*(n for n in sizes if n)) + 1, sizes)
        bs = layout.block_size
        slots = self.arena.num_units * bs
        self.storage = make_layer_storage(layout, slots, spec.num_kv_heads, spec.head_dim, spec.device, spec.dtype)
        self._zero_reserved(slots)
        self._layers = [None] * spec.num_layers
        for group in self.groups:
            for t, layer in enumerate(group):  # unit p + t of run p is this layer's
                self._layers[layer] = storage_view(self.storage, t * bs, slots)
        self.pool = self.arena.pools[self.kinds[0]]
        self.prefix = PrefixCache(self.pool, bs, options.prefix_caching)
        self.prefix.null = self.arena.null
        self._tables: dict[int, list[list[int]]] = {}  # seq_id -> a table per kind
        self._computed: dict[int, int] = {}
        self._released: dict[int, int] = {}  # seq_id -> leading window-table entries released
        self._window_keys: dict[int, int] = {}  # seq_id -> window-table entries indexed by content
        self.cow_copies = 0
        self.released_blocks = 0  # window-table entries released so far
        self._step_tokens: int | None = None  # the scheduler's step budget (limit_step_tokens)

    def _zero_reserved(self, slots: int) -> None:
        """The reserved superblock (the null run) holds zeros: released entries read it,
        masked, and a masked zero weighs nothing (NaN would)."""
        reserved = self.arena.width * self.layout.block_size  # superblock 0
        for value in vars(self.storage).values():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == slots:
                value[:reserved] = 0

    # ------------------------------------------------------------------ sizes and tables

    @property
    def layer_groups(self) -> list[tuple[int, ...]]:
        return list(self.groups)

    @property
    def num_blocks(self) -> int:
        """The arena in blocks of every layer (what ``num_blocks`` asks for)."""
        return (self.arena.num_superblocks - 1) * self.arena.width // self.num_held

    @property
    def num_free_blocks(self) -> int:
        """Blocks of every layer's worth not held by a sequence (cached ones count as free)."""
        return self.num_blocks - self._held_blocks()

    def _held_blocks(self) -> int:
        return -(-self.arena.units_in_use // self.num_held)

    def num_allocated_slots(self) -> int:
        """Slots held, in blocks of every layer (a sliding run counts for its share)."""
        return self._held_blocks() * self.layout.block_size

    def limit_step_tokens(self, max_step_tokens: int | None) -> None:
        self._step_tokens = max_step_tokens

    @property
    def max_seq_tokens(self) -> int:
        """The longest sequence the arena holds alone: with steps of at most the scheduler's
        budget, its full runs for every block and sliding runs for a window and a step (one
        superblock spare, for a copy-on-write); without a bound, every block's runs of both
        kinds at once (a prompt prefilled in one step)."""
        bs, arena = self.layout.block_size, self.arena
        every_block_both = self.num_blocks * bs
        step = self._step_tokens
        if step is None:
            return every_block_both
        sliding_runs = -(-(self.window + step) // bs) + 2
        spare = arena.num_superblocks - 2 - -(-sliding_runs // arena.pools[SLIDING].per_superblock)
        if spare < 0:
            return every_block_both
        if FULL not in arena.pools:  # every layer slides: a sequence never holds more than that
            return max(every_block_both, self.spec.max_model_len)
        return max(every_block_both, spare * arena.pools[FULL].per_superblock * bs)

    @property
    def scratch_block(self) -> None:
        return None  # decode graphs stay off: a step has a plan per block table

    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables[seq.seq_id][0]

    def group_block_table(self, seq: Sequence, group: int) -> list[int]:
        return self._tables[seq.seq_id][group]

    def num_used_slots(self) -> None:
        return None

    def bytes_for_sequence(self, num_tokens: int) -> int:
        """K/V bytes one sequence of ``num_tokens`` holds once computed: a full run per block,
        sliding runs for the blocks its window still sees."""
        bs, unit = self.layout.block_size, self.storage.bytes_per_slot * self.layout.block_size
        blocks = -(-num_tokens // bs)
        released = min(max(0, (num_tokens - self.window + 1) // bs), blocks)
        return unit * (self.arena.sizes[FULL] * blocks + self.arena.sizes[SLIDING] * (blocks - released))

    def num_released(self, seq: Sequence) -> int:
        """Leading logical blocks whose sliding-layer K/V ``seq`` has let go."""
        return self._released.get(seq.seq_id, 0)

    # ------------------------------------------------------------------ growth

    def _plan(self, seq: Sequence, num_tokens: int) -> list[tuple[int, list[int]]]:
        """Per kind: new runs needed for tokens [0, num_tokens), and the table indices of
        held runs the write must copy first (shared, or indexed by content)."""
        bs, needed = self.layout.block_size, -(-num_tokens // self.layout.block_size)
        tables = self._tables.get(seq.seq_id)
        plans = []
        for g, kind in enumerate(self.kinds):
            table, pool = (tables[g] if tables else []), self.arena.pools[kind]
            copies = [i for i in range(seq.num_computed_tokens // bs, min(len(table), needed))
                      if pool.ref_counts[table[i]] > 1 or pool.is_cached(table[i])]
            plans.append((max(needed - len(table), 0), copies))
        return plans

    def _fits(self, plans: list[tuple[int, list[int]]]) -> bool:
        """Whether allocating what ``plans`` needs succeeds, reclaiming idle superblocks of
        the other kind (evicting their cached runs) where that makes the difference."""
        while not self._fits_now(plans):
            short = next(kind for kind, fits in self._kinds_short(plans) if not fits)
            if not self.arena.reclaim_for(short):
                return False
        return True

    def _fits_now(self, plans: list[tuple[int, list[int]]]) -> bool:
        return all(fits for _, fits in self._kinds_short(plans))

    def _kinds_short(self, plans: list[tuple[int, list[int]]]) -> list[tuple[int, bool]]:
        """Per kind, in table order, whether its runs can be had as ``RunPool.allocate``
        takes them: own free runs, whole superblocks (the rest of whose runs become free),
        then own cached runs."""
        whole, out = len(self.arena.whole), []
        for kind, (new, copies) in zip(self.kinds, plans):
            pool, need = self.arena.pools[kind], new + len(copies)
            need -= min(need, len(pool._free))
            superblocks = min(-(-need // pool.per_superblock), whole)
            whole, need = whole - superblocks, max(0, need - superblocks * pool.per_superblock)
            need -= min(need, len(pool._evictable))
            out.append((kind, need == 0))
        return out

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return num_tokens <= self.max_seq_tokens and self._fits(self._plan(seq, num_tokens))

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        if num_tokens > self.max_seq_tokens:
            raise RuntimeError(f"sequence {seq.seq_id} needs {num_tokens} slots; the cache holds {self.max_seq_tokens}")
        plans = self._plan(seq, num_tokens)
        if not self._fits(plans):
            raise RuntimeError(f"paged cache is full: sequence {seq.seq_id} needs {sum(n + len(c) for n, c in plans)} "
                               f"blocks across its block tables, {self.pool.num_free} free")
        tables = self._tables.setdefault(seq.seq_id, [[] for _ in self.kinds])
        for kind, table, (new, copies) in zip(self.kinds, tables, plans):
            pool = self.arena.pools[kind]
            for i in copies:
                table[i] = self._copy_run(kind, table[i])
            table.extend(pool.allocate() for _ in range(new))

    def try_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if not self.can_reserve(seq, num_tokens):
            return False
        self.reserve(seq, num_tokens)
        return True

    def _copy_run(self, kind: int, run: int) -> int:
        pool = self.arena.pools[kind]
        fresh = pool.allocate()
        span = self.arena.sizes[kind] * self.layout.block_size
        device = self.spec.device
        bs = self.layout.block_size
        self.storage.copy_slots(torch.arange(run * bs, run * bs + span, device=device),
                                torch.arange(fresh * bs, fresh * bs + span, device=device))
        pool.decref(run)
        self.cow_copies += 1
        return fresh

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        tables = self._tables.get(seq.seq_id)
        if tables is None:
            return
        bs = self.layout.block_size
        if max(0, (num_tokens - self.window + 1) // bs) < self._released.get(seq.seq_id, 0):
            raise ValueError(f"sequence {seq.seq_id} cannot roll back to {num_tokens} tokens: its sliding layers "
                             f"released the blocks a query there would see (window {self.window}); a rollback "
                             f"stays inside the window (the engine rolls back rejected drafts only)")
        keep = -(-num_tokens // bs)
        for kind, table in zip(self.kinds, tables):
            while len(table) > keep:
                self._drop(kind, table.pop())
        if seq.seq_id in self._computed:
            self._computed[seq.seq_id] = min(self._computed[seq.seq_id], num_tokens)
        if seq.seq_id in self._window_keys:
            self._window_keys[seq.seq_id] = min(self._window_keys[seq.seq_id], num_tokens // bs)
        self.prefix.truncate(seq, num_tokens)

    def _drop(self, kind: int, run: int) -> None:
        if run != self.arena.null:
            self.arena.pools[kind].decref(run)

    def free(self, seq: Sequence) -> None:
        tables = self._tables.pop(seq.seq_id, None)
        for store in (self._computed, self._released, self._window_keys):
            store.pop(seq.seq_id, None)
        self.prefix.forget(seq)
        for kind, table in zip(self.kinds, tables or []):
            for run in reversed(table):  # the tail first: later blocks of a prefix are evicted first
                self._drop(kind, run)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.free(child)
        tables = [list(t) for t in self._tables[parent.seq_id]]
        for kind, table in zip(self.kinds, tables):
            for run in table:
                if run != self.arena.null:
                    self.arena.pools[kind].incref(run)
        self._tables[child.seq_id] = tables
        self._computed[child.seq_id] = parent.num_computed_tokens
        self._released[child.seq_id] = self._released.get(parent.seq_id, 0)
        self._window_keys[child.seq_id] = self._window_keys.get(parent.seq_id, 0)
        self.prefix.fork(parent, child)

    # ------------------------------------------------------------------ after each step

    def commit(self, seq: Sequence) -> None:
        tables = self._tables.get(seq.seq_id)
        if tables is None:
            return
        n = self._computed[seq.seq_id] = seq.num_computed_tokens
        self.prefix.index(seq, tables[0])
        if len(self.kinds) == 2 and self.prefix.enabled:
            self._index_window(seq, tables[1])
        self._release_passed(seq, tables[-1], n)

    def _index_window(self, seq: Sequence, table: list[int]) -> None:
        """Index the window table's newly full runs under the full table's content keys."""
        keys = self.prefix.keys.get(seq.seq_id, [])
        done = self._window_keys.get(seq.seq_id, 0)
        pool = self.arena.pools[SLIDING]
        for i in range(done, min(len(keys), len(table))):
            if table[i] != self.arena.null:
                pool.register(table[i], keys[i])
        self._window_keys[seq.seq_id] = max(done, min(len(keys), len(table)))

    def _release_passed(self, seq: Sequence, table: list[int], computed: int) -> None:
        """Release the window table's entries no later query sees: those before the block of
        position ``computed - W + 1``, the earliest key the next query token can see."""
        limit = min(max(0, (computed - self.window + 1) // self.layout.block_size), len(table))
        start = self._released.get(seq.seq_id, 0)
        for i in range(start, limit):
            if table[i] != self.arena.null:
                self._drop(SLIDING, table[i])
                self.released_blocks += 1
            table[i] = self.arena.null
        self._released[seq.seq_id] = max(start, limit)

    # ------------------------------------------------------------------ prefix caching

    def match_prefix(self, seq: Sequence) -> int:
        if not self.options.prefix_caching or self._tables.get(seq.seq_id) or seq.params.prompt_logprobs is not None:
            return 0
        bs, tokens = self.layout.block_size, seq.token_ids
        keys = list(self.prefix.chain(seq))  # the same content keys (images included) the full table's index uses
        m, low = self._longest_hit(keys)
        tables = []
        for kind in self.kinds:
            pool = self.arena.pools[kind]
            first = low if kind == SLIDING else 0
            runs = [pool.lookup(k) for k in keys[first:m]]
            for run in runs:
                pool.incref(run)
            tables.append([self.arena.null] * first + runs)
        self._tables[seq.seq_id] = tables
        self._released[seq.seq_id] = low
        self._window_keys[seq.seq_id] = m
        self.prefix.keys[seq.seq_id] = keys[:m]
        self.prefix.lookups[seq.seq_id] = (len(tokens), m * bs)
        self._computed[seq.seq_id] = m * bs
        return m * bs

    def _longest_hit(self, keys: list[bytes]) -> tuple[int, int]:
        """The most leading blocks m whose full runs are all cached and whose sliding runs
        are cached over the last window before them, and the first of those sliding runs."""
        bs = self.layout.block_size
        m = len(keys)
        if FULL in self.arena.pools:
            full = self.arena.pools[FULL]
            m = next((i for i, k in enumerate(keys) if full.lookup(k) is None), m)
        sliding = self.arena.pools[SLIDING]
        cached = [sliding.lookup(k) is not None for k in keys[:m]]
        while m:
            low = max(0, (m * bs - self.window + 1) // bs)
            if all(cached[low:m]):
                return m, low
            m -= 1
        return 0, 0

    def reset_prefix_cache(self) -> int:
        dropped = self.prefix.reset()
        if len(self.kinds) == 2:
            dropped += self.arena.pools[SLIDING].reset_prefix_cache()
        self._window_keys = {seq_id: 0 for seq_id in self._window_keys}
        return dropped
