"""Per-page key bounds for the `paged` cache (the "key_bounds" layout extra, which QUEST
asks for): per page (``KVLayout.page_size`` tokens, a divisor of the block; the whole block
where it is None), KV head and channel, the minimum and maximum of the keys it holds.

A block, and so each of its pages, is written in position order by the one sequence that
owns it (a shared block is copied before anyone writes to it), so after a store the page's
valid tokens are its offsets 0 up to the largest offset just written. The bounds are
recomputed over exactly those tokens, read back as stored (dequantized for int8), so they
are exact, not merely grown: tokens past a rollback that a later step overwrites never
linger in them. Per store that reads at most one page's tokens per written page (decode:
one page per sequence): O(new tokens), whatever the context. On CUDA one Triton kernel does
it (bounds_kernel.py), with nothing read back on the host, so a store never synchronises
and a decode step stays capturable; elsewhere torch does.

Copy-on-write copies a block's page bounds with its tokens; ``refresh_bounds`` recomputes
the pages of a block that a truncation left partly filled (the manager calls it for blocks
it owns alone). So every full page's bounds are exactly those of its keys, and stay so
under prefix sharing, forks, rollback and preemption
(tests/plugins/cache/paged/test_key_bounds.py). A partly filled block that several
sequences hold and one of them truncated keeps bounds over the longest holder's keys until
it is written again: they still contain every holder's keys, and a partly filled block is
always its holder's newest, which QUEST attends whatever its score.
"""

from __future__ import annotations

import torch

from tessellm.core.interfaces.kv import DenseKVStorage, KVLayout, KVStorage, dense_storage
from tessellm.plugins.cache.paged.int8_kv import Int8KVStorage

KEY_BOUNDS = "key_bounds"


def bounds_by_kernel(slots: torch.Tensor) -> bool:
    """Whether a store's bounds upkeep runs in the Triton kernel: on CUDA, where Triton comes
    with torch (tests force it on a CPU, interpreted)."""
    import importlib.util

    return slots.is_cuda and importlib.util.find_spec("triton") is not None


