"""Teacher-forced scoring: the logits at every position of a token sequence, run as one
prefill of its own through a runner and its cache (``Engine.score``, and a quantizer's
calibration before the engine exists)."""

from __future__ import annotations

import torch

from tessellm.core.engine.batch_builder import build_batch
from tessellm.core.errors import InvalidRequestError, RequestRejectedError
from tessellm.core.interfaces.batch import ScheduledSeq
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.model.runner import ModelRunner


@torch.inference_mode()
def score_tokens(runner: ModelRunner, cache: CacheManager, token_ids: list[int], max_model_len: int) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32; float64 in a float64 pipeline) at every
    position of ``token_ids``; the cache room it takes is given back before it returns."""
    if not token_ids:
        raise InvalidRequestError("nothing to score: token_ids is empty")
    if len(token_ids) > max_model_len:
        raise InvalidRequestError(f"{len(token_ids)} tokens exceed the context window (max_model_len {max_model_len})")
    seq = Sequence("score", token_ids, SamplingParams(max_tokens=1))
    if not cache.can_reserve(seq, len(token_ids)):
        raise RequestRejectedError(f"no cache room to score {len(token_ids)} tokens now")
    cache.reserve(seq, len(token_ids))
    try:
        return runner.forward(build_batch([ScheduledSeq(seq, len(token_ids))], cache, runner.device, all_logits=True))
    finally:
        cache.free(seq)
