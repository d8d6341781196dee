"""Builds the model from weights and runs one forward per engine step."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .attention import AttentionBackend
from .batch import BatchMetadata
from .cache import CacheManager
from .errors import ModelLoadError
from .model import LlamaForCausalLM, RotaryEmbedding
from .model_spec import ModelSpec
from .quant import Quantizer


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

    @torch.inference_mode()
    def forward(self, batch: BatchMetadata, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab]: float32 (float64 in a float64 pipeline)."""
        plan = self.backend.plan(batch, self.cache)
        return self.model(batch.input_ids, batch.positions, batch.logits_indices,
                          self.backend, self.cache, plan, layers)
