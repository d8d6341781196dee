"""The `paged` cache manager: fixed-size blocks handed out on demand, shared by reference
count, with optional prefix caching.

PagedAttention's memory manager (vLLM): a sequence holds ceil(tokens / block_size) blocks
wherever they are, so the only waste is the unfilled tail of its last block. A fork (n > 1)
shares every block and copies the shared partly filled block when one side first writes to
it (copy-on-write). With ``prefix_caching`` every full block is indexed by content
(prefix_cache.py), so a later request whose prompt starts the same way reuses the blocks
instead of recomputing them; released cached blocks stay until an allocation needs the
space, least recently released first (block_pool.py).
"""

from __future__ import annotations

import torch
from typing import Literal

from pydantic import Field, model_validator

from tessellm.core.interfaces.cache import CacheManager, CacheSpec, PrefixCacheStats
from tessellm.core.interfaces.kv import KVLayout, KVStorage
from tessellm.core.interfaces.sequence import Sequence
from tessellm.core.plugin import PluginOptions, SelectionContext
from tessellm.plugins.cache.paged.block_pool import BlockPool
from tessellm.plugins.cache.paged.int8_kv import bytes_per_token_head
from tessellm.plugins.cache.paged.key_bounds import KEY_BOUNDS, bounds_bytes_per_block, make_layer_storage
from tessellm.plugins.cache.paged.prefix_cache import PrefixCache
from tessellm.plugins.cache.paged.tiers import build_tiers


