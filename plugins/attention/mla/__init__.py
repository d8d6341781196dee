"""Attention `mla`: multi-head latent attention for DeepSeek-V2/V3 (backend.py), with naive
and absorbed forms in torch and a Triton split-K absorbed decode kernel (decode_kernel.py)."""

import tessellm
from tessellm.plugins.attention.mla.backend import MlaAttention, MlaOptions, MlaPlan

__all__ = ["MlaAttention", "MlaOptions", "MlaPlan"]


@tessellm.hookimpl
def register_attention(register):
    register(MlaAttention)
