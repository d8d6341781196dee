"""LoRA `triton`: every resident adapter applied to a packed batch in two Triton launches,
Punica's segmented shrink and expand (kernels.py), each sequence's rows one segment.

The plan is the step's device tensors (``seq_slots``, ``query_start_loc``) and a launch
width taken from the host lists: how many programs share the longest adapter segment's row
tiles. A captured plan (``LoraMapping.static``) reads only the device tensors and takes one
program per segment (decode rows), so each replay reads its own slots.

On CUDA this is the fast path, and ``auto`` picks it there. On a CPU it runs only under
Triton's interpreter (``TRITON_INTERPRET=1`` set before the first kernel call): slow, for
tests, and only when named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field

import tessellm
from tessellm.core.interfaces.lora import LoraKernel, LoraMapping, LoraWeights
from tessellm.core.model.triton_support import triton_device_reasons
from tessellm.core.plugin import PluginOptions, SelectionContext

MAX_ROW_PROGRAMS = 1024
"""The most programs sharing one segment's row tiles (each loops over the tiles it gets)."""


class TritonLoraOptions(PluginOptions):
    """Options of the `triton` LoRA kernel (tile sizes: powers of two, at least 16)."""

    block_n: int | None = Field(None, ge=16, le=256)
    """Output columns per expand program (None: 64 for decodes and 128 for prefills on CUDA,
    32 interpreted)."""
    block_k: int | None = Field(None, ge=16, le=256)
    """Input columns per shrink step (None: 128 on CUDA, 32 interpreted)."""
    split: int | None = Field(None, ge=1, le=16)
    """Ways the shrink splits the input columns, each split a float32 partial the expand sums
    (None: enough programs for two per SM when the batch alone leaves the GPU idle)."""


@dataclass
class TritonPlan:
    """What every layer's launch reads in one step."""

    seq_slots: torch.Tensor  # [B] int32 each sequence's slot, -1: none
    query_start_loc: torch.Tensor  # [B + 1] int32 each sequence's first row, then T
    row_programs: int
    """Programs per segment along its rows (0: no segment has an adapter, nothing runs)."""
    block_m: int
    """Rows per tile, from the longest adapter segment (16 for decodes)."""
    segments: int
    """Segments with work (every segment in a captured plan): sizes the shrink's split."""
    configs: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    """Launch shapes by (in, out, rank): layers of one shape share one."""


class TritonLora(LoraKernel):
    """Triton SGMV: a shrink (x @ A[s]^T into float32) and an expand (out += h @ B[s]^T)
    launch per layer, one program per (segment, tile); rows without an adapter untouched.

    Held to the torch reference and to float64 under the interpreter on CPU
    (tests/plugins/lora/test_triton_lora.py); timed against it by bench/lora_kernels.py."""

    name = "triton"
    api_version = "1.19"
    description = "Triton segmented shrink/expand (Punica SGMV) over each sequence's rows"
    Options = TritonLoraOptions
    auto_priority = 20
    supports_cuda_graphs = True

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx) + triton_device_reasons(ctx)
        if ctx.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"computes in float16, bfloat16 or float32, not {ctx.dtype}")
        for name in ("block_n", "block_k"):
            value = getattr(ctx.options, name)
            if value is not None and value & (value - 1):
                reasons.append(f"{name} must be a power of two, not {value}")
        return reasons

    def plan(self, mapping: LoraMapping) -> TritonPlan:
        from tessellm.plugins.lora.triton.kernels import block_m_for

        if mapping.static:  # device tensors only; max_query_len describes the captured shape
            rows, segments = mapping.max_query_len, mapping.num_seqs
        else:
            starts, slots = mapping.query_starts_cpu, mapping.seq_slots_cpu
            lengths = [starts[i + 1] - starts[i] for i, s in enumerate(slots) if s >= 0]
            rows, segments = max(lengths, default=0), len(lengths)
        block_m = block_m_for(rows, self.device)
        programs = max(1, min(-(-rows // block_m), MAX_ROW_PROGRAMS)) if segments else 0
        return TritonPlan(mapping.seq_slots, mapping.query_start_loc, programs, block_m, segments)

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        from tessellm.plugins.lora.triton.kernels import launch_config, sgmv_shrink_expand

        if plan.row_programs == 0:
            return
        key = (x.shape[1], out.shape[1], weights.rank)
        config = plan.configs.get(key)
        if config is None:
            o = self.options
            config = plan.configs[key] = launch_config(*key, plan.block_m, plan.segments * plan.row_programs,
                                                       x.device, o.block_n, o.block_k, o.split)
        sgmv_shrink_expand(out, x, weights.a, weights.b, plan.seq_slots, plan.query_start_loc, plan.row_programs,
                           config)


@tessellm.hookimpl
def register_lora(register):
    register(TritonLora)
