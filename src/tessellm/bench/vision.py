"""``tessellm bench --workload vision``: a vision-language pipeline's throughput on prompts with
images against transformers' ``generate`` on the same requests, in interleaved rounds.

Each request holds ``images_per_request`` random images (random pixels, each side drawn
between ``image_min`` and ``image_max`` pixels) before a text of random ordinary tokens, and
asks for ``max_tokens`` greedy tokens, every one generated (EOS ignored), so both sides do the
same work. Both read the prompt through the checkpoint's own transformers processor. Each round
runs (after one untimed run of each side on two requests) every request through tessellm (``LLM.generate``: all submitted at once, continuous
batching) and through transformers (``AutoModelForImageTextToText.generate`` in left-padded
batches of ``batch_size``), alternating which goes first. The report gives each side's
requests/s and output tokens/s (median over rounds), the ratio per round and its median, and
how many requests' greedy tokens agree."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
from pydantic import Field

from tessellm.bench.workloads import WorkloadParams, plain_token_ids
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.sequence import SamplingParams


class VisionParams(WorkloadParams):
    """Prompts with random images and a short random text."""

    images_per_request: int = Field(1, ge=1, le=16)
    image_min: int = Field(56, ge=8)
    """Smallest image side in pixels."""
    image_max: int = Field(112, ge=8)
    """Largest image side in pixels."""
    text_len: int = Field(8, ge=1)
    """Text tokens after the images."""
    max_tokens: int = Field(16, ge=1)
    """Greedy tokens generated per request (all of them: EOS is ignored)."""
    batch_size: int = Field(8, ge=1)
    """transformers' batch size."""
    rounds: int = Field(3, ge=1, le=50)
    """Runs of each side, interleaved (A B, B A, ...)."""


def vision_requests(params: VisionParams, llm: Any, seed: int, num_requests: int) -> list[tuple[str, list[Any]]]:
    """``num_requests`` (prompt text with one image marker per image, images)."""
    from PIL import Image

    if params.image_max < params.image_min:
        raise ConfigError(f"workload vision: image_max {params.image_max} is below image_min {params.image_min}")
    processor = llm.pipeline.image_processor
    if processor is None:
        raise ConfigError(f"--workload vision needs a model that takes images; {llm.pipeline.spec.model_type!r} "
                          f"is a text-only model")
    rng = np.random.default_rng(seed)
    ids = plain_token_ids(llm.tokenizer, llm.pipeline.spec.vocab_size)
    out = []
    for _ in range(num_requests):
        images = [Image.fromarray(rng.integers(0, 256, (*rng.integers(params.image_min, params.image_max + 1, 2), 3),
                                               dtype=np.uint8)) for _ in range(params.images_per_request)]
        text = llm.tokenizer.decode(rng.choice(ids, size=params.text_len).tolist(), skip_special_tokens=True)
        out.append((processor.image_marker * len(images) + text, images))
    return out


def run_vision_bench(llm: Any, requests: list[tuple[str, list[Any]]], params: VisionParams,
                     progress: bool = False) -> dict[str, Any]:
    """Interleaved rounds of tessellm and transformers on ``requests``; the figures."""
    pipeline = llm.pipeline
    hf_processor = pipeline.image_processor.processor
    model = _reference(pipeline)
    sampling = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True)
    prompts, images = [text for text, _ in requests], [pics for _, pics in requests]

    def ours() -> list[list[int]]:
        return [list(o.token_ids) for o in llm.generate(prompts, sampling, images=images, progress=progress)]

    def theirs() -> list[list[int]]:
        return _hf_generate(model, hf_processor, requests, params, pipeline.resolved.device)

    warmup = requests[:2]  # first calls (allocations, lazy imports) are not timed
    llm.generate([t for t, _ in warmup], sampling, images=[p for _, p in warmup], progress=False)
    _hf_generate(model, hf_processor, warmup, params, pipeline.resolved.device)
    times: dict[str, list[float]] = {"tessellm": [], "transformers": []}
    outputs: dict[str, list[list[int]]] = {}
    sides = [("tessellm", ours), ("transformers", theirs)]
    for r in range(params.rounds):
        for name, run in sides if r % 2 == 0 else sides[::-1]:
            start = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - start)
    ratios = [hf / ours_s for ours_s, hf in zip(times["tessellm"], times["transformers"])]
    prompt_tokens = sum(len(pipeline.image_processor.process(t, p, add_special_tokens=True).token_ids)
                        for t, p in requests)
    generated = len(requests) * params.max_tokens
    equal = sum(a == b for a, b in zip(outputs["tessellm"], outputs["transformers"]))
    return {"num_requests": len(requests), "num_images": sum(len(p) for p in images), "prompt_tokens": prompt_tokens,
            "output_tokens": generated, "rounds": params.rounds, "seconds": times,
            **{f"{name}_requests_per_s": len(requests) / statistics.median(t) for name, t in times.items()},
            **{f"{name}_output_tokens_per_s": generated / statistics.median(t) for name, t in times.items()},
            "ratio_per_round": ratios, "ratio_median": statistics.median(ratios),
            "agreement": {"requests_with_equal_greedy_tokens": equal, "of": len(requests)}}


def _hf_generate(model: Any, processor: Any, requests: list[tuple[str, list[Any]]], params: VisionParams,
                 device: Any) -> list[list[int]]:
    """transformers' greedy tokens for each request, in left-padded batches."""
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[list[int]] = []
    for start in range(0, len(requests), params.batch_size):
        batch = requests[start:start + params.batch_size]
        rgb = [[image.convert("RGB") for image in pics] for _, pics in batch]
        inputs = processor(text=[text for text, _ in batch], images=rgb, return_tensors="pt", padding=True,
                           add_special_tokens=True).to(device)
        with torch.inference_mode():
            tokens = model.generate(**inputs, do_sample=False, max_new_tokens=params.max_tokens,
                                    min_new_tokens=params.max_tokens, pad_token_id=pad, eos_token_id=None)
        out += tokens[:, inputs["input_ids"].shape[1]:].tolist()
    return out


def _reference(pipeline: Any) -> Any:
    """transformers' model of the same folder, on the same device and dtype."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForImageTextToText.from_pretrained(pipeline.model_dir, dtype=pipeline.resolved.dtype)
    return model.to(pipeline.resolved.device).eval()


def format_vision_report(report: dict[str, Any]) -> str:
    """The text report of ``run_vision_bench``'s figures (and what was run where)."""
    agree = report["agreement"]
    lines = [f"tessellm bench: workload vision ({report['num_requests']} requests, {report['num_images']} images, "
             f"{report['prompt_tokens']} prompt tokens, {report['output_tokens']} output tokens, seed "
             f"{report['seed']}), {report['rounds']} interleaved rounds on {report['device']}",
             f"{'':28}{'tessellm':>12}{'transformers':>16}",
             f"{'requests/s (median)':28}{report['tessellm_requests_per_s']:>12.2f}"
             f"{report['transformers_requests_per_s']:>16.2f}",
             f"{'output tokens/s (median)':28}{report['tessellm_output_tokens_per_s']:>12.1f}"
             f"{report['transformers_output_tokens_per_s']:>16.1f}",
             f"speedup tessellm / transformers: {report['ratio_median']:.3g} (rounds "
             f"{', '.join(f'{r:.3g}' for r in report['ratio_per_round'])})",
             f"greedy tokens equal on {agree['requests_with_equal_greedy_tokens']} of {agree['of']} requests"]
    return "\n".join(lines)