class KeyBoundsMixin:
    """Adds ``key_bounds()`` to a paged layer storage: ``kmin``, ``kmax`` [num_pages,
    num_kv_heads, head_dim], refreshed by every ``store`` for the pages it writes."""

    layout: KVLayout
    kmin: torch.Tensor
    kmax: torch.Tensor

    def _init_bounds(self, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device) -> None:
        num_pages = num_slots // self.layout.bounds_page
        # a page never written has empty bounds: +inf / -inf (no key lies inside them)
        self.kmin = torch.full((num_pages, num_kv_heads, head_dim), float("inf"), dtype=dtype, device=device)
        self.kmax = torch.full((num_pages, num_kv_heads, head_dim), float("-inf"), dtype=dtype, device=device)

    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kmin, self.kmax

    def store(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        super().store(k, v, slot_mapping)  # type: ignore[misc]
        self.update_bounds(slot_mapping)

    def update_bounds(self, slots: torch.Tensor) -> None:
        """Recompute the bounds of every page ``slots`` wrote, over its offsets 0 .. the
        largest offset written. For kernels that store K/V themselves (fused RoPE + store)."""
        if slots.numel() == 0:
            return
        ps = self.layout.bounds_page
        if bounds_by_kernel(slots):
            from tessellm.plugins.cache.paged.bounds_kernel import update_page_bounds

            k, _ = self.kv_tensors()  # type: ignore[attr-defined]
            scale = self.kv_scales()[0] if k.dtype == torch.int8 else None  # type: ignore[attr-defined]
            update_page_bounds(k, scale, slots, self.kmin, self.kmax, ps)
            return
        pages, offsets = slots // ps, slots % ps
        if slots.device.type == "cpu":
            # only the token that ends a run of its page needs to recompute: its prefix
            # covers the run's earlier tokens (the page's largest offset always ends a run);
            # picking them reads a count back, free on a CPU. A page is written by one run a
            # step, so each is written once (a plain copy: a scatter-reduce enters an OpenMP
            # parallel region, whose threads wait on one another when the cores are shared)
            ends = torch.ones_like(pages, dtype=torch.bool)
            ends[:-1] = (pages[1:] != pages[:-1]) | (offsets[1:] <= offsets[:-1])
            pages, offsets = pages[ends], offsets[ends]
            lo, hi = self._prefix_bounds(pages, offsets)
            self.kmin.index_copy_(0, pages, lo)
            self.kmax.index_copy_(0, pages, hi)
            return
        # elsewhere, without the kernel, every token recomputes its page's prefix: no read-
        # back, page times the work; a page's largest prefix wins (the bounds of the others)
        lo, hi = self._prefix_bounds(pages, offsets)
        index = pages[:, None, None].expand_as(lo)
        self.kmin.scatter_reduce_(0, index, lo, "amin", include_self=False)
        self.kmax.scatter_reduce_(0, index, hi, "amax", include_self=False)

    def _prefix_bounds(self, pages: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds of each page's tokens at offsets 0..ends (inclusive): [n, Hkv, D] each."""
        ps = self.layout.bounds_page
        offs = torch.arange(ps, device=pages.device)
        keys = self._keys(pages[:, None] * ps + offs)  # [n, ps, Hkv, D]
        outside = (offs[None, :] > ends[:, None])[:, :, None, None]
        # masked_fill, not arithmetic: an unwritten slot may hold NaN
        return (keys.masked_fill(outside, float("inf")).amin(dim=1),
                keys.masked_fill(outside, float("-inf")).amax(dim=1))

    def _keys(self, slots: torch.Tensor) -> torch.Tensor:
        return self.gather(slots)[0]  # type: ignore[attr-defined]

    def refresh_bounds(self, block: int, num_tokens: int) -> None:
        """Recompute the bounds of block ``block``'s pages over its first ``num_tokens``
        tokens (a truncation left it partly filled); empty bounds for pages left empty."""
        ps, per_block = self.layout.bounds_page, self.layout.block_size // self.layout.bounds_page
        for page in range(block * per_block, (block + 1) * per_block):
            held = num_tokens - (page - block * per_block) * ps
            if held <= 0:
                self.kmin[page] = float("inf")
                self.kmax[page] = float("-inf")
                continue
            index = torch.tensor([page], device=self.kmin.device)
            lo, hi = self._prefix_bounds(index, torch.tensor([min(held, ps) - 1], device=self.kmin.device))
            self.kmin[page], self.kmax[page] = lo[0], hi[0]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write of whole blocks (the manager's only use): the tokens and their bounds."""
        super().copy_slots(src, dst)  # type: ignore[misc]
        ps = self.layout.bounds_page
        src_pages, dst_pages = src[::ps] // ps, dst[::ps] // ps
        self.kmin[dst_pages] = self.kmin[src_pages]
        self.kmax[dst_pages] = self.kmax[src_pages]


class BoundedDenseKVStorage(KeyBoundsMixin, DenseKVStorage):
    """``DenseKVStorage`` that also keeps per-block key bounds (the "key_bounds" extra)."""

    def __init__(self, layout: KVLayout, num_slots: int, num_kv_heads: int, head_dim: int, device: torch.device):
        super().__init__(layout, num_slots, num_kv_heads, head_dim, device)
        self._init_bounds(num_slots, num_kv_heads, head_dim, layout.dtype, device)

    def _keys(self, slots: torch.Tensor) -> torch.Tensor:
        return self.k.index_select(0, slots.reshape(-1)).view(*slots.shape, *self.k.shape[1:])


class BoundedInt8KVStorage(KeyBoundsMixin, Int8KVStorage):
    """``Int8KVStorage`` that also keeps per-block key bounds, over the dequantized keys."""

    def __init__(self, layout: KVLayout, num_slots: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, compute_dtype: torch.dtype):
        super().__init__(layout, num_slots, num_kv_heads, head_dim, device, compute_dtype)
        self._init_bounds(num_slots, num_kv_heads, head_dim, compute_dtype, device)


def make_layer_storage(layout: KVLayout, num_slots: int, num_kv_heads: int, head_dim: int, device: torch.device,
                       compute_dtype: torch.dtype) -> KVStorage:
    """One layer's storage for ``layout``: int8 or the compute dtype, with key bounds if the
    layout's extras ask for them; an MLA latent in the compute dtype."""
    if layout.format == "latent":
        return dense_storage(layout, num_slots, num_kv_heads, head_dim, device)
    bounded = KEY_BOUNDS in layout.extras
    if layout.dtype == torch.int8:
        cls = BoundedInt8KVStorage if bounded else Int8KVStorage
        return cls(layout, num_slots, num_kv_heads, head_dim, device, compute_dtype)
    cls = BoundedDenseKVStorage if bounded else DenseKVStorage
    return cls(layout, num_slots, num_kv_heads, head_dim, device)


def bounds_bytes_per_block(num_kv_heads: int, head_dim: int, dtype: torch.dtype, pages: int = 1) -> int:
    """Bytes one block's key bounds take per layer (a minimum and a maximum per channel and
    page, ``pages`` of them a block)."""
    return 2 * pages * num_kv_heads * head_dim * dtype.itemsize
