"""The transformers baseline: the same model folder and the same token ids through
``AutoModelForCausalLM.generate`` as left-padded static batches, greedy, every row run to its
full length. Shared by ``tessellm bench --baseline hf`` and ``bench/generate_vs_hf.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .bench import BenchResult, RequestTiming
from .bench_workloads import BenchRequest


def load_transformers(folder: str | Path, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> Any:
    """The Hugging Face folder as a transformers model in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the "Loading weights" bar would clutter --json output on a tty
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def greedy_kwargs(max_new_tokens: int, pad_id: int) -> dict[str, Any]:
    """``generate`` arguments for greedy decoding of exactly ``max_new_tokens`` tokens per row."""
    # eos_token_id=None is what matches tessellm's ignore_eos: with an EOS id, min_new_tokens
    # forbids EOS (masks its logit) until the last step, so greedy would pick the runner-up
    # token where tessellm emits EOS and carries on. Without it, nothing stops generation early
    # and min_new_tokens becomes a no-op, kept to say plainly that every row runs to the end.
    return dict(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                pad_token_id=pad_id, eos_token_id=None)


def left_pad(batch: list[list[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every prompt's last token in the last column, where a decoder-only
    model's next token comes from; the mask hides the padding (and sets position ids)."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    return input_ids.to(device), mask.to(device)


def _token_clock():
    """A logits processor that records when each step's logits exist (call k: the k-th new
    token of every row), and the list it appends to."""
    from transformers import LogitsProcessor

    class TokenClock(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if scores.is_cuda:  # kernels run ahead of Python: wait for the logits themselves
                torch.cuda.synchronize(scores.device)
            self.times.append(time.perf_counter())
            return scores

    return TokenClock()


def run_hf_baseline(model: Any, requests: list[BenchRequest], *, pad_id: int, batch_size: int = 16,
                    progress: bool = False, warmup: bool = True) -> BenchResult:
    """Run the requests in arrival order as static batches of ``batch_size``, all arrived at t=0.

    Each batch generates its longest output length for every row; a request counts only its
    own output tokens (the rest is what static batching wastes). TTFT and TPOT come from its
    own tokens' times; e2e ends when its batch returns, as a non-streaming caller sees it."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    if warmup:  # first calls pay for lazy set-up (allocator, kernels), which is not throughput
        with torch.inference_mode():
            ids, mask = left_pad([[pad_id] * 4, [pad_id] * 2], pad_id, device)
            model.generate(ids, attention_mask=mask, **greedy_kwargs(2, pad_id))
    timings: list[RequestTiming] = []
    peak = 0
    bar = tqdm(total=len(requests), desc="transformers", unit="req", disable=not progress, leave=False)
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        new = max(r.output_len for r in batch)
        clock = _token_clock()
        ids, mask = left_pad([r.prompt_token_ids for r in batch], pad_id, device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([clock]),
                                 **greedy_kwargs(new, pad_id))
        end = time.perf_counter()
        if out.shape[1] - ids.shape[1] != new or len(clock.times) != new:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens per row, expected {new}")
        for r in batch:
            n = r.output_len
            ttft = clock.times[0] - start
            tpot = (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None
            timings.append(RequestTiming(len(r.prompt_token_ids), n, ttft, tpot, end - start))
        peak = max(peak, len(batch))
        bar.update(len(batch))
    bar.close()
    return BenchResult(timings, time.perf_counter() - start, peak_running=peak)