class PagedOptions(PluginOptions):
    """Options of the `paged` cache. Capacity: ``num_blocks`` if set, else a memory budget
    (``gpu_memory_fraction`` of the free GPU memory on CUDA, ``cpu_memory_bytes`` on CPU)."""

    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per block."""
    num_blocks: int | None = Field(None, ge=1)
    """Blocks to allocate (overrides the memory budget)."""
    gpu_memory_fraction: float = Field(0.8, gt=0.0, le=0.98)
    """On CUDA: share of the GPU memory free after loading the model that the cache takes."""
    cpu_memory_bytes: int = Field(2 * 2**30, ge=2**20)
    """On CPU: bytes the cache takes (allocated lazily by the OS as blocks are written)."""
    prefix_caching: bool = True
    """Reuse full blocks across requests whose prompts share a prefix (same cache_salt)."""
    bounds_page_size: int = Field(4, ge=1, le=1024)
    """Where the attention backend asks for key bounds (QUEST, which scores and picks pages):
    tokens per page they are kept for, a power of two; a block holds block_size / page_size
    pages (at most block_size: a page per block). Smaller pages bound their keys tighter, so
    a sparse query keeps the blocks it needs more often (docs/benchmarks.md, "QUEST"), and
    cost more memory: a page's bounds take 1 / page_size of its tokens' K and V bytes."""
    free_out_of_window: bool = True
    """For a model with sliding-window layers: release, for those layers, the blocks every
    window has passed, while full-attention layers keep the whole context (windowed.py; the
    two kinds share one pool, so short sequences lose nothing)."""
    kv_dtype: Literal["auto", "int8"] = "auto"
    """auto: K/V in the compute dtype; int8: int8 values with a float16 scale per token and
    KV head (int8_kv.py), about half the bytes of bfloat16; every built-in attention backend
    reads it."""

    host_tier_bytes: int = Field(0, ge=0)
    """Host memory for prefix blocks evicted from the device tier (pinned on CUDA), which a
    later request with the same prefix loads back instead of recomputing; 0: no host tier
    (tiers/)."""
    disk_tier_path: str | None = None
    """A directory for prefix blocks on disk, written as they fill and read back on a miss in
    memory; they survive a restart (keyed by content, salt, and a fingerprint of the model,
    dtype, quantization and cache layout). None: no disk tier."""
    disk_tier_bytes: int = Field(16 * 2**30, ge=2**20)
    """The most bytes the disk tier keeps for this model and layout (least recently used
    blocks are removed first)."""

    @property
    def tiered(self) -> bool:
        return self.host_tier_bytes > 0 or self.disk_tier_path is not None

    @model_validator(mode="after")
    def _tiers_need_prefix_caching(self):
        if self.tiered and not self.prefix_caching:
            raise ValueError("host_tier_bytes and disk_tier_path keep prefix blocks below the device: they need "
                             "prefix_caching true")
        return self

    @model_validator(mode="after")
    def _power_of_two(self):
        for name in ("block_size", "bounds_page_size"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name} must be a power of two (kernels tile by it), not {value}")
        return self


def bounds_page(options: PagedOptions) -> int:
    """Tokens per key-bounds page: the option, within the block."""
    return min(options.bounds_page_size, options.block_size)


def bytes_per_block(model, block_size: int, dtype: torch.dtype, bounds_dtype: torch.dtype | None = None,
                    page_size: int | None = None) -> int:
    """K and V bytes of one block across the layers stored (``model``: a ModelSpec, or a
    CacheSpec, which may store a pipeline stage's layers only) in
    storage dtype ``dtype`` (torch.int8: values and their scales), plus its key bounds in
    ``bounds_dtype`` (per page of ``page_size`` tokens; None: per block) where the layout
    keeps them."""
    page_size = page_size or block_size
    shape = model.kv_shape  # two vectors per token (K and V) or one (an MLA latent)
    per_head = bytes_per_token_head(shape.head_dim) if dtype == torch.int8 else shape.head_dim * dtype.itemsize
    bounds = (bounds_bytes_per_block(shape.num_heads, shape.head_dim, bounds_dtype, block_size // page_size)
              if bounds_dtype is not None else 0)
    layers = len(model.held_layers) if hasattr(model, "held_layers") else model.num_layers
    return layers * (shape.tensors * block_size * shape.num_heads * per_head + bounds)


def frees_windows(options: PagedOptions, spec: CacheSpec, layout: KVLayout) -> bool:
    """Whether the cache releases out-of-window blocks: a model with sliding layers, plain
    K/V (no extras), and ``free_out_of_window`` on."""
    return (options.free_out_of_window and any(w is not None for w in spec.layer_windows)
            and layout.format == "kv" and not layout.extras)


def storage_dtype(options: PagedOptions, compute_dtype: torch.dtype) -> torch.dtype:
    return torch.int8 if options.kv_dtype == "int8" else compute_dtype


def _block_bytes(options: PagedOptions, model, dtype: torch.dtype, extras: frozenset[str]) -> int:
    """One block's bytes for this pipeline (``dtype``: the compute dtype, which bounds use)."""
    return bytes_per_block(model, options.block_size, storage_dtype(options, dtype),
                           dtype if KEY_BOUNDS in extras else None, bounds_page(options))


def _budget_blocks(options: PagedOptions, model, device: torch.device, dtype: torch.dtype,
                   extras: frozenset[str] = frozenset()) -> int:
    if options.num_blocks is not None:
        return options.num_blocks
    if device.type == "cuda":
        budget = int(_free_cuda_bytes(device) * options.gpu_memory_fraction)
    else:
        budget = options.cpu_memory_bytes
    # one block of the budget is the scratch block (see PagedCache.scratch_block)
    return budget // _block_bytes(options, model, dtype, extras) - 1


def _free_cuda_bytes(device: torch.device) -> int:
    """The device's free memory, within what this process may still take where it is held
    to a share of the device (``torch.cuda.set_per_process_memory_fraction``: processes
    sharing one GPU, such as parallel test workers)."""
    free, total = torch.cuda.mem_get_info(device)
    share = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if share is not None:
        allowed = int(share(device) * total) - torch.cuda.memory_reserved(device)
        free = min(free, max(0, allowed))
    return free


class PagedCache(CacheManager):
    """Block tables over a shared block pool; copy-on-write forks; optional prefix caching.

    Invariants (property-tested): a block is free, in use or cached, never two of these;
    reference counts equal the number of tables holding a block and never go negative; a
    block indexed by content is never written again (a write to it copies it first).
    """

    name = "paged"
    api_version = "1.19"
    description = "fixed-size blocks with reference counts, copy-on-write forks and prefix caching"
    Options = PagedOptions
    auto_priority = 50

    def __new__(cls, options: PagedOptions, spec: CacheSpec, layout: KVLayout):
        if cls is PagedCache and frees_windows(options, spec, layout):
            from tessellm.plugins.cache.paged.windowed import WindowedPagedCache

            return super().__new__(WindowedPagedCache)
        return super().__new__(cls)

    @classmethod
    def kv_layout(cls, options: PagedOptions, ctx: SelectionContext) -> KVLayout:
        """Plain K/V (or int8), with per-block key bounds when the attention backend asks; an
        MLA model's latents ("latent")."""
        if ctx.model.kv_shape.format == "latent":
            return KVLayout("latent", options.block_size, storage_dtype(options, ctx.dtype))
        extras = ctx.kv_extras & {KEY_BOUNDS}
        return KVLayout("kv", options.block_size, storage_dtype(options, ctx.dtype), extras,
                        bounds_page(options) if extras else None)

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)
        if ctx.device.type == "cuda" and not torch.cuda.is_available():
            return reasons
        if ctx.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            reasons.append(f"stores K/V in a floating-point compute dtype, not {ctx.dtype}")
        latent = ctx.model.kv_shape.format == "latent"
        if latent and ctx.options.kv_dtype == "int8":
            reasons.append("kv_dtype 'int8' stores K/V caches; this model's cache is an MLA latent, which is "
                           "stored in the compute dtype: set kv_dtype 'auto'")
        extras = frozenset() if latent else ctx.kv_extras & {KEY_BOUNDS}
        blocks = _budget_blocks(ctx.options, ctx.model, ctx.device, ctx.dtype, extras)
        if blocks < 1:
            per = _block_bytes(ctx.options, ctx.model, ctx.dtype, extras)
            reasons.append(f"the memory budget holds no block ({per} bytes each); raise cpu_memory_bytes "
                           f"or gpu_memory_fraction, or set num_blocks")
        return reasons

    def __init__(self, options: PagedOptions, spec: CacheSpec, layout: KVLayout):
        super().__init__(options, spec, layout)
        num_blocks = _budget_blocks(options, spec, spec.device, spec.dtype, layout.extras)
        self.pool = BlockPool(num_blocks)
        slots = (num_blocks + 1) * layout.block_size  # + the scratch block, never handed out
        held = set(spec.held_layers)  # a pipeline stage stores its own layers only
        self._layers: list[KVStorage | None] = [
            make_layer_storage(layout, slots, spec.num_kv_heads, spec.head_dim, spec.device, spec.dtype)
            if i in held else None for i in range(spec.num_layers)]
        self.prefix = PrefixCache(self.pool, layout.block_size, options.prefix_caching)
        self._tables: dict[int, list[int]] = {}  # seq_id -> blocks
        self._computed: dict[int, int] = {}  # seq_id -> tokens with valid KV (commit)
        self.cow_copies = 0
        self.tiers = build_tiers(options, spec, layout, self.pool,
                                                   [self._layers[i] for i in spec.held_layers]) if options.tiered else None
        if self.tiers is not None:
            self.pool.on_evict = self.tiers.on_device_evict
            self.prefix.fetch = self.tiers.fetch
            if self.tiers.writes_through:
                self.prefix.on_full = self.tiers.on_commit

    # ------------------------------------------------------------------ sizes

    def layer(self, index: int) -> KVStorage:
        return self._layers[index]

    def _stored_layers(self) -> list[KVStorage]:
        """Every layer's storage this cache keeps (a pipeline stage keeps its own layers')."""
        return [storage for storage in self._layers if storage is not None]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def max_seq_tokens(self) -> int:
        return self.pool.num_blocks * self.layout.block_size

    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables[seq.seq_id]

    def bytes_for_sequence(self, num_tokens: int) -> int:
        """K/V bytes (scales and bounds included) one sequence of ``num_tokens`` holds."""
        per_block = sum(self.layer(i).bytes_per_slot or 0 for i in self.spec.held_layers)
        return -(-num_tokens // self.layout.block_size) * self.layout.block_size * per_block

    @property
    def scratch_block(self) -> int:
        return self.pool.num_blocks  # the storage's last block: the pool holds ids below it

    # ------------------------------------------------------------------ growth

    def _plan(self, seq: Sequence, num_tokens: int) -> tuple[int, list[int]]:
        """New blocks needed for tokens [0, num_tokens), and the table indices of held
        blocks the write must copy first (shared, or indexed by content)."""
        bs = self.layout.block_size
        table = self._tables.get(seq.seq_id, [])
        needed = -(-num_tokens // bs)
        copies = [i for i in range(seq.num_computed_tokens // bs, min(len(table), needed))
                  if self.pool.ref_counts[table[i]] > 1 or self.pool.is_cached(table[i])]
        return max(needed - len(table), 0), copies

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if num_tokens > self.max_seq_tokens:
            return False
        new, copies = self._plan(seq, num_tokens)
        return new + len(copies) <= self.pool.num_free

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        if num_tokens > self.max_seq_tokens:
            raise RuntimeError(f"sequence {seq.seq_id} needs {num_tokens} slots; the cache holds {self.max_seq_tokens}")
        new, copies = self._plan(seq, num_tokens)
        if new + len(copies) > self.pool.num_free:
            raise RuntimeError(f"paged cache is full: sequence {seq.seq_id} needs {new + len(copies)} blocks, "
                               f"{self.pool.num_free} free")
        table = self._tables.setdefault(seq.seq_id, [])
        for i in copies:
            table[i] = self._copy_block(table[i])
        for _ in range(new):
            table.append(self.pool.allocate())

    def try_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        table = self._tables.get(seq.seq_id)
        if table is not None and num_tokens <= len(table) * self.layout.block_size:
            # fast path (a decode step inside its last block): only the blocks about to be
            # written can need a copy-on-write; without one, nothing changes
            bs = self.layout.block_size
            refs, pool = self.pool.ref_counts, self.pool
            for i in range(seq.num_computed_tokens // bs, -(-num_tokens // bs)):  # usually one block
                if refs[table[i]] != 1 or pool.is_cached(table[i]):
                    break
            else:
                return True
        if not self.can_reserve(seq, num_tokens):
            return False
        self.reserve(seq, num_tokens)
        return True

    def _copy_block(self, block: int) -> int:
        fresh = self.pool.allocate()
        bs = self.layout.block_size
        src = torch.arange(block * bs, (block + 1) * bs, device=self.spec.device)
        dst = torch.arange(fresh * bs, (fresh + 1) * bs, device=self.spec.device)
        for storage in self._stored_layers():
            storage.copy_slots(src, dst)
        self.pool.decref(block)
        self.cow_copies += 1
        return fresh

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        table = self._tables.get(seq.seq_id)
        if table is None:
            return
        bs = self.layout.block_size
        keep = -(-num_tokens // bs)
        while len(table) > keep:
            self.pool.decref(table.pop())
        if (KEY_BOUNDS in self.layout.extras and num_tokens % bs and self.pool.ref_counts[table[-1]] == 1
                and not self.pool.is_cached(table[-1])):
            # the new last block keeps fewer tokens: its bounds shrink to them (a block other
            # tables or the prefix index still hold keeps its bounds; it is copied before this
            # sequence writes to it)
            for storage in self._stored_layers():
                storage.refresh_bounds(table[-1], num_tokens % bs)
        if seq.seq_id in self._computed:
            self._computed[seq.seq_id] = min(self._computed[seq.seq_id], num_tokens)
        self.prefix.truncate(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        table = self._tables.pop(seq.seq_id, None)
        self._computed.pop(seq.seq_id, None)
        self.prefix.forget(seq)
        if self.tiers is not None:
            self.tiers.forget(seq.seq_id)
        # release the tail first: a cached prefix's later blocks are then evicted before its
        # earlier ones, which other prompts are more likely to share
        for block in reversed(table or []):
            self.pool.decref(block)

    def can_fork(self, parent: Sequence) -> bool:
        return True  # sharing costs no block now; copies are paid for by later reserves

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.free(child)
        table = list(self._tables[parent.seq_id])
        for block in table:
            self.pool.incref(block)
        self._tables[child.seq_id] = table
        self._computed[child.seq_id] = parent.num_computed_tokens
        self.prefix.fork(parent, child)

    # ------------------------------------------------------------------ prefix caching

    def match_prefix(self, seq: Sequence) -> int:
        if not self.options.prefix_caching or self._tables.get(seq.seq_id) or seq.params.prompt_logprobs is not None:
            return 0
        table = self._tables[seq.seq_id] = self.prefix.match(seq)
        hit = self._computed[seq.seq_id] = len(table) * self.layout.block_size
        if self.tiers is not None:
            self.tiers.forget(seq.seq_id)
        return hit

    def prefetch(self, seq: Sequence) -> None:
        """Read the disk-tier blocks of ``seq``'s prefix ahead, on the tiers' reader thread."""
        tiers = self.tiers
        if tiers is None or tiers.disk is None or seq.params.prompt_logprobs is not None:
            return
        keys = []
        for key in self.prefix.chain(seq):
            if self.pool.lookup(key) is not None or (tiers.host is not None and key in tiers.host):
                continue
            if key not in tiers.disk:
                break
            keys.append(key)
        if keys:
            tiers.prefetch(seq.seq_id, keys)

    def prefix_ready(self, seq: Sequence) -> bool:
        return self.tiers is None or self.tiers.ready(seq.seq_id)

    def commit(self, seq: Sequence) -> None:
        table = self._tables.get(seq.seq_id)
        if table is None:
            return
        n = self._computed[seq.seq_id] = seq.num_computed_tokens
        # skip the call when ``PrefixCache.index`` would return at once (every sequence, every
        # step): no lookup to count and no block newly full
        prefix = self.prefix
        if prefix.lookups or (prefix.enabled and len(prefix.keys.get(seq.seq_id, ())) < n // self.layout.block_size):
            prefix.index(seq, table)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        stats = self.prefix.stats
        tiers = self.tiers.stats() if self.tiers is not None else {}
        return PrefixCacheStats(stats.queried_tokens, stats.hit_tokens, tiers)

    def reset_prefix_cache(self) -> int:
        """Forget all cached content (e.g. after reloading weights), in every tier; returns
        the blocks dropped."""
        return self.prefix.reset() + (self.tiers.clear() if self.tiers is not None else 0)

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()

    # ------------------------------------------------------------------ accounting

    def num_used_slots(self) -> int:
        """Full blocks count block_size each; a partly filled block counts its filled slots
        once however many sequences share it (as full if any holder has filled it)."""
        bs = self.layout.block_size
        fill: dict[int, int] = {}
        for seq_id, table in self._tables.items():  # only the tail past each sequence's full blocks
            computed = self._computed.get(seq_id, 0)
            for i in range(computed // bs, len(table)):
                fill[table[i]] = max(fill.get(table[i], 0), max(0, min(bs, computed - i * bs)))
        shared = {b for b, f in fill.items() if f < bs and self.pool.ref_counts[b] > 1}
        if shared:  # rare (a fork rolled back into its shared part): is it full in another table?
            for seq_id, table in self._tables.items():
                for block in table[: self._computed.get(seq_id, 0) // bs]:
                    if block in shared:
                        fill[block] = bs
        return self.pool.num_used * bs - sum(bs - f for f in fill.values())
