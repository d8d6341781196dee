"""Attention `example-logging`: counts steps and layer calls, then delegates to `sdpa`.

Loaded through this package's ``[project.entry-points.tessellm]``; select it with
``--set attention.name=example-logging`` (it has no ``auto_priority``, so ``auto`` never
picks it).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from pydantic import Field

import tessellm
from tessellm.core.batch import BatchMetadata
from tessellm.core.cache import CacheManager, KVStorage
from tessellm.core.plugin import SelectionContext
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions, SdpaPlan


class LoggingOptions(SdpaOptions):
    """Options of `example-logging`; it inherits sdpa's `batch_decode`."""

    log_every: int = Field(1, ge=0, le=1_000_000)
    """Print one line to stderr every log_every engine steps; 0 prints nothing."""
    max_context: Optional[int] = Field(None, gt=0)
    """Refuse pipelines whose max_model_len is above this (shows unsupported_reasons); None: no limit."""


class LoggingAttention(SdpaAttention):
    """sdpa, counting engine steps (plan calls), layer calls (forward calls) and query tokens."""

    name = "example-logging"
    api_version = "1.0"  # must be set on this class itself; inheriting sdpa's does not count
    description = "counts plan/forward calls and delegates to sdpa (example plugin)"
    Options = LoggingOptions
    auto_priority = None  # only used when named

    def __init__(self, options: LoggingOptions, model, device: torch.device, dtype: torch.dtype):
        super().__init__(options, model, device, dtype)
        self.steps = 0
        self.layer_calls = 0
        self.query_tokens = 0

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)  # device, cache format/dtype, head size
        limit = ctx.options.max_context  # ctx.options: this plugin's validated LoggingOptions
        if limit is not None and ctx.max_model_len > limit:
            reasons.append(f"max_context={limit}, but the pipeline's max_model_len is {ctx.max_model_len}; "
                           f"set max_model_len or attention.options.max_context")
        return reasons

    def plan(self, batch: BatchMetadata, cache: CacheManager) -> SdpaPlan:
        self.steps += 1
        self.query_tokens += batch.num_tokens
        every = self.options.log_every
        if every and self.steps % every == 0:
            print(f"example-logging: step {self.steps}: {batch.num_seqs} seqs, {batch.num_tokens} query tokens, "
                  f"{self.layer_calls} layer calls so far", file=sys.stderr)
        return super().plan(batch, cache)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVStorage, plan: SdpaPlan) -> torch.Tensor:
        self.layer_calls += 1
        return super().forward(layer, q, k, v, kv, plan)


@tessellm.hookimpl
def register_attention(register):
    register(LoggingAttention)
