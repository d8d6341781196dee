"""The LoRA kernel interface: apply many low-rank adapters to the rows of one packed batch.

A pipeline with LoRA enabled wraps each target projection (``core/model/lora.py``): the
base layer runs as before, then the kernel adds each row's own adapter product in place::

    out[t] += B[s] @ (A[s] @ x[t])      for every row t whose sequence uses slot s >= 0

``A`` and ``B`` are the projection's slot buffers, one slot per adapter resident on the
device (``LoraWeights``). A slot holds its adapter zero-padded to the slot rank, the PEFT
scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into ``B``; a stacked projection
(q/k/v as one GEMM) holds each part's adapter on its own band of the rank axis, with ``B``
block-diagonal, so one call serves all parts. Rows whose sequence has no adapter (slot -1)
are left untouched.

A kernel plans once per step (``plan``, from the step's ``LoraMapping``) and applies the plan
in every wrapped layer (``apply``). Which rows use which slot is fixed per sequence: the
sequence's query rows are contiguous in the packed batch, so each sequence is one segment
(Punica's SGMV: a segmented gather matrix-vector product).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tessellm.core.plugin import Plugin, PluginOptions


@dataclass
class LoraMapping:
    """Which adapter slot each sequence of a step's packed batch uses.

    Sequence ``i``'s query rows are ``query_start_loc[i] .. query_start_loc[i + 1] - 1``
    (the batch's own offsets, ``BatchMetadata.query_start_loc``); its slot is
    ``seq_slots[i]`` (-1: no adapter). ``token_slots`` is the same per packed row. The host
    lists say the same where a kernel plans on the host; under a CUDA graph (``static``) they
    describe the capture batch only and the device tensors are what each replay reads."""

    seq_slots: torch.Tensor
    """[B] int32 on the device: each sequence's slot, -1 for none."""
    token_slots: torch.Tensor
    """[T] int64 on the device: each packed row's slot, -1 for none."""
    query_start_loc: torch.Tensor
    """[B + 1] int32 on the device: where each sequence's rows begin, then T."""
    seq_slots_cpu: list[int]
    query_starts_cpu: list[int]
    num_slots: int
    """Slots in every layer's buffers (``LoraWeights.num_slots``)."""
    max_query_len: int
    """The most rows one sequence has in this batch (1 in a decode step)."""
    static: bool = False
    """The plan is captured in a CUDA graph and replayed over other batches of the same
    shape: it may read only the device tensors (never the host lists)."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_slots.shape[0])

    @property
    def active_slots(self) -> list[int]:
        """The distinct slots some sequence uses (sorted, -1 excluded), from the host list."""
        return sorted({s for s in self.seq_slots_cpu if s >= 0})


@dataclass
class LoraWeights:
    """One wrapped projection's slot buffers (what ``apply`` reads).

    ``a`` [num_slots, rank, in_features] is the shrink (PEFT's ``lora_A``), ``b``
    [num_slots, out_features, rank] the expand (``lora_B``, scaled); both contiguous, in the
    model's dtype on its device, zero where a slot's adapter has no such rank or target.
    ``derived`` is the kernels' own: forms of ``a`` and ``b`` a kernel builds once (a
    transposed copy, a packed layout), keyed as it likes; it is emptied whenever a slot is
    written, so whatever is there matches the slots. A captured plan's ``apply`` must not
    read it: the graph would keep reading the entry a later slot load replaced."""

    a: torch.Tensor
    b: torch.Tensor
    derived: dict[Any, torch.Tensor] = field(default_factory=dict)

    @property
    def num_slots(self) -> int:
        return int(self.a.shape[0])

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


class LoraKernel(Plugin):
    """Applies the adapters of a batch's rows to one projection's output (plugin API 1.10).

    Contract:

    - ``plan(mapping)`` runs once per step with LoRA rows in it; whatever it returns is
      handed to every ``apply`` of the step. It must not change between layers.
    - ``apply(out, x, weights, plan)``: ``x`` [T, in_features], ``out`` [T, out_features]
      (the base projection's output, same dtype), adds ``B[s] @ (A[s] @ x[t])`` to each row
      ``t`` whose slot ``s >= 0`` in place, leaves the other rows' values unchanged, and
      returns nothing. Equal to the torch reference within the dtype's rounding.
    - ``supports_cuda_graphs``: ``plan`` with ``mapping.static`` set reads only device
      tensors and ``apply`` launches a fixed sequence of kernels, so a decode step's forward
      can be captured in a CUDA graph with LoRA rows in it. The capture happens at start-up,
      before any adapter is loaded, with every row at slot -1; each replay must then apply the
      slots its device tensors hold and the weights ``a`` and ``b`` hold at that moment: no
      launch width, branch or cached form (``LoraWeights.derived``) may depend on what the
      capture saw (``tessellm.testing.graph_replay`` checks a kernel so on a CPU). A kernel
      that sets it False keeps decode steps with adapters eager (batches without adapters
      still replay).

    The config's ``lora`` section picks the kernel (``name``) and its ``options``; the slot
    count and rank come from the same section (``max_loras``, ``max_rank``)."""

    kind: ClassVar[str] = "lora"
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, options: PluginOptions, device: torch.device, dtype: torch.dtype):
        self.options = options
        self.device = device
        self.dtype = dtype

    def plan(self, mapping: LoraMapping) -> Any:
        """What every ``apply`` of the step reads (default: the mapping itself)."""
        return mapping

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        raise NotImplementedError
