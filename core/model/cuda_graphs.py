"""Decode steps replayed from captured CUDA graphs.

A decode step of a small model is hundreds of kernel launches of a few microseconds each; in
eager mode the host issuing them, not the GPU, sets the pace. ``DecodeGraphs`` captures the
whole forward (embedding to logits) once per padded batch size at start-up and replays it:
one launch per step.

A graph replays fixed kernels on fixed addresses, so every step's inputs are copied into
static buffers first. A batch of B decodes runs in the smallest captured size P >= B; rows
B..P-1 are padding: token 0 at position 0, one key long, writing and reading only the cache's
scratch block (``CacheManager.scratch_block``), which no sequence ever holds. The attention
backend contributes a plan that reads only those buffers (``AttentionBackend.graph_plan``).

With LoRA (``lora``, the wrapped layers' state) each size gets a second graph whose LoRA
kernel reads static slot buffers; a batch with adapters replays that one. Graphs are captured
at start-up, before any adapter is in a slot: whatever a replay must see of the adapters
(each row's slot, the slots' weights, loaded and replaced later) is read from device tensors
updated in place, never from anything the capture computed or cached on the host.

Only pure decode batches qualify (one query token per sequence, every one sampled, no layer
subset, block tables within the captured width); anything else runs eagerly. With
``capture=False`` the same padded path runs eagerly; on a CPU
``tessellm.testing.graph_replay`` records and replays it instead, as a graph would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessellm.core.interfaces.attention import AttentionBackend
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.lora import LoraMapping

if TYPE_CHECKING:
    from tessellm.core.model.lora import LoraState


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, then every multiple of 8, ending at
    ``max_batch`` (a batch pads by at most 7 rows, and never to more than twice its size)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    return sorted(set(sizes) | {max_batch})


class DecodeGraphs:
    """Captured decode forwards, one per padded batch size, sharing one memory pool.

    ``run(batch)`` returns the logits [B, vocab] of a qualifying decode batch, in the LM
    head's dtype (a view of the one static buffer every size writes, valid until the next
    replay), or None when the batch must run eagerly.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, cache: CacheManager, device: torch.device,
                 *, max_batch: int, max_model_len: int, capture: bool = True, lora: "LoraState | None" = None):
        if cache.scratch_block is None:
            raise ValueError(f"cache {cache.name!r} has no scratch block for padded rows")
        self.model, self.backend, self.cache, self.device = model, backend, cache, device
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        bs = cache.layout.block_size
        self.max_blocks = -(-max_model_len // bs) + 1  # +1: lookahead slots may spill into one more block
        self.scratch_slot = cache.scratch_block * bs
        m = self.sizes[-1]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(m, **i64)
        self.positions = torch.zeros(m, **i64)
        self.slot_mapping = torch.full((m,), self.scratch_slot, **i64)
        self.seq_lens = torch.ones(m, **i32)
        self.block_tables = torch.full((m, self.max_blocks), cache.scratch_block, **i32)
        self.query_start_loc = torch.arange(m + 1, **i32)
        self.logits_indices = torch.arange(m, **i64)
        # one logits buffer for every size, allocated outside the graphs' pool: a graph's own
        # output would stay alive in the pool, a (batch x vocabulary) block per size. It holds
        # the LM head's own dtype (bfloat16 on a GPU): the head's GEMM writes it directly, and
        # an argmax reads half the bytes; callers wanting float32 convert (ModelRunner.forward)
        self.logits: torch.Tensor | None = None
        self.graphs: dict[int, tuple[Any, Any]] = {}  # size -> (graph, plan)
        self.replays = 0
        self.lora_replays = 0
        """Replays of the graphs with adapter rows (of ``replays``)."""
        self.capture = capture
        # with LoRA, a second graph per size runs the kernel over static slot buffers (batches
        # without adapters replay the plain one); a kernel that cannot be captured runs eagerly
        self.lora = lora if lora is not None and lora.kernel.supports_cuda_graphs else None
        self.has_lora = lora is not None
        self.lora_graphs: dict[int, tuple[Any, Any]] = {}
        self.lora_seq_slots = torch.full((m,), -1, **i32)
        self.lora_token_slots = torch.full((m,), -1, **i64)
        with torch.inference_mode():
            # an eager forward of one row sizes the logits buffer, on this stream, outside the pool
            self._forward(1, backend.graph_plan(self._static_batch(1), cache, max_model_len))
            pool = self._new_pool() if capture else None
            for size in reversed(self.sizes):  # largest first: later captures reuse its pool memory
                self.graphs[size] = self._capture(size, pool)
                if self.lora is not None:
                    self.lora_graphs[size] = self._capture(size, pool, self._lora_plan(size))

    def _static_batch(self, size: int) -> BatchMetadata:
        """A decode batch of ``size`` rows whose tensors are views of the static buffers."""
        return BatchMetadata(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            logits_indices=self.logits_indices[:size], query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size, block_tables_cpu=[], block_size=self.cache.layout.block_size,
            seqs=[], samples=[])

    def _forward(self, size: int, plan: Any, lora_plan: Any = None) -> torch.Tensor:
        out = None if self.logits is None else self.logits[:size]
        if lora_plan is not None:
            self.lora.plan = lora_plan
        try:
            logits = self.model(self.input_ids[:size], self.positions[:size], self.logits_indices[:size],
                                self.backend, self.cache, plan, logits_out=out, native_logits=True)
        finally:
            if lora_plan is not None:
                self.lora.plan = None
        if self.logits is None:  # the first forward: its logits' row shape and dtype serve all sizes
            self.logits = torch.empty((self.sizes[-1], *logits.shape[1:]), dtype=logits.dtype, device=logits.device)
            logits = self.logits[:size].copy_(logits)
        return logits

    def _lora_plan(self, size: int) -> Any:
        """The LoRA kernel's plan over the static slot buffers (``LoraMapping.static``)."""
        mapping = LoraMapping(self.lora_seq_slots[:size], self.lora_token_slots[:size],
                              self.query_start_loc[:size + 1], [0] * size, list(range(size + 1)),
                              self.lora.num_slots, 1, static=True)
        return self.lora.kernel.plan(mapping)

    def _capture(self, size: int, pool: Any, lora_plan: Any = None) -> tuple[Any, Any]:
        plan = self.backend.graph_plan(self._static_batch(size), self.cache, self.max_model_len)
        if not self.capture:
            return None, (plan, lora_plan)
        return self._record(size, pool, plan, lora_plan), (plan, lora_plan)

    def _new_pool(self) -> Any:
        """The memory pool every size's graph shares."""
        return torch.cuda.graph_pool_handle()

    def _record(self, size: int, pool: Any, plan: Any, lora_plan: Any) -> Any:
        """One size's forward, warmed up then captured: an object whose ``replay()`` reruns
        it on the static buffers (tessellm.testing.graph_replay records it on a CPU instead,
        with the same semantics: launches, shapes and host-side values fixed here)."""
        # warm up on a side stream (kernel compilation, allocator, library handles), then capture
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(size, plan, lora_plan)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._forward(size, plan, lora_plan)
        return graph

    def eligible(self, batch: BatchMetadata) -> int | None:
        """The padded size ``batch`` replays in, or None if it must run eagerly."""
        n = batch.num_seqs
        if n == 0 or n > self.sizes[-1] or batch.num_tokens != n or batch.logits_indices.shape[0] != n:
            return None
        if batch.images is not None:  # image rows or 3-D rotary positions: not in the captured inputs
            return None
        if batch.block_tables.shape[1] > self.max_blocks:
            return None
        return next(s for s in self.sizes if s >= n)

    def run(self, batch: BatchMetadata) -> torch.Tensor | None:
        size = self.eligible(batch)
        if size is None:
            return None
        adapters = batch.lora_slots_cpu is not None and self.has_lora
        if adapters and self.lora is None:  # the LoRA kernel cannot be captured
            return None
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        if size > n:  # rows a larger batch used before are padding again
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.scratch_slot)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(self.cache.scratch_block)
        if adapters:
            slots = torch.full((size,), -1, dtype=torch.int32)
            slots[:n] = torch.tensor(batch.lora_slots_cpu, dtype=torch.int32)
            self.lora_seq_slots[:size].copy_(slots, non_blocking=True)
            self.lora_token_slots[:size].copy_(slots, non_blocking=True)
        graph, (plan, lora_plan) = (self.lora_graphs if adapters else self.graphs)[size]
        self.replays += 1
        self.lora_replays += adapters
        if graph is None:
            return self._forward(size, plan, lora_plan)[:n]
        graph.replay()
        return self.logits[:n]
