"""Runs the model once per engine step: plans attention for the batch, then every layer, or
replays a captured CUDA graph for a decode batch."""

from __future__ import annotations

from typing import Any, Sequence as Layers

import torch
from torch import nn

from tessellm.core.interfaces.attention import AttentionBackend
from tessellm.core.interfaces.batch import BatchMetadata, LayerPlans
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.model.compiled import CompiledDecode
from tessellm.core.model.cuda_graphs import DecodeGraphs
from tessellm.core.model.lora import LoraState
from tessellm.core.model.spec import ModelSpec


class ModelRunner:
    """Runs the model over a packed batch: plans attention once, then every layer.

    ``forward(batch, layers)`` returns the logits of ``batch.logits_indices``; ``layers`` runs
    a subset of the decoder layers (self-drafting). After ``capture_graphs`` a qualifying
    decode batch replays a captured graph instead (``DecodeGraphs``); after ``compile_decode``
    (CPU) a one-stream decode step runs the compiled forward where it was measured faster
    (``CompiledDecode``).
    """

    def __init__(self, model: nn.Module, spec: ModelSpec, backend: AttentionBackend, cache: CacheManager,
                 device: torch.device):
        self.model = model
        self.device = device
        self.spec = spec
        self.backend = backend
        self.cache = cache
        self.graphs: DecodeGraphs | None = None
        self._layer_group: list[int] | None = None
        self.lora: LoraState | None = None
        """Set where the model's projections are wrapped for LoRA: the wrapped layers' shared
        state, whose plan ``forward`` sets for each batch with adapters."""
        self.stage = getattr(model, "stage", None)
        """The pipeline stage the model runs (core/parallel/stages.py), or None."""
        self.microbatches = 1
        """Into how many micro-batches the engine cuts a step at most (above 1 only for a
        stage), each of at least ``microbatch_min_tokens`` tokens."""
        self.microbatch_min_tokens = 1
        self.compiled: CompiledDecode | None = None
        """Set by ``compile_decode``: the compiled one-stream decode forward and its choice."""

    def _group_of_layer(self) -> list[int]:
        """Each layer's group in the cache's ``layer_groups`` (fixed: worked out once)."""
        if self._layer_group is None:
            groups = self.cache.layer_groups
            self._layer_group = [0] * self.spec.num_layers
            for index, layers in enumerate(groups):
                for layer in layers:
                    self._layer_group[layer] = index
        return self._layer_group

    def graphs_unsupported(self) -> str | None:
        """Why decode steps cannot be replayed from CUDA graphs here (None: they can)."""
        if self.device.type != "cuda":
            return f"the device is {self.device.type}, not cuda"
        if not self.backend.supports_cuda_graphs:
            return f"attention backend {self.backend.name!r} does not support CUDA graphs"
        why = getattr(self.model, "cuda_graphs_unsupported", lambda: None)()
        if why:
            return why
        if len(getattr(self.cache, "layer_groups", ())) > 1:
            return f"cache {self.cache.name!r} keeps a block table per layer group (out-of-window release)"
        if self.cache.scratch_block is None:
            return f"cache {self.cache.name!r} has no scratch block for padded rows"
        return None

    def compiles_kernels(self) -> bool:
        """Whether kernels are compiled (and autotuned) on first use here, so a start-up
        warm-up pays: on CUDA; a CPU runs plain torch, or Triton interpreted."""
        return self.device.type == "cuda"

    def capture_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """Capture decode forwards for batches up to ``max_batch`` (``capture=False``: the same
        padded static-buffer path, run eagerly, for testing without a GPU)."""
        self.graphs = DecodeGraphs(self.model, self.backend, self.cache, self.device, max_batch=max_batch,
                                   max_model_len=max_model_len, capture=capture, lora=self.lora)

    def compile_decode(self) -> None:
        """Run one-stream decode steps through the model compiled as one graph where that is
        measured faster than eager at the first such step (``CompiledDecode``); CPU only."""
        if self.device.type != "cpu" or self.stage is not None:
            raise ValueError(f"compiling decode steps is for a single-process CPU pipeline (device {self.device})")
        self.compiled = CompiledDecode(self.model)

    @torch.inference_mode()
    def forward(self, batch: BatchMetadata, layers: Layers[int] | None = None, *,
                native_logits: bool = False, parts: list[BatchMetadata] | None = None,
                hidden_states: bool = False, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab]: float32 (float64 in a float64 pipeline),
        or with ``native_logits`` possibly in the model's dtype (bfloat16 on a GPU), which
        spares a float32 copy of a batch x vocabulary tensor where only their order matters
        (``Decoder.device_tokens_any_dtype``).

        On a pipeline stage ``parts``, the same sequences cut into micro-batches (None: one),
        flow through the stages in turn and every rank returns the last stage's logits of the
        whole batch, float32 (float64 in a float64 pipeline).

        ``hidden_states`` (a pooling pipeline): the rows' final hidden states instead of
        logits, run eagerly; ``token_type_ids`` [T] go to a model that reads them (an
        encoder's segment ids: ``uses_token_types``)."""
        if hidden_states:
            extra = {"token_type_ids": token_type_ids} if getattr(self.model, "uses_token_types", False) else {}
            return self._run_model(batch, layers, False, hidden_states=True, **extra)
        if self.stage is not None:
            return self._forward_stage(batch, parts or [batch], layers)
        if self.graphs is not None and layers is None:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits if native_logits or logits.dtype in (torch.float32, torch.float64) else logits.float()
        return self._run_model(batch, layers, native_logits)

    def _run_model(self, batch: BatchMetadata, layers: Layers[int] | None,
                   native_logits: bool, **extra: Any) -> torch.Tensor | None:
        """The model over ``batch``: attention planned, LoRA's plan set where it has adapters;
        ``extra``: keyword arguments for the module (a pooling pipeline's)."""
        plan = self.backend.plan(batch, self.cache)
        if batch.groups:  # a plan per block table (a cache that frees out-of-window blocks)
            plan = LayerPlans([plan, *(self.backend.plan(view, self.cache) for view in batch.groups)],
                              self._group_of_layer())
        lora = self.lora
        if batch.images is not None:  # only a step with images passes them: a text model's forward takes none
            extra = {**extra, "images": batch.images}
        if lora is None or batch.lora_slots_cpu is None:
            if self.compiled is not None and CompiledDecode.applies(batch, layers):
                return self.compiled.run(lambda forward: forward(
                    batch.input_ids, batch.positions, batch.logits_indices, self.backend, self.cache, plan,
                    native_logits=native_logits))
            return self.model(batch.input_ids, batch.positions, batch.logits_indices,
                              self.backend, self.cache, plan, layers, native_logits=native_logits, **extra)
        lora.plan = lora.plan_for(batch)
        try:
            return self.model(batch.input_ids, batch.positions, batch.logits_indices,
                              self.backend, self.cache, plan, layers, native_logits=native_logits, **extra)
        finally:
            lora.plan = None

    def _forward_stage(self, batch: BatchMetadata, parts: list[BatchMetadata],
                       layers: Layers[int] | None) -> torch.Tensor:
        """Run this stage's layers over each micro-batch in turn (receiving from the stage
        before, sending to the next as each is done), then share the last stage's logits,
        put back in ``batch``'s row order: every part's sample rows, then every part's
        prompt-logprob rows."""
        stage = self.stage
        outputs = [self._run_model(part, layers, False) for part in parts]
        logits = None
        if stage.last:
            if len(parts) == 1:
                logits = outputs[0]
            else:
                cuts = [part.num_sample_rows for part in parts]
                logits = torch.cat([out[:cut] for out, cut in zip(outputs, cuts)] +
                                   [out[cut:] for out, cut in zip(outputs, cuts)])
        rows = int(batch.logits_indices.shape[0])
        shared = stage.share_logits(logits, rows, self.spec.vocab_size)
        stage.finish()
        return shared
