"""int8 KV storage for the `paged` cache (``kv_dtype: int8``).

Each token's key (and value) is stored per KV head as ``head_dim`` int8 values and one
float16 scale: scale = the head's largest |value| over 127, value = round(x / scale). The
scale belongs to the token alone, so storing a token never changes another, copy-on-write
and rollback stay exact operations on slots, and what a token reads back is a function of
what was written for it (``stored_value``). Per head and token, int8 plus a float16 scale
is ``head_dim + 2`` bytes against ``2 * head_dim`` in bfloat16: 1.94x the tokens in the
same memory at head_dim 64, 1.97x at 128.

Backends read it through ``gather``, which dequantizes into the compute dtype (sdpa,
cascade), or in place: ``kv_tensors`` hands a kernel the int8 values and ``kv_scales`` their
scales, and the kernel dequantizes each tile as it loads it (flash).
"""

from __future__ import annotations

import torch

from tessellm.core.interfaces.kv import KVLayout, KVStorage

SCALE_DTYPE = torch.float16


def bytes_per_token_head(head_dim: int) -> int:
    """Bytes one token's K (or V) takes per KV head: int8 values and a float16 scale."""
    return head_dim + SCALE_DTYPE.itemsize


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [..., D], float16 scale [..., 1]) of x [..., D], one scale per head vector."""
    scale = (x.detach().float().abs().amax(dim=-1, keepdim=True) / 127.0).to(SCALE_DTYPE)
    safe = scale.float().clamp(min=torch.finfo(SCALE_DTYPE).tiny)
    return (x.float() / safe).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_heads(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


class Int8KVStorage(KVStorage):
    """One layer's K and V as int8 [num_slots, num_kv_heads, head_dim] with float16 scales
    [num_slots, num_kv_heads, 1]; ``gather`` returns them dequantized in ``compute_dtype``."""

    def __init__(self, layout: KVLayout, num_slots: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, compute_dtype: torch.dtype):
        if layout.format != "kv" or layout.dtype != torch.int8:
            raise ValueError(f"Int8KVStorage holds int8 'kv' layouts, not {layout}")
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.k = torch.empty(num_slots, num_kv_heads, head_dim, dtype=torch.int8, device=device)
        self.v = torch.empty(num_slots, num_kv_heads, head_dim, dtype=torch.int8, device=device)
        self.k_scale = torch.empty(num_slots, num_kv_heads, 1, dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.empty(num_slots, num_kv_heads, 1, dtype=SCALE_DTYPE, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def bytes_per_slot(self) -> int:
        return 2 * (self.k[0].numel() + self.k_scale[0].numel() * SCALE_DTYPE.itemsize)

    def kv_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_scale, self.v_scale

    def store(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        assert v is not None and k.shape == v.shape and k.shape[0] == slot_mapping.shape[0], (k.shape, slot_mapping.shape)
        for values, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_heads(x)
            values.index_copy_(0, slot_mapping, q)
            scales.index_copy_(0, slot_mapping, scale)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.k.shape[1:])
        return tuple(dequantize_heads(values.index_select(0, flat), scales.index_select(0, flat),
                                      self.compute_dtype).view(shape)
                     for values, scales in ((self.k, self.k_scale), (self.v, self.v_scale)))

    def stored_value(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_heads(x)
        return dequantize_heads(q, scale, self.compute_dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the tokens in slots ``src`` to slots ``dst`` (copy-on-write), scales included."""
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            t[dst] = t[src]
