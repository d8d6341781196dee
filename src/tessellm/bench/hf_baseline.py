"""The transformers baselines: the same model folder and the same token ids through
``AutoModelForCausalLM.generate`` as left-padded static batches (``run_hf_baseline``), or through
transformers' own continuous batching, ``model.generate_batch`` (``run_hf_generate_batch``,
transformers >= 5), greedy, every row run to its full length. Shared by ``tessellm bench
--baseline hf``, ``bench/generate_vs_hf.py`` and ``bench/e2e_gpu.py``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tessellm.bench.offline import BenchResult, RequestTiming
from tessellm.bench.workloads import BenchRequest


def load_transformers(folder: str | Path, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu", attn_implementation: str | None = None) -> Any:
    """The Hugging Face folder as a transformers model in ``dtype`` on ``device``, in eval mode.
    ``attn_implementation`` (e.g. "sdpa", "eager", "flash_attention_2") is transformers' choice
    when None; ``run_hf_generate_batch`` does not need it (it takes its own ``attn_impl``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the "Loading weights" bar would clutter --json output on a tty
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).to(device).eval()


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
    outputs: list[list[int]] = []
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
        width = ids.shape[1]
        outputs.extend(out[row, width:width + r.output_len].tolist() for row, r in enumerate(batch))
        peak = max(peak, len(batch))
        bar.update(len(batch))
    bar.close()
    return BenchResult(timings, time.perf_counter() - start, peak_running=peak, outputs=outputs)


@dataclass
class HFGenerateBatchResult(BenchResult):
    """``BenchResult`` of ``run_hf_generate_batch`` plus what its figures depend on."""

    setup_s: float | None = None
    """From the call to ``generate_batch`` to the requests' submission: the manager's KV cache
    allocation and CUDA-graph warm-up, which (like tessellm's engine construction) the timings leave out."""
    attn_implementation: str | None = None
    """The attention implementation the model's forward ran with (seen by a forward pre-hook)."""
    max_new_tokens: int | None = None

    def metrics(self) -> dict[str, Any]:
        import transformers

        return {**super().metrics(), "transformers": transformers.__version__,
                "attn_implementation": self.attn_implementation, "max_new_tokens": self.max_new_tokens,
                "setup_s": None if self.setup_s is None else round(self.setup_s, 4)}


CPU_MAX_BATCH_TOKENS = 512
"""``generate_batch``'s tokens per forward on a CPU unless given: transformers 5.17 would take
8192 and fill an 8192-wide attention mask per batch, which takes seconds there."""


def _cb_config_class() -> Any:
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation import ContinuousBatchingConfig
    return ContinuousBatchingConfig


def _cb_attn_target(attn_impl: str, auto_switch: bool) -> str:
    """The attention implementation to set on the model so that ``generate_batch`` keeps it.

    transformers 5.17 (no ``auto_switch_to_flash``) prefixes a non-paged implementation with
    "paged|", switching first to flash attention when installed unless already "paged|...", so
    "paged|sdpa" is what pins sdpa there. Later versions (``auto_switch_to_flash``, turned off
    by the caller) accept "sdpa", "paged|eager" or a flash one and reject "paged|sdpa"."""
    base = attn_impl.removeprefix("paged|")
    if auto_switch:
        return "paged|eager" if base == "eager" else base
    return f"paged|{base}"


