"""Attention `flash`: Triton FlashAttention over the paged cache (backend.py), its prefill and
split-K decode kernels (prefill.py, decode.py, common.py) and its fused RoPE + KV store
(rope_store.py)."""

import tessellm
from tessellm.plugins.attention.flash.backend import FlashAttention, FlashOptions, FlashPlan

__all__ = ["FlashAttention", "FlashOptions", "FlashPlan"]


@tessellm.hookimpl
def register_attention(register):
    register(FlashAttention)
