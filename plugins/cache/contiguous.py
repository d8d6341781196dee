"""Cache `contiguous`: every sequence reserves one region of ``max_model_len`` slots.

The classic KV cache of transformers and gpt-fast, expressed in the block format: one block
per sequence, ``block_size = max_model_len``. Simple and exact, but a sequence holds its
whole region however short it is, which is the waste a paged cache removes.
"""

from __future__ import annotations

import os

import torch
from pydantic import Field

import tessellm
from tessellm.core.interfaces.cache import CacheManager, CacheSpec
from tessellm.core.interfaces.kv import KVLayout, KVStorage, dense_storage
from tessellm.core.plugin import PluginOptions, SelectionContext
from tessellm.core.interfaces.sequence import Sequence


class ContiguousOptions(PluginOptions):
    """Options of the `contiguous` cache."""

    max_seqs: int = Field(8, ge=1, le=4096)
    """Sequences that can hold a region at once; each region is max_model_len tokens."""


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class ContiguousCache(CacheManager):
    """One ``max_model_len`` region per sequence; regions are never shared, so a fork copies."""

    name = "contiguous"
    api_version = "1.19"
    description = "one max_model_len region per sequence (reference; no sharing)"
    Options = ContiguousOptions
    auto_priority = 10

    @classmethod
    def kv_layout(cls, options: ContiguousOptions, ctx: SelectionContext) -> KVLayout:
        return KVLayout(ctx.model.kv_shape.format, ctx.max_model_len, ctx.dtype)

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)
        m = ctx.model
        need = ctx.options.max_seqs * ctx.max_model_len * m.num_layers * m.kv_shape.values_per_token \
            * ctx.dtype.itemsize
        total = _physical_memory() if ctx.device.type == "cpu" else (
            torch.cuda.get_device_properties(ctx.device).total_memory if torch.cuda.is_available() else None)
        if total is not None and need > total:
            reasons.append(f"max_seqs={ctx.options.max_seqs} regions of max_model_len={ctx.max_model_len} "
                           f"tokens need {need / 2**30:.1f} GiB, more than the device's {total / 2**30:.1f} GiB; "
                           f"lower cache.options.max_seqs or max_model_len")
        return reasons

    def __init__(self, options: ContiguousOptions, spec: CacheSpec, layout: KVLayout):
        super().__init__(options, spec, layout)
        slots = options.max_seqs * layout.block_size
        held = set(spec.held_layers)  # a pipeline stage stores its own layers only
        self._layers = [dense_storage(layout, slots, spec.num_kv_heads, spec.head_dim, spec.device)
                        if i in held else None for i in range(spec.num_layers)]
        self._free = list(range(options.max_seqs - 1, -1, -1))  # pop() hands out region 0 first
        self._region: dict[int, int] = {}  # seq_id -> region
        self._reserved: dict[int, int] = {}  # seq_id -> tokens reserved
        self._computed: dict[int, int] = {}  # seq_id -> tokens with valid KV (from commit)

    def layer(self, index: int) -> KVStorage:
        return self._layers[index]

    def _stored_layers(self) -> list[KVStorage]:
        """Every layer's storage this cache keeps (a pipeline stage keeps its own layers')."""
        return [storage for storage in self._layers if storage is not None]

    @property
    def num_blocks(self) -> int:
        return self.options.max_seqs

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def max_seq_tokens(self) -> int:
        return self.layout.block_size

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return num_tokens <= self.layout.block_size and (seq.seq_id in self._region or bool(self._free))

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        if num_tokens > self.layout.block_size:
            raise RuntimeError(f"sequence {seq.seq_id} needs {num_tokens} slots; a region holds {self.layout.block_size}")
        if seq.seq_id not in self._region:
            if not self._free:
                raise RuntimeError("contiguous cache is full: every region is taken")
            self._region[seq.seq_id] = self._free.pop()
        self._reserved[seq.seq_id] = max(self._reserved.get(seq.seq_id, 0), num_tokens)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        if seq.seq_id in self._reserved:
            self._reserved[seq.seq_id] = min(self._reserved[seq.seq_id], num_tokens)
        if seq.seq_id in self._computed:
            self._computed[seq.seq_id] = min(self._computed[seq.seq_id], num_tokens)

    def free(self, seq: Sequence) -> None:
        region = self._region.pop(seq.seq_id, None)
        self._reserved.pop(seq.seq_id, None)
        self._computed.pop(seq.seq_id, None)
        if region is not None:
            self._free.append(region)

    def can_fork(self, parent: Sequence) -> bool:
        return bool(self._free)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        n = parent.num_computed_tokens
        self.reserve(child, n)
        bs = self.layout.block_size
        src = torch.arange(n, device=self.spec.device) + self._region[parent.seq_id] * bs
        dst = torch.arange(n, device=self.spec.device) + self._region[child.seq_id] * bs
        for storage in self._stored_layers():
            storage.copy_slots(src, dst)
        self._computed[child.seq_id] = n

    def block_table(self, seq: Sequence) -> list[int]:
        return [self._region[seq.seq_id]]

    def commit(self, seq: Sequence) -> None:
        if seq.seq_id in self._region:
            self._computed[seq.seq_id] = seq.num_computed_tokens

    def num_allocated_slots(self) -> int:
        return len(self._region) * self.layout.block_size

    def num_used_slots(self) -> int:
        return sum(self._computed.values())


@tessellm.hookimpl
def register_cache(register):
    register(ContiguousCache)
