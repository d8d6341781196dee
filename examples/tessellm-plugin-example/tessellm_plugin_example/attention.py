"""Attention `example-logging`: attention over the KV cache in plain torch, counting its calls.

The whole attention contract in one screen: ``plan`` turns the step's block tables into each
sequence's cache slots once per step; ``forward`` stores the layer's new K/V, reads each
sequence's context back through ``KVStorage.gather`` and attends causally (within the model's
sliding window, if it has one), GQA included. It imports only from ``tessellm``, the plugin
API. Loaded through this package's ``[project.entry-points.tessellm]``; select it with
``--set attention.name=example-logging`` (it has no ``auto_priority``, so ``auto`` never
picks it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
from pydantic import Field

import tessellm


class LoggingOptions(tessellm.PluginOptions):
    """Options of `example-logging`."""

    log_every: int = Field(1, ge=0, le=1_000_000)
    """Print one line to stderr every log_every engine steps; 0 prints nothing."""
    max_context: Optional[int] = Field(None, gt=0)
    """Refuse pipelines whose max_model_len is above this (shows unsupported_reasons); None: no limit."""


@dataclass
class LoggingPlan:
    """What every layer of one step shares: where the new K/V go, and per sequence its first
    packed query row, its query length and its context's cache slots [context length]."""

    slot_mapping: torch.Tensor
    sequences: list[tuple[int, int, torch.Tensor]]


class LoggingAttention(tessellm.AttentionBackend):
    """Plain-torch attention over any "kv" cache, counting engine steps (plan calls), layer
    calls (forward calls) and query tokens."""

    name = "example-logging"
    api_version = "1.1"  # must be set on this class itself; an inherited one does not count
    description = "plain-torch attention that counts its plan/forward calls (example plugin)"
    Options = LoggingOptions
    auto_priority = None  # only used when named

    def __init__(self, options: LoggingOptions, model: tessellm.ModelSpec, device: torch.device, dtype: torch.dtype):
        super().__init__(options, model, device, dtype)
        self.steps = 0
        self.layer_calls = 0
        self.query_tokens = 0

    @classmethod
    def unsupported_reasons(cls, ctx: tessellm.SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)  # device, cache format/dtype, head size
        limit = ctx.options.max_context  # ctx.options: this plugin's validated LoggingOptions
        if limit is not None and ctx.max_model_len > limit:
            reasons.append(f"max_context={limit}, but the pipeline's max_model_len is {ctx.max_model_len}; "
                           f"set max_model_len or attention.options.max_context")
        return reasons

    def plan(self, batch: tessellm.BatchMetadata, cache: tessellm.CacheManager) -> LoggingPlan:
        self.steps += 1
        self.query_tokens += batch.num_tokens
        every = self.options.log_every
        if every and self.steps % every == 0:
            print(f"example-logging: step {self.steps}: {batch.num_seqs} seqs, {batch.num_tokens} query tokens, "
                  f"{self.layer_calls} layer calls so far", file=sys.stderr)
        bs, device = batch.block_size, batch.input_ids.device
        sequences, row = [], 0
        for q_len, kv_len, table in zip(batch.query_lens_cpu, batch.seq_lens_cpu, batch.block_tables_cpu):
            pos = torch.arange(kv_len)  # token p lives in slot table[p // bs] * bs + p % bs
            slots = torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
            sequences.append((row, q_len, slots.to(device)))
            row += q_len
        return LoggingPlan(batch.slot_mapping, sequences)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: tessellm.KVStorage, plan: LoggingPlan) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; the step's k, v are stored first, then read back
        # with the rest of each context (only slots below each sequence's length: never an
        # unwritten one, which may hold NaN)
        self.layer_calls += 1
        kv.store(k, v, plan.slot_mapping)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least float32
        for first, q_len, slots in plan.sequences:
            keys, values = kv.gather(slots)  # [L, Hkv, D] each
            keys = keys.to(acc).repeat_interleave(group, dim=1)  # [L, Hq, D]: query head h reads KV head h // group
            values = values.to(acc).repeat_interleave(group, dim=1)
            length = slots.shape[0]
            q_pos = torch.arange(length - q_len, length, device=q.device)[:, None]  # [Q, 1]
            k_pos = torch.arange(length, device=q.device)[None, :]  # [1, L]
            visible = k_pos <= q_pos
            if self.sliding_window is not None:
                visible &= q_pos - k_pos < self.sliding_window
            scores = torch.einsum("qhd,khd->hqk", q[first:first + q_len].to(acc), keys) * self.scale
            weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [Hq, Q, L]
            out[first:first + q_len] = torch.einsum("hqk,khd->qhd", weights, values).to(q.dtype)
        return out


@tessellm.hookimpl
def register_attention(register):
    register(LoggingAttention)
