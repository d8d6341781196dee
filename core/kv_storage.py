"""Dense KV storage: the "kv" format in the compute dtype, one slot per token.

Any cache plugin whose layout is plain K and V (contiguous, paged, radix) can hold its layers
in this class; it differs from another only in how slots are handed out.
"""

from __future__ import annotations

import torch

from .cache import KVLayout, KVStorage


class DenseKVStorage(KVStorage):
    """One layer's K and V as two [num_slots, num_kv_heads, head_dim] tensors.

    Slot ``s`` is token ``s % block_size`` of block ``s // block_size``; kernels may view
    the tensors as [num_blocks, block_size, num_kv_heads, head_dim] (``blocks()``).
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
        # index_select on flat indices is 2-3x faster than advanced indexing on the CPU
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.k.shape[1:])
        return self.k.index_select(0, flat).view(shape), self.v.index_select(0, flat).view(shape)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the tokens in slots ``src`` to slots ``dst`` (fork, copy-on-write)."""
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]
