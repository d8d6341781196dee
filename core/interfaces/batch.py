"""Per-step batch metadata: planned once per engine step, read by every layer.

The batch is packed ("varlen"): the query tokens of all scheduled sequences are laid end to
end in one tensor, with no padding, and per-sequence offsets say where each begins. A
prefill chunk, a single decode token and a speculative verification of k+1 tokens are the
same thing with different query lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessellm.core.interfaces.multimodal import MultimodalBatch
from tessellm.core.interfaces.sequence import Sequence


PENDING_TOKEN = 0
"""Stand-in id for a token not yet on the host (async scheduling); the engine overwrites it
on the device before the forward reads it."""


@dataclass
class ScheduledSeq:
    """A sequence chosen for this step and how many of its uncomputed tokens to process."""

    seq: Sequence
    num_query_tokens: int


@dataclass
class SchedulerOutput:
    """What one ``Scheduler.schedule()`` call decided."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    """Sequences whose cache was freed to make room; they are recomputed later."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampleSlot:
    """Where one sequence's logits sit in the step's logits tensor.

    ``num_rows`` is 1 for plain decoding and 1 + len(draft_tokens) for speculative
    verification; the rows are consecutive. Parallel sampling (n > 1) gives each forked
    sequence its own slot pointing at the same rows.
    """

    seq: Sequence
    first_row: int
    num_rows: int
    draft_tokens: tuple[int, ...] = ()

    @property
    def last_row(self) -> int:
        return self.first_row + self.num_rows - 1


@dataclass(slots=True)
class PromptRows:
    """Logits rows that score a sequence's prompt (``SamplingParams.prompt_logprobs``): rows
    ``first_row .. first_row + num_rows - 1`` are the logits at prompt positions
    ``first_position ..``, each predicting the prompt token after it. They follow every
    sample slot's rows, so a decoder never sees them."""

    seq: Sequence
    first_row: int
    first_position: int
    num_rows: int


@dataclass
class BatchMetadata:
    """Everything a forward needs about the packed batch; built once per step.

    Example with block size 16: sequence A has 20 tokens cached and decodes 1, sequence B
    prefills a 3-token chunk at positions 0..2. Then ``input_ids`` has 4 rows,
    ``query_start_loc = [0, 1, 4]``, ``seq_lens = [21, 3]``, ``positions = [20, 0, 1, 2]``;
    if A's block table is [7, 2] and B's is [5], ``slot_mapping = [2*16+4, 80, 81, 82]``.
    """

    input_ids: torch.Tensor  # [T] int64, packed query tokens
    positions: torch.Tensor  # [T] int64, absolute position of each query token
    query_start_loc: torch.Tensor  # [B+1] int32, sequence i's queries are rows [q[i], q[i+1])
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) per query token
    block_tables: torch.Tensor  # [B, max_blocks] int32, physical blocks per sequence, -1 padded
    logits_indices: torch.Tensor  # [R] int64, packed rows whose logits the decoder needs
    query_lens_cpu: list[int]  # host copies, so planning never waits on the device
    seq_lens_cpu: list[int]
    block_tables_cpu: list[list[int]]
    block_size: int
    seqs: list[Sequence]  # the scheduled sequences, in batch order
    samples: list[SampleSlot]  # which sequences sample this step, in logits-row order
    prompt_rows: list[PromptRows] = field(default_factory=list)  # after the sample rows
    lora_slots_cpu: list[int] | None = None
    """Each sequence's LoRA slot (-1: none), or None when no sequence of the batch has an
    adapter (``Sequence.lora_slot``)."""
    images: MultimodalBatch | None = None
    """The step's image inputs (plugin API 1.19): embedding rows, 3-D rotary positions and
    image spans; None when no scheduled sequence has images in its query (the model then
    embeds ``input_ids`` alone)."""
    groups: list["BatchMetadata"] = field(default_factory=list)
    """For a cache with several layer groups (``CacheManager.layer_groups``, plugin API 1.8):
    the batch as each further group's layers see it, its slot mapping and block tables that
    group's; empty otherwise."""

    def group(self, index: int) -> "BatchMetadata":
        """The batch as layer group ``index`` sees it (0: this one)."""
        return self if index == 0 else self.groups[index - 1]

    @property
    def num_sample_rows(self) -> int:
        """Logits rows the decoder reads: every sample slot's, before any ``prompt_rows``."""
        return self.prompt_rows[0].first_row if self.prompt_rows else int(self.logits_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def query_starts_cpu(self) -> list[int]:
        """Each sequence's first packed row, then the total: ``query_start_loc`` on the host."""
        starts = [0]
        for n in self.query_lens_cpu:
            starts.append(starts[-1] + n)
        return starts

    def padded_tables(self, members: list[int], num_blocks: int) -> torch.Tensor:
        """Block tables of sequences ``members`` cut or padded (with block 0) to ``num_blocks``
        columns, [len(members), num_blocks] int64 on the CPU. A table may hold more blocks
        than its tokens fill: slots reserved for a speculative decoder's drafts."""
        return torch.tensor([t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks]))
                             for t in (self.block_tables_cpu[i] for i in members)], dtype=torch.long)


@dataclass
class LayerPlans:
    """A step's attention plans when the cache keeps several block tables: one plan per
    layer group (``plans[g]`` made from ``batch.group(g)``) and each layer's group. The model
    hands each layer's backend call its own group's plan (``for_layer``)."""

    plans: list
    group_of_layer: list[int]

    def for_layer(self, layer: int):
        return self.plans[self.group_of_layer[layer]]
