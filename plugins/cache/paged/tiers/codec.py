"""One block of a paged cache as bytes: every layer's share of it (K and V, int8 scales, an
MLA latent, QUEST's key bounds) packed into one flat buffer, and back.

A block's content is the ``block_size`` slots it holds in every per-slot tensor of every
layer, plus its pages' key bounds where the layout keeps them. ``BlockCodec`` lists those
tensors once, viewed with the block id as their first dimension, and gives each a fixed,
aligned span of a flat uint8 buffer; packing copies each view's row into its span,
unpacking copies it back. The list (names, shapes, dtypes) is the codec's ``schema``, part
of the fingerprint a disk tier keys its files by: a file of another layout never unpacks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from tessellm.core.interfaces.kv import KVStorage

_ALIGN = 16  # every span starts on this many bytes, so any dtype can view it


@dataclass(frozen=True)
class _Span:
    layer: int
    name: str
    offset: int
    shape: tuple[int, ...]  # one block's part of the tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def block_views(storage: KVStorage) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one layer's storage that a block's content lives in, each viewed as
    [num_blocks, ...] (block id first). Per-slot tensors (K, V, their int8 scales, a latent)
    are grouped by ``block_size`` slots, key bounds by the block's pages."""
    layout = storage.layout
    bs = layout.block_size
    views: list[tuple[str, torch.Tensor]] = []
    for name in ("k", "v", "k_scale", "v_scale", "c"):
        tensor = getattr(storage, name, None)
        if isinstance(tensor, torch.Tensor):
            views.append((name, tensor.view(-1, bs, *tensor.shape[1:])))
    pages = bs // layout.bounds_page
    for name in ("kmin", "kmax"):
        tensor = getattr(storage, name, None)
        if isinstance(tensor, torch.Tensor):
            views.append((name, tensor.view(-1, pages, *tensor.shape[1:])))
    if not views:
        raise TypeError(f"{type(storage).__name__} keeps none of the tensors a tiered cache moves "
                        f"(k, v, scales, a latent, key bounds)")
    return views


class BlockCodec:
    """Packs blocks of ``layers`` (one storage per layer) into flat uint8 buffers and back.

    Contract: ``unpack(pack(b), b2)`` leaves block ``b2`` of every layer holding exactly what
    block ``b`` held (values, scales, bounds), so ``gather`` reads identical tensors.
    """

    def __init__(self, layers: list[KVStorage]):
        self._parts: list[tuple[_Span, torch.Tensor]] = []
        offset = 0
        for i, storage in enumerate(layers):
            for name, view in block_views(storage):
                span = _Span(i, name, offset, tuple(view.shape[1:]), view.dtype)
                self._parts.append((span, view))
                offset += -(-span.nbytes // _ALIGN) * _ALIGN
        self.spans = [span for span, _ in self._parts]
        self.block_bytes = offset
        self.device = layers[0].device if layers else torch.device("cpu")

    @property
    def schema(self) -> str:
        """What one buffer holds, span by span: equal schemas read each other's buffers."""
        return ";".join(f"{s.layer}.{s.name}:{s.offset}:{'x'.join(map(str, s.shape))}:{s.dtype}" for s in self.spans)

    def schema_digest(self) -> str:
        return hashlib.blake2b(self.schema.encode(), digest_size=8).hexdigest()

    def empty(self, pin: bool = False) -> torch.Tensor:
        """A buffer for one block (pinned host memory when ``pin``, for asynchronous copies)."""
        return torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=pin)

    def _span_view(self, buffer: torch.Tensor, span: _Span) -> torch.Tensor:
        return buffer[span.offset:span.offset + span.nbytes].view(span.dtype).view(span.shape)

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [self._span_view(buffer, span) for span in self.spans]

    def pack(self, block: int, out: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """Copy block ``block`` of every layer into ``out`` (a uint8 buffer of block_bytes).
        One fused copy of every span (``_foreach_copy_``); from a GPU into host memory, into a
        device buffer first, then one transfer of the whole block."""
        sources = [view[block] for _, view in self._parts]
        if out.device == self.device:
            torch._foreach_copy_(self._views(out), sources)
            return out
        staging = torch.empty(self.block_bytes, dtype=torch.uint8, device=self.device)
        torch._foreach_copy_(self._views(staging), sources)
        out.copy_(staging, non_blocking=non_blocking)
        return out

    def unpack(self, buffer: torch.Tensor, block: int, non_blocking: bool = False) -> None:
        """Copy ``buffer`` (what ``pack`` wrote) into block ``block`` of every layer: one
        transfer of the whole block to the device, then one fused copy of every span."""
        if buffer.numel() != self.block_bytes:
            raise ValueError(f"a block buffer of this cache holds {self.block_bytes} bytes, not {buffer.numel()}")
        if buffer.device != self.device:
            buffer = buffer.to(self.device, non_blocking=non_blocking)
        torch._foreach_copy_([view[block] for _, view in self._parts], self._views(buffer))