def hf_generate_batch_outputs(model: Any, prompts: list[list[int]], max_new_tokens: int, *, pad_id: int,
                              max_batch_tokens: int | None = None, num_blocks: int | None = None,
                              attn_impl: str | None = None, progress: bool = False,
                              record_timestamps: bool = True) -> tuple[list[Any], dict[str, Any]]:
    """One ``model.generate_batch`` call over ``prompts`` (token id lists), greedy, exactly
    ``max_new_tokens`` new tokens each: its ``GenerationOutput`` s in prompt order and an info
    dict (``call_start``/``call_end`` perf_counter times, ``attn_implementation``).

    EOS never stops a row: ``eos_token_id=None``, which continuous batching turns into -1
    ("disabled"), as tessellm's ``ignore_eos``. On a CPU, ``num_blocks`` None sizes the paged
    KV cache to the prompts (transformers would take a share of all the host's RAM) and
    ``max_batch_tokens`` None is ``CPU_MAX_BATCH_TOKENS``; on a GPU None keeps transformers'
    sizing from free memory. ``attn_impl`` None keeps the
    implementation transformers picks (flash attention when installed, else the model's
    sdpa/eager in paged form); otherwise it is pinned for the call and restored afterwards.
    Raises RuntimeError if a request fails or has any other number of new tokens."""
    from transformers import GenerationConfig

    CBConfig = _cb_config_class()
    names = {f.name for f in fields(CBConfig)}
    device = next(model.parameters()).device
    cb: dict[str, Any] = {}
    if device.type == "cpu":  # transformers sizes both from the host's RAM, to gigabytes here
        if num_blocks is None:
            page = getattr(CBConfig(), "page_size", None) or getattr(CBConfig(), "block_size", None) or 256
            num_blocks = sum(math.ceil((len(p) + max_new_tokens + 1) / page) for p in prompts) + 1
        if max_batch_tokens is None:
            max_batch_tokens = CPU_MAX_BATCH_TOKENS
    if max_batch_tokens is not None:
        cb["max_batch_tokens"] = max_batch_tokens
    if num_blocks is not None:
        cb["num_blocks"] = num_blocks
    original = model.config._attn_implementation
    if attn_impl is not None:
        auto_switch = "auto_switch_to_flash" in names
        if auto_switch:
            cb["auto_switch_to_flash"] = False
        model.set_attn_implementation(_cb_attn_target(attn_impl, auto_switch))
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=None)
    seen: list[str] = []

    def note_attention(module: Any, args: Any) -> None:
        if not seen:
            seen.append(module.config._attn_implementation)

    hook = model.register_forward_pre_hook(note_attention)
    try:
        call_start = time.perf_counter()
        # no inference_mode here: the forwards run on the manager's own thread (under no_grad),
        # which in-place updates cache tensors this thread creates
        results = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config,
                                       continuous_batching_config=CBConfig(**cb),
                                       record_timestamps=record_timestamps, progress_bar=progress)
        call_end = time.perf_counter()
    finally:
        hook.remove()
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)
    outputs = list(results.values())  # generate_batch returns them in input order
    if len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(prompts)} prompts")
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if out.error is not None:
            raise RuntimeError(f"generate_batch failed request {i}: {out.error}")
        if list(out.prompt_ids) != list(prompt):
            raise RuntimeError(f"generate_batch result {i} is for another prompt (results out of order)")
        if len(out.generated_tokens) != max_new_tokens:
            raise RuntimeError(f"generate_batch generated {len(out.generated_tokens)} tokens for request {i}, "
                               f"expected {max_new_tokens}")
    return outputs, {"call_start": call_start, "call_end": call_end,
                     "attn_implementation": seen[0] if seen else None}


def run_hf_generate_batch(model: Any, requests: list[BenchRequest], *, pad_id: int,
                          max_batch_tokens: int | None = None, attn_impl: str | None = None,
                          num_blocks: int | None = None, progress: bool = False,
                          warmup: bool = True) -> BenchResult:
    """All requests submitted at t=0 to transformers' continuous batching, ``model.generate_batch``.

    One call, so one ``max_new_tokens``: every request generates the largest ``output_len`` and
    counts only its own first ``output_len`` tokens (with equal lengths, as in bench/e2e_gpu.py,
    nothing is wasted; otherwise the surplus is counted in the elapsed time, as static batching's
    is in ``run_hf_baseline``). t=0 is when the requests enter the running manager (their
    ``created_time``): the manager's set-up before it (KV cache allocation, CUDA-graph warm-up)
    is reported as ``setup_s`` and left out, as tessellm's engine construction is. TTFT, TPOT
    and e2e come from each request's per-token timestamps (``record_timestamps=True``, host
    times when the token reached the CPU); e2e ends at its own last counted token. The elapsed
    time ends when the last request finishes (not counting the manager's tear-down)."""
    if not requests:
        raise ValueError("run_hf_generate_batch needs at least one request")
    if warmup:  # first calls pay for lazy set-up (allocator, kernels), which is not throughput
        hf_generate_batch_outputs(model, [[pad_id] * 4, [pad_id] * 2], 2, pad_id=pad_id,
                                  max_batch_tokens=max_batch_tokens, attn_impl=attn_impl)
    new = max(r.output_len for r in requests)
    outputs, info = hf_generate_batch_outputs(model, [r.prompt_token_ids for r in requests], new, pad_id=pad_id,
                                              max_batch_tokens=max_batch_tokens, num_blocks=num_blocks,
                                              attn_impl=attn_impl, progress=progress)
    start = min(out.created_time for out in outputs)
    timings: list[RequestTiming] = []
    for r, out in zip(requests, outputs):
        n, stamps = r.output_len, out.timestamps
        if stamps is None or len(stamps) < n:
            raise RuntimeError(f"generate_batch recorded {0 if stamps is None else len(stamps)} token timestamps, "
                               f"expected {n}")
        tpot = (stamps[n - 1] - stamps[0]) / (n - 1) if n > 1 else None
        timings.append(RequestTiming(len(r.prompt_token_ids), n, stamps[0] - start, tpot, stamps[n - 1] - start))
    ends = [out.lifespan[1] for out in outputs]
    finished = max(ends) if min(ends) >= start else info["call_end"]  # lifespan unset: the call's return
    return HFGenerateBatchResult(timings, finished - start, outputs=[list(out.generated_tokens[:r.output_len])
                                                                   for r, out in zip(requests, outputs)],
                                 setup_s=start - info["call_start"], attn_implementation=info["attn_implementation"],
                                 max_new_tokens=new)
