"""Start-up warm-up: the step shapes the engine will meet, run on dummy batches before the
first request, so every kernel variant is compiled (and every library heuristic chosen) then,
not inside a request's step, where each new variant stalls the step for its compile
(``EngineStats.kernel_builds`` counts those). vLLM's engine does the same with its dummy runs.

The shapes are a full step of prefill and a one-token decode, which launch the model's own
fused kernels, plus what the attention backend names (``AttentionBackend.warm_up_shapes``).
Every dummy token reads and writes only the cache's scratch block, which no sequence holds,
so no block is taken and no cached KV changes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tessellm.core.engine.batch_builder import build_batch
from tessellm.core.interfaces.batch import BatchMetadata, ScheduledSeq
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.model.runner import ModelRunner


@torch.inference_mode()
def warm_up(runner: ModelRunner, max_step_tokens: int, max_model_len: int, hidden_states: bool = False) -> int:
    """Run the warm-up shapes through ``runner``; return how many dummy forwards ran (0: the
    cache has no scratch block, so nothing could run without touching real blocks).
    ``hidden_states``: a pooling pipeline's forwards (no LM head)."""
    scratch = runner.cache.scratch_block
    if scratch is None:
        return 0
    chunk = max(1, min(max_step_tokens, max_model_len))
    shapes = [[(chunk, chunk)] * max(1, max_step_tokens // chunk), [(1, 1)]]
    shapes += runner.backend.warm_up_shapes(max_step_tokens, max_model_len)
    # with LoRA, the same shapes again with every row under an adapter slot: the LoRA kernel's
    # variants (a decode's and a prefill's) compile too
    slots = [-1] if runner.lora is None else [-1, 0]
    for slot in slots:
        for shape in shapes:
            runner.forward(scratch_batch(shape, scratch, runner.cache.layout.block_size, runner.device, slot),
                           hidden_states=hidden_states)
    return len(shapes) * len(slots)


class _ScratchTables:
    """A stand-in cache for ``build_batch``: every sequence's blocks are the scratch block."""

    def __init__(self, scratch: int, block_size: int):
        self.scratch = scratch
        self.layout = SimpleNamespace(block_size=block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        return [self.scratch] * -(-seq.num_tokens // self.layout.block_size)


def scratch_batch(shape: list[tuple[int, int]], scratch: int, block_size: int, device: torch.device,
                  lora_slot: int = -1) -> BatchMetadata:
    """A batch of dummy sequences, (query tokens, context length after the step) each, laid out
    by ``build_batch`` exactly as real ones are, all of their KV in the scratch block (each
    under LoRA slot ``lora_slot``; -1: none). A one-token query after context is a decode:
    its sequence is past its prompt (a backend may attend decodes otherwise than prompts)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    scheduled = []
    for query, context in shape:
        seq = Sequence("warm-up", [0] * context, params)
        seq.num_computed_tokens = context - query
        if query == 1 < context:
            seq.num_prompt_tokens = context - 1
        seq.lora_slot = lora_slot
        scheduled.append(ScheduledSeq(seq, query))
    return build_batch(scheduled, _ScratchTables(scratch, block_size), device)
