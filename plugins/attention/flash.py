"""Attention `flash`: a Triton FlashAttention-2 forward over packed varlen batches, reading
K/V straight from the paged cache through the block tables (no gather).

Prefills, prefill chunks after cached context and decodes all run through one kernel
(plugins/attention/flash_kernels.py); GQA/MQA map query heads onto their KV head; head dims
up to 256 (padded to a power of two); causal, with an optional sliding window.

On CUDA this is the fast path. On a CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before the first kernel call): slow, but it lets the kernels be
tested, and whole pipelines be run, on a machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from pydantic import Field

import tessellm
from tessellm.core.attention import AttentionBackend
from tessellm.core.batch import BatchMetadata
from tessellm.core.cache import CacheManager, KVStorage
from tessellm.core.plugin import PluginOptions, SelectionContext


class FlashOptions(PluginOptions):
    """Options of the `flash` attention backend (tile sizes: powers of two, at least 16)."""

    block_m: int = Field(16, ge=16, le=256)
    """Query rows per program."""
    block_n: int = Field(32, ge=16, le=256)
    """Keys per inner-loop step."""


@dataclass
class FlashPlan:
    """Per-step kernel arguments shared by every layer."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    block_size: int


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class FlashAttention(AttentionBackend):
    """Triton varlen FlashAttention over the paged cache's raw K/V tensors.

    Reads a ``DenseKVStorage`` ("kv" format, float16/bfloat16/float32). Tested against the
    float64 reference (``tessellm.testing.attention``) under the Triton interpreter on CPU.
    Not yet chosen by ``auto``: it takes over on CUDA once its GPU tests and benchmarks run.
    """

    name = "flash"
    api_version = "1.0"
    description = "Triton FlashAttention over packed varlen batches, K/V read through block tables"
    Options = FlashOptions
    auto_priority = None
    cache_formats = frozenset({"kv"})
    cache_dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = None

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)
        if importlib.util.find_spec("triton") is None:
            reasons.append("needs triton, which is not installed")
        if ctx.device.type == "cpu" and not _interpreting():
            reasons.append("runs on CPU only under Triton's interpreter: set TRITON_INTERPRET=1 (slow; for testing)")
        elif ctx.device.type not in ("cpu", "cuda"):
            reasons.append(f"runs on cuda (or cpu under TRITON_INTERPRET=1), not {ctx.device.type}")
        if ctx.model.head_dim > 256:
            reasons.append(f"supports head dims up to 256, the model has {ctx.model.head_dim}")
        for name in ("block_m", "block_n"):
            value = getattr(ctx.options, name)
            if value & (value - 1):
                reasons.append(f"{name} must be a power of two, not {value}")
        return reasons

    def plan(self, batch: BatchMetadata, cache: CacheManager) -> FlashPlan:
        return FlashPlan(batch.slot_mapping, batch.block_tables.to(torch.int32), batch.query_start_loc,
                         batch.seq_lens, batch.max_query_len, batch.block_size)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVStorage, plan: FlashPlan) -> torch.Tensor:
        from .flash_kernels import paged_flash_attention  # imported late: TRITON_INTERPRET is read then

        kv.store(k, v, plan.slot_mapping)
        return paged_flash_attention(q.contiguous(), kv.k, kv.v, plan.block_tables, plan.query_start, plan.seq_lens,
                                     plan.max_query_len, self.scale, plan.block_size, self.sliding_window,
                                     self.options.block_m, self.options.block_n)


@tessellm.hookimpl
def register_attention(register):
    register(FlashAttention)
