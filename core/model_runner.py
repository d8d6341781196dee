"""Builds the model from weights and runs one forward per engine step."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Sequence as Layers

import torch
from torch import nn

from .attention import AttentionBackend
from .batch import BatchMetadata, ScheduledSeq, build_batch
from .cache import CacheManager
from .cuda_graphs import DecodeGraphs
from .errors import ModelLoadError
from .model import LlamaForCausalLM, RotaryEmbedding
from .model_spec import ModelSpec
from .quant import Quantizer
from .sequence import SamplingParams, Sequence


def build_model(spec: ModelSpec, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                quantizer: Quantizer | None = None) -> nn.Module:
    """Instantiate the model without allocating, then adopt the checkpoint's tensors."""
    with torch.device("meta"):
        model = LlamaForCausalLM(spec)
    expected = set(model.state_dict())
    if spec.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weights the {spec.model_type} model needs, "
                             f"e.g. {', '.join(missing[:3])}")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if k in expected}
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"checkpoint does not fit the model config: {str(exc).splitlines()[-1].strip()}") from exc
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(spec).to(device)  # buffers were on the meta device
    model.eval().requires_grad_(False)
    # on CUDA the norms, RoPE and SwiGLU run as fused Triton kernels and the q/k/v and gate/up
    # projections as one GEMM each (float64 stays the exact reference)
    model.fused = device.type == "cuda" and dtype != torch.float64 and importlib.util.find_spec("triton") is not None
    if model.fused:
        model.fuse_projections()
    return quantizer.apply(model) if quantizer is not None else model


class ModelRunner:
    """Runs the model over a packed batch: plans attention once, then every layer."""

    def __init__(self, model: nn.Module, spec: ModelSpec, backend: AttentionBackend, cache: CacheManager,
                 device: torch.device):
        self.model = model
        self.device = device
        self.spec = spec
        self.backend = backend
        self.cache = cache
        self.graphs: DecodeGraphs | None = None

    def graphs_unsupported(self) -> str | None:
        """Why decode steps cannot be replayed from CUDA graphs here (None: they can)."""
        if self.device.type != "cuda":
            return f"the device is {self.device.type}, not cuda"
        if not self.backend.supports_cuda_graphs:
            return f"attention backend {self.backend.name!r} does not support CUDA graphs"
        if self.cache.scratch_block is None:
            return f"cache {self.cache.name!r} has no scratch block for padded rows"
        return None

    def compiles_kernels(self) -> bool:
        """Whether kernels are compiled (and autotuned) on first use here, so a start-up
        warm-up pays: on CUDA; a CPU runs plain torch, or Triton interpreted."""
        return self.device.type == "cuda"

    @torch.inference_mode()
    def warm_up(self, max_step_tokens: int, max_model_len: int) -> int:
        """Run the step shapes the engine will meet on dummy batches, so every kernel variant
        is compiled (and every library heuristic chosen) now, not inside the first requests'
        steps: a full step of prefill, a prefill chunk beside a long-context decode, and a
        short-context decode. On the flash backend that is the prefill kernel, the split-K
        decode with and without its merge, and the fused norm/RoPE/SwiGLU kernels; each new
        variant mid-run would stall a step for a compile (``EngineStats.kernel_builds``). vLLM's
        engine does the same with its dummy runs at start-up.

        Every dummy token reads and writes only the cache's scratch block, which no sequence
        holds, so no block is taken and no cached KV changes. Returns the number of dummy
        forwards run (0: the cache has no scratch block, nothing was run)."""
        scratch = self.cache.scratch_block
        if scratch is None:
            return 0
        chunk = max(1, min(max_step_tokens, max_model_len))
        prefill = [(chunk, chunk)] * max(1, max_step_tokens // chunk)
        shapes = [prefill,
                  [(min(2, max_model_len), min(2, max_model_len)), (1, max_model_len)],  # chunk + split decode
                  [(1, 1)]]  # a decode over a short context: one split, no merge
        for shape in shapes:
            self.forward(_scratch_batch(shape, scratch, self.cache.layout.block_size, self.device))
        return len(shapes)

    def capture_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """Capture decode forwards for batches up to ``max_batch`` (``capture=False``: the same
        padded static-buffer path, run eagerly, for testing without a GPU)."""
        self.graphs = DecodeGraphs(self.model, self.backend, self.cache, self.device, max_batch=max_batch,
                                   max_model_len=max_model_len, capture=capture)

    @torch.inference_mode()
    def forward(self, batch: BatchMetadata, layers: Layers[int] | None = None, *,
                native_logits: bool = False) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab]: float32 (float64 in a float64 pipeline),
        or with ``native_logits`` possibly in the model's dtype (bfloat16 on a GPU), which
        spares a float32 copy of a batch x vocabulary tensor where only their order matters
        (``Decoder.device_tokens_any_dtype``)."""
        if self.graphs is not None and layers is None:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits if native_logits or logits.dtype in (torch.float32, torch.float64) else logits.float()
        plan = self.backend.plan(batch, self.cache)
        return self.model(batch.input_ids, batch.positions, batch.logits_indices,
                          self.backend, self.cache, plan, layers, native_logits=native_logits)


class _ScratchTables:
    """A stand-in cache for ``build_batch``: every sequence's blocks are the scratch block."""

    def __init__(self, scratch: int, block_size: int):
        self.scratch = scratch
        self.layout = SimpleNamespace(block_size=block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        return [self.scratch] * -(-seq.num_tokens // self.layout.block_size)


def _scratch_batch(shape: list[tuple[int, int]], scratch: int, block_size: int, device: torch.device) -> BatchMetadata:
    """A batch of dummy sequences, (query tokens, context length after the step) each, laid out
    by ``build_batch`` exactly as real ones are, all of their KV in the scratch block."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    scheduled = []
    for query, context in shape:
        seq = Sequence("warm-up", [0] * context, params)
        seq.num_computed_tokens = context - query
        scheduled.append(ScheduledSeq(seq, query))
    return build_batch(scheduled, _ScratchTables(scratch, block_size), device)
