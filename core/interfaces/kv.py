"""What a KV cache stores and how a backend reads it: the layout a cache declares before it
allocates anything, one layer's storage, and the dense storage of plain K and V.

Slots are numbered per layer; with block size ``bs``, slot ``s`` is token ``s % bs`` of block
``s // bs``, and token ``p`` of a sequence with block table ``table`` lives in slot
``table[p // bs] * bs + p % bs``. A contiguous cache is the special case of one block of
``max_model_len`` slots per sequence, so one metadata format serves every layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """What a cache stores, declared before anything is allocated, so attention backends can
    say which layouts they read. A cache returns it from ``kv_layout``; every plugin reads it
    (``SelectionContext.kv_layout``, ``KVStorage.layout``) and none changes it (frozen)."""

    format: str
    """What one slot holds: "kv" (a key and a value per KV head) or "latent" (one compressed
    vector per token, MLA). Quantized storage keeps its format and sets ``dtype``."""
    block_size: int
    """Tokens per block; slot ``s`` is token ``s % block_size`` of block ``s // block_size``
    (a contiguous cache: one block of max_model_len slots per sequence)."""
    dtype: torch.dtype
    """The storage dtype; torch.int8 means int8 values plus per-token scales
    (``KVStorage.kv_scales``)."""
    extras: frozenset[str] = frozenset()
    """Side data the cache keeps current on every store. "key_bounds": per page (see
    ``page_size``), the elementwise minimum and maximum of its keys (``KVStorage.key_bounds``),
    which query-aware sparse attention (QUEST) scores pages by."""
    page_size: int | None = None
    """Tokens per page of the "key_bounds" extra: slots ``p * page_size`` up to the next page
    are page ``p`` (a divisor of ``block_size``, so a page never straddles two blocks);
    None: one page per block (plugin API 1.7)."""

    @property
    def bounds_page(self) -> int:
        """Tokens per key-bounds page: ``page_size``, or the block where it is None."""
        return self.page_size or self.block_size


class KVStorage(ABC):
    """One layer's cache storage.

    Contract:
    - ``store(k, v, slot_mapping)`` writes the step's new tokens; ``gather(slots)`` reads
      any slots back in the compute dtype (dequantized if stored quantized): the reference
      path every backend can use.
    - ``kv_tensors()`` hands a fast kernel the raw tensors it reads in place, K and V as
      [num_slots, num_kv_heads, head_dim] in the storage dtype (``layout.dtype``); for int8
      storage ``kv_scales()`` adds the per-token scales they are multiplied by. Storage that
      has no such tensors (latent) raises TypeError naming itself, so a backend that needs
      them declares the layouts it reads (``cache_formats``, ``cache_dtypes``) and is never
      selected for one without them.
    - A slot that was never written may hold anything, NaN included: backends must not read
      it, not even under a mask (a zero weight times NaN is NaN).
    - ``copy_slots(src, dst)`` copies stored tokens exactly: what a cache calls to fork a
      sequence or copy a shared block before writing to it.

    For the "latent" format (MLA) ``k`` is the compressed latent [T, 1, latent_dim] and
    ``v`` is None: one vector per token serves as both key and value; ``gather`` returns
    (latents, None) and a kernel reads ``latent_tensor()`` in place (``LatentKVStorage``).
    """

    layout: KVLayout

    @abstractmethod
    def store(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Write new tokens: k, v [T, num_kv_heads, head_dim] into slots [T] (int64)."""

    @abstractmethod
    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V at ``slots`` (any shape S, int64): [*S, num_kv_heads, head_dim] each, in the
        compute dtype (dequantized if stored quantized)."""

    @property
    def bytes_per_slot(self) -> int | None:
        """Bytes one slot (one token's K and V, all KV heads, scales included) takes in this
        layer, or None if the storage does not say; ``tessellm bench`` reports it."""
        return None

    def stored_value(self, x: torch.Tensor) -> torch.Tensor:
        """What ``gather`` reads back for K or V ``x`` [..., num_kv_heads, head_dim] after
        ``store``: x in the storage dtype, or its quantize-dequantize round trip for quantized
        storage (a function of x alone: quantization scales belong to one token). The cache
        conformance suite expects exactly this."""
        return x.to(self.layout.dtype)

    def kv_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_slots, num_kv_heads, head_dim] tensors that kernels read and write
        in place (see the class contract)."""
        raise TypeError(f"{type(self).__name__} keeps no plain K/V tensors (layout {self.layout}); "
                        f"read it through gather()")

    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For int8 storage (plugin API 1.3): the scales of K and V, [num_slots, num_kv_heads, 1]
        float16, one per token and head; what a slot holds is ``kv_tensors()``' int8 values
        times its scale. Storage that is not quantized raises TypeError."""
        raise TypeError(f"{type(self).__name__} keeps no quantization scales (layout {self.layout})")

    def latent_tensor(self) -> torch.Tensor:
        """For the "latent" format (plugin API 1.4): the [num_slots, latent_dim] tensor a
        kernel reads in place, one compressed vector per token, in the storage dtype. Storage
        of another format raises TypeError."""
        raise TypeError(f"{type(self).__name__} keeps no latent tensor (layout {self.layout}); only "
                        f"'latent' layouts (MLA models) do")

    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For layouts with the "key_bounds" extra (plugin API 1.3): per block, the elementwise
        minimum and maximum of the keys it holds, two [num_blocks, num_kv_heads, head_dim]
        tensors in the dtype ``gather`` returns, indexed by block id, current after each
        ``store``. A full block's bounds are exactly those of its keys; a partly filled block's
        contain the keys of every sequence holding it. Storage without them raises TypeError."""
        raise TypeError(f"{type(self).__name__} keeps no key bounds (layout {self.layout}); an attention "
                        f"backend that needs them lists 'key_bounds' in its kv_extras")

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the tokens stored in slots ``src`` into slots ``dst`` (both [N] int64, on
        ``device``), so that ``gather(dst)`` then reads exactly what ``gather(src)`` read, and
        any ``extras`` stay current: what a cache calls on each layer's storage to fork a
        sequence or to copy a shared block before writing to it (copy-on-write). ``src`` and
        ``dst`` must not overlap. The default goes through ``gather`` and ``store``; storage
        whose round trip through them is not exact (quantized values) overrides it to copy
        what it stores, as the built-in storages do."""
        k, v = self.gather(src)
        self.store(k, v, dst)

    def read(self, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V of one sequence's first ``length`` tokens, [length, num_kv_heads, head_dim]."""
        bs = self.layout.block_size
        pos = torch.arange(length)
        table = torch.tensor(block_table, dtype=torch.long)
        return self.gather((table[pos // bs] * bs + pos % bs).to(self.device))

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the storage lives."""


class DenseKVStorage(KVStorage):
    """One layer's K and V as two [num_slots, num_kv_heads, head_dim] tensors: the "kv"
    format in a floating-point dtype, one slot per token.

    Any cache whose layout is plain K and V (contiguous, paged, radix) can hold its layers in
    this class; caches differ only in how they hand slots out. Kernels may view the tensors
    as [num_blocks, block_size, num_kv_heads, head_dim] (``blocks()``).
    """

    def __init__(self, layout: KVLayout, num_slots: int, num_kv_heads: int, head_dim: int,
                 device: torch.device):
        if layout.format != "kv" or not layout.dtype.is_floating_point:
            raise ValueError(f"DenseKVStorage holds floating-point 'kv' layouts, not {layout}")
        self.layout = layout
        # torch.empty: the OS commits pages only as tokens are written, so a large reservation
        # on the CPU costs address space, not memory
        self.k = torch.empty(num_slots, num_kv_heads, head_dim, dtype=layout.dtype, device=device)
        self.v = torch.empty(num_slots, num_kv_heads, head_dim, dtype=layout.dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def kv_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.k[0].numel() * self.k.element_size()

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V viewed as [num_blocks, block_size, num_kv_heads, head_dim]."""
        bs = self.layout.block_size
        return self.k.view(-1, bs, *self.k.shape[1:]), self.v.view(-1, bs, *self.v.shape[1:])

    def store(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        # k, v: [T, Hkv, D]; slot_mapping: [T] int64
        assert v is not None and k.shape == v.shape and k.shape[0] == slot_mapping.shape[0], (k.shape, slot_mapping.shape)
        self.k.index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v.index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select on flat indices is faster than advanced indexing on the CPU
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.k.shape[1:])
        return self.k.index_select(0, flat).view(shape), self.v.index_select(0, flat).view(shape)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the tokens in slots ``src`` to slots ``dst`` (fork, copy-on-write)."""
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]


class LatentKVStorage(KVStorage):
    """One layer's MLA cache: a [num_slots, 1, latent_dim] tensor, the "latent" format in a
    floating-point dtype. Each token's one vector (its compressed latent followed by its
    rotated shared key) serves every head as both key and value, so ``store`` takes
    ``v=None`` and ``gather`` returns ``(latents, None)``.

    Any cache that hands out slots (contiguous, paged) can hold an MLA model's layers in it;
    kernels may view it as [num_blocks, block_size, latent_dim] (``blocks()``).
    """

    def __init__(self, layout: KVLayout, num_slots: int, latent_dim: int, device: torch.device):
        if layout.format != "latent" or not layout.dtype.is_floating_point:
            raise ValueError(f"LatentKVStorage holds floating-point 'latent' layouts, not {layout}")
        self.layout = layout
        self.c = torch.empty(num_slots, 1, latent_dim, dtype=layout.dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.c.device

    def latent_tensor(self) -> torch.Tensor:
        return self.c.view(self.c.shape[0], -1)

    @property
    def bytes_per_slot(self) -> int:
        return self.c[0].numel() * self.c.element_size()

    def blocks(self) -> torch.Tensor:
        """The latents viewed as [num_blocks, block_size, latent_dim]."""
        return self.c.view(-1, self.layout.block_size, self.c.shape[-1])

    def store(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        # k: [T, 1, latent_dim]; slot_mapping: [T] int64
        assert v is None and k.shape[1:] == self.c.shape[1:] and k.shape[0] == slot_mapping.shape[0], (
            k.shape, slot_mapping.shape)
        self.c.index_copy_(0, slot_mapping, k.to(self.c.dtype))

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, None]:
        flat = slots.reshape(-1)
        return self.c.index_select(0, flat).view(*slots.shape, *self.c.shape[1:]), None

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the tokens in slots ``src`` to slots ``dst`` (fork, copy-on-write)."""
        self.c[dst] = self.c[src]


def dense_storage(layout: KVLayout, num_slots: int, num_heads: int, head_dim: int,
                  device: torch.device) -> KVStorage:
    """Unquantized storage for ``layout``: ``DenseKVStorage`` for "kv", ``LatentKVStorage``
    (``num_heads`` 1, ``head_dim`` the latent size) for "latent"."""
    if layout.format == "latent":
        return LatentKVStorage(layout, num_slots, head_dim, device)
    return DenseKVStorage(layout, num_slots, num_heads, head_dim, device)
