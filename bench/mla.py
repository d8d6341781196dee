"""Multi-head latent attention (DeepSeek-V2/V3, attention `mla`): one layer's decode attention
in its two forms, and a whole DeepSeek-V2-Lite-shaped model end to end.

What it measures
----------------
``--part attention`` (CPU or GPU): one decode step of one layer at DeepSeek-V2-Lite's
attention shape (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128; the latent cache holds
576 values per token), one query token per sequence, every sequence of one context length,
block size 64, through ``MlaAttention.forward_latent`` (store the step's latents, attend):

- ``naive_ms``: ``form: naive``: up-project the whole context to per-head keys and values;
- ``absorbed_ms``: ``form: absorbed``, ``decode_kernel: torch``: fold ``w_uk`` into the
  query and attend over the latents themselves (multi-query attention in torch SDPA);
- ``speedup`` = naive_ms / absorbed_ms;
- on CUDA also ``triton_ms`` (``form: absorbed``, ``decode_kernel: triton``: the split-K
  kernel of decode_kernel.py over the paged cache, through the backend) and ``kernel_ms``
  (``mla_decode`` alone on the absorbed query), with the kernel's achieved bandwidth
  ``kernel_gbps`` = latent bytes read (batch * context * 576 * itemsize) / kernel_ms, and
  ``of_copy_bw``, that over the device's copy bandwidth measured in the same run (a 1 GiB
  device-to-device copy, bytes read + written / time).

Every form's output is compared with the naive one (``*_max_abs_diff``, ``agree``), and on
small points (batch * context <= 4096) the naive one with a float64 reference, so a wrong
fast path cannot report a speed: a disagreement is flagged in the table and the exit status
is 1. Times are medians over ``--reps`` samples after a warm-up (on CUDA each sample averages
``--inner`` back-to-back calls). float32 on a CPU, bf16 on CUDA; random data, seed 0.

``--part model`` (GPU): a random-weight model with DeepSeek-V2-Lite's shapes (15.7B parameters
at 27 layers; ``--layers N`` keeps the first N), built here with transformers directly on the
GPU in bf16 (``torch.manual_seed(0)``), saved as a Hugging Face folder with a word-level
tokenizer, freed, then loaded by ``tessellm.LLM`` with attention `mla` (``--form``, default
auto: absorbed decode on the Triton kernel), the paged cache without prefix caching and the
continuous scheduler. Per batch size (``--model-batches``, default 1 and 64): that many
requests of ``--prompt-len`` random prompt tokens, each generating ``--new-tokens`` greedily
(EOS ignored), all submitted at once; reported: output tokens/s over the whole run,
time per output token and the decode rate it implies (batch / tpot).

``--sweep`` (with ``--part attention``): at each point, ``mla_decode`` alone over launch
shapes (keys a tile, warps, stages) and split counts (the automatic one, one full wave of
programs, and the count the kernel used before, two programs an SM rounded up), each with
its bandwidth and share of the copy bandwidth: ``sweep`` in the report, the best per point
in ``sweep_best``.

``--smoke``: tiny shapes on the CPU in seconds (contexts 64, batches 1 and 2; a 2-layer tiny
DeepSeek-V2 for ``--part model``), to check the script runs.

How to run
----------
    python bench/mla.py --part attention --json mla_cpu.json                 # CPU: contexts 4096, batches 1,4,16
    python bench/mla.py --part attention --json mla_gpu.json                 # GPU: batches 16,32,64 x contexts 4k-16k
    python bench/mla.py --part model --json mla_model.json                   # GPU: whole model, batch 1 and 64
    python bench/mla.py --part model --layers 4                              # GPU: a 4-layer cut, faster to build
    python bench/mla.py --part attention --batches 32,64 --sweep --json s.json   # GPU: launch shapes, splits
    python bench/mla.py --part attention --smoke                             # CPU: tiny, code path only
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from tessellm.core.interfaces.attention import LatentProjection
from tessellm.core.interfaces.kv import LatentKVStorage
from tessellm.core.model.spec import ModelSpec
from tessellm.plugins.attention.mla.backend import MlaAttention, MlaOptions
from tessellm.testing import attention as ref

V2_LITE = dict(
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
    first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, vocab_size=102400, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
    bos_token_id=1, eos_token_id=2, pad_token_id=0)
"""DeepSeek-V2-Lite's config.json, except the special token ids (1, 2, 0: those of the
word-level tokenizer built here, tessellm.testing.models.save_word_tokenizer)."""

SMOKE_ATTENTION = dict(num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                       v_head_dim=24)
"""The attention shape ``--smoke`` times (tessellm.testing.models.TINY_DEEPSEEK[2]'s)."""

COPY_BYTES = 2 ** 30
"""Size of the device-to-device copy that measures the copy bandwidth (its source; the
destination is as large)."""

REFERENCE_TOKENS = 4096
"""Points with at most this many context tokens in all are checked against the float64
reference too."""


# ---------------------------------------------------------------- shared


def model_spec(shapes: dict) -> ModelSpec:
    """tessellm's ModelSpec of a DeepSeek-V2 config with ``shapes``."""
    from transformers import DeepseekV2Config

    return ModelSpec.from_hf_config(DeepseekV2Config(**shapes))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, reps: int, inner: int, warmup: int) -> float:
    """Median over ``reps`` samples of ``fn``'s time in milliseconds, each sample ``inner``
    back-to-back calls averaged, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples) * 1e3


def copy_bandwidth(device: torch.device, reps: int = 10) -> float:
    """The device's copy bandwidth in bytes/s: a ``COPY_BYTES`` tensor copied to another,
    bytes read + written over the median time."""
    n = COPY_BYTES // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, reps, inner=5, warmup=2)
    del src, dst
    return 2 * COPY_BYTES / (ms / 1e3)


def describe(device: torch.device) -> str:
    from tessellm.bench.offline import describe_device

    return describe_device(device)


def command_line(argv: list[str] | None) -> str:
    """The command as typed (``main``'s arguments as if typed when called from Python)."""
    if argv is None:
        return shlex.join(["python", *sys.argv])
    return shlex.join(["python", "bench/mla.py", *argv])


# ---------------------------------------------------------------- --part attention


@dataclasses.dataclass
class DecodeStep:
    """One layer's decode step on ``device``: queries, new latents, up-projection, batch, and
    a latent cache holding every sequence's earlier context."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    latent: torch.Tensor
    up: LatentProjection
    batch: object
    storage: LatentKVStorage
    case: ref.LatentCase  # on the CPU, for the reference check


def decode_step(spec: ModelSpec, batch: int, context: int, block_size: int, dtype: torch.dtype,
                device: torch.device, seed: int) -> DecodeStep:
    """``batch`` sequences of ``context`` tokens, each decoding its last one, at ``spec``'s
    attention shape (tessellm.testing.attention.make_latent_case, moved to ``device``)."""
    mla = spec.mla
    case = ref.make_latent_case([context] * batch, [1] * batch, spec.num_heads, mla.kv_lora_rank,
                                mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim, block_size, dtype, seed)
    storage = LatentKVStorage(case.storage.layout, case.storage.c.shape[0], mla.latent_dim, device)
    storage.c.copy_(case.storage.c)
    up = LatentProjection(case.up.w_uk.to(device), case.up.w_uv.to(device))
    return DecodeStep(case.q_nope.to(device), case.q_pe.to(device), case.latent_new.to(device), up,
                      ref.batch_to(case.batch, device), storage, case)


def attend(spec: ModelSpec, step: DecodeStep, device: torch.device, dtype: torch.dtype, form: str,
           kernel: str) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """(a call of one ``forward_latent`` in ``form`` with ``kernel``, its output)."""
    backend = MlaAttention(MlaOptions(form=form, decode_kernel=kernel), spec, device, dtype)
    plan = backend.plan(step.batch, None)

    def call() -> torch.Tensor:
        return backend.forward_latent(5, step.q_nope, step.q_pe, step.latent, step.up, step.storage, plan)

    return call, call()


def kernel_call(spec: ModelSpec, step: DecodeStep) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """(one ``mla_decode`` on the absorbed query over the cache in place, its output after
    ``w_uv``, comparable with ``forward_latent``'s)."""
    from tessellm.plugins.attention.mla.decode_kernel import mla_decode  # Triton: the CUDA path only

    q_lat = torch.einsum("bhn,hnr->bhr", step.q_nope, step.up.w_uk)
    q = torch.cat((q_lat, step.q_pe), dim=-1).contiguous()
    tables = step.batch.block_tables.to(torch.int32)
    seq_lens = step.batch.seq_lens.to(torch.int32)
    cache = step.storage.latent_tensor()

    def call() -> torch.Tensor:
        return mla_decode(q, cache, tables, seq_lens, step.batch.block_size, spec.mla.kv_lora_rank,
                          spec.attention_scale)

    return call, torch.einsum("bhr,hvr->bhv", call(), step.up.w_uv)


SWEEP_CONFIGS = [(32, 4, 2), (32, 8, 2), (32, 8, 3), (16, 4, 3), (16, 8, 3), (64, 8, 2)]
"""(keys a tile, warps, stages) that ``--sweep`` times: the kernel's first shape, its
default now, and neighbours that compile for sm_90 without spilling."""


def split_candidates(spec: ModelSpec, batch: int, context: int, block_n: int, device: torch.device) -> dict:
    """Split counts to compare: the automatic choice, the one before it (two programs an SM,
    rounded up: a tail wave), and one and two whole waves."""
    from tessellm.plugins.attention.mla import decode_kernel as dk

    sms = dk._sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 2
    work = batch * -(-spec.num_heads // dk.BLOCK_H)
    cap = max(1, context // (dk.MIN_TILES_PER_SPLIT * block_n))
    return {"auto": dk.default_num_splits(batch, spec.num_heads, context, block_n, device),
            "before": max(1, min(-(-2 * sms // work), dk.MAX_AUTO_SPLITS, cap)),
            "one_wave": max(1, min(dk.PROGRAMS_PER_SM * sms // work, cap)),
            "two_waves": max(1, min(2 * dk.PROGRAMS_PER_SM * sms // work, cap))}


def sweep_point(spec: ModelSpec, step: DecodeStep, args: argparse.Namespace, device: torch.device,
                copy_bps: float | None) -> list[dict]:
    """``mla_decode`` at one point over ``SWEEP_CONFIGS`` x ``split_candidates``, each against
    the default's output."""
    from tessellm.plugins.attention.mla.decode_kernel import LaunchConfig, mla_decode

    q_lat = torch.einsum("bhn,hnr->bhr", step.q_nope, step.up.w_uk)
    q = torch.cat((q_lat, step.q_pe), dim=-1).contiguous()
    tables, lens = step.batch.block_tables.to(torch.int32), step.batch.seq_lens.to(torch.int32)
    cache = step.storage.latent_tensor()
    batch, context = int(lens.numel()), int(lens.max())
    read = batch * context * spec.mla.latent_dim * cache.element_size()
    args_ = (q, cache, tables, lens, step.batch.block_size, spec.mla.kv_lora_rank, spec.attention_scale)
    reference = mla_decode(*args_)
    inner, warmup = (args.inner, 3) if device.type == "cuda" else (1, 0)
    configs = SWEEP_CONFIGS if device.type == "cuda" else [(16, 4, 1)]
    rows = []
    for block_n, warps, stages in configs:
        cfg = LaunchConfig(block_n, warps, stages)
        for rule, splits in split_candidates(spec, batch, context, block_n, device).items():
            row = {"batch": batch, "context": context, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                   "split_rule": rule, "splits": splits}
            try:
                fn = lambda: mla_decode(*args_, num_splits=splits, config=cfg)  # noqa: E731
                row["max_abs_diff"] = float(f"{max_abs_diff(fn(), reference):.3g}")
                ms = median_ms(fn, device, args.reps, inner, warmup)
                row.update(ms=round(ms, 4), gbps=round(read / (ms / 1e3) / 1e9, 1))
                if copy_bps:
                    row["of_copy_bw"] = round(read / (ms / 1e3) / copy_bps, 3)
            except Exception as exc:  # noqa: BLE001 - a shape that does not fit: recorded
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            rows.append(row)
            print("sweep", json.dumps(row), file=sys.stderr, flush=True)
    return rows


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def agrees(diff: float, scale: float, dtype: torch.dtype) -> bool:
    """Whether a max abs difference is rounding: relative to the output's largest value,
    1e-4 in float32, 5e-2 in 16-bit types (the naive form rounds its per-head keys)."""
    rtol = 1e-4 if dtype == torch.float32 else 5e-2
    return diff <= rtol * max(scale, 1e-3)


def attention_point(spec: ModelSpec, batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype,
                    device: torch.device, copy_bps: float | None) -> dict:
    """Every form's time at one (batch, context), their agreement, and on CUDA the kernel's bandwidth."""
    step = decode_step(spec, batch, context, args.block_size, dtype, device, seed=0)
    cuda = device.type == "cuda"
    inner, warmup = (args.inner, 3) if cuda else (1, 1)
    point: dict = {"batch": batch, "context": context}
    naive, out_naive = attend(spec, step, device, dtype, "naive", "torch")
    scale = float(out_naive.float().abs().max())
    arms = {"absorbed": attend(spec, step, device, dtype, "absorbed", "torch")}
    if cuda:
        arms["triton"] = attend(spec, step, device, dtype, "absorbed", "triton")
        arms["kernel"] = kernel_call(spec, step)
    point["naive_ms"] = round(median_ms(naive, device, args.reps, inner, warmup), 4)
    ok = True
    for name, (fn, out) in arms.items():
        diff = max_abs_diff(out, out_naive)
        ok &= agrees(diff, scale, dtype)
        point[f"{name}_ms"] = round(median_ms(fn, device, args.reps, inner, warmup), 4)
        point[f"{name}_max_abs_diff"] = float(f"{diff:.3g}")
    point["speedup"] = round(point["naive_ms"] / point["absorbed_ms"], 2)
    if cuda:
        read = batch * context * spec.mla.latent_dim * dtype.itemsize
        point["latent_mb"] = round(read / 1e6, 1)
        point["kernel_gbps"] = round(read / (point["kernel_ms"] / 1e3) / 1e9, 1)
        point["of_copy_bw"] = round(read / (point["kernel_ms"] / 1e3) / copy_bps, 3)
        point["speedup_triton"] = round(point["naive_ms"] / point["triton_ms"], 2)
    point["max_abs_out"] = float(f"{scale:.3g}")
    if batch * context <= REFERENCE_TOKENS:  # the naive form itself against first principles
        expected = ref.reference_latent_attention(dataclasses.replace(step.case, scale=spec.attention_scale))
        diff = max_abs_diff(out_naive.cpu().double(), expected)
        ok &= agrees(diff, scale, dtype)
        point["reference_max_abs_diff"] = float(f"{diff:.3g}")
    point["agree"] = ok
    if args.sweep:
        point["sweep"] = sweep_point(spec, step, args, device, copy_bps)
        timed = [r for r in point["sweep"] if "gbps" in r]
        if timed:
            best = max(timed, key=lambda r: r["gbps"])
            point["sweep_best"] = {k: best[k] for k in ("block_n", "num_warps", "num_stages", "split_rule", "splits",
                                                        "gbps", "of_copy_bw") if k in best}
    del step, arms, naive
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return point


def run_attention(args: argparse.Namespace, device: torch.device) -> dict:
    """The ``--part attention`` report: the shape, the copy bandwidth (CUDA) and one entry per point."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {**V2_LITE, **(SMOKE_ATTENTION if args.smoke else {})}
    spec = model_spec(shapes)
    copy_bps = copy_bandwidth(device) if device.type == "cuda" else None
    report = {"dtype": str(dtype).removeprefix("torch."), "block_size": args.block_size, "reps": args.reps,
              "inner": args.inner if device.type == "cuda" else 1,
              "shape": {"num_heads": spec.num_heads, "kv_lora_rank": spec.mla.kv_lora_rank,
                        "rope_dim": spec.mla.qk_rope_head_dim, "nope_dim": spec.mla.qk_nope_head_dim,
                        "v_dim": spec.mla.v_head_dim, "latent_dim": spec.mla.latent_dim,
                        "scale": round(spec.attention_scale, 6)},
              "copy_gbps": round(copy_bps / 1e9, 1) if copy_bps else None, "points": []}
    for context in args.contexts:
        for batch in args.batches:
            point = attention_point(spec, batch, context, args, dtype, device, copy_bps)
            report["points"].append(point)
            print(json.dumps(point), file=sys.stderr, flush=True)  # kept if a later point fails
    return report


def attention_table(report: dict) -> str:
    """The points as a text table."""
    cuda = report["copy_gbps"] is not None
    cols = ["batch", "context", "naive_ms", "absorbed_ms", "speedup"]
    if cuda:
        cols += ["triton_ms", "speedup_triton", "kernel_ms", "kernel_gbps", "of_copy_bw"]
    cols += ["absorbed_max_abs_diff"] + (["kernel_max_abs_diff"] if cuda else []) + ["max_abs_out", "agree"]
    rows = [[str(p.get(c, "-")) if c != "agree" else ("yes" if p["agree"] else "MISMATCH") for c in cols]
            for p in report["points"]]
    head = (f"MLA decode attention, one layer, {report['dtype']}, heads {report['shape']['num_heads']}, "
            f"latent {report['shape']['latent_dim']}, block {report['block_size']}; median of {report['reps']}")
    if cuda:
        head += f"; copy bandwidth {report['copy_gbps']} GB/s"
    return head + "\n" + format_table(cols, rows)


def format_table(cols: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)] if rows else [len(c) for c in cols]
    line = lambda cells: "  ".join(s.rjust(w) for s, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(cols), *(line(r) for r in rows)])


# ---------------------------------------------------------------- --part model


def build_v2_lite(folder: Path, layers: int, device: torch.device) -> dict:
    """Random bf16 weights of DeepSeek-V2-Lite's shapes cut to ``layers`` layers, built on
    ``device`` (no float32 copy, none on the host), saved with a word-level tokenizer and
    freed; returns the shapes."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from tessellm.testing.models import save_word_tokenizer

    shapes = {**V2_LITE, "num_hidden_layers": layers}
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV2ForCausalLM._from_config(DeepseekV2Config(**shapes), dtype=torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    save_word_tokenizer(folder, shapes["vocab_size"])
    return shapes


def count_parameters(folder: Path) -> int:
    """Parameters in a saved folder's safetensors files (read from their headers)."""
    import math

    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            total += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())
    return total


def build_smoke_model(folder: Path) -> dict:
    """A 2-layer tiny DeepSeek-V2 (tessellm.testing.models.build_tiny_deepseek); returns its shapes."""
    from tessellm.testing.models import TINY_DEEPSEEK, build_tiny_deepseek

    build_tiny_deepseek(folder, version=2, seed=0, num_hidden_layers=2)
    return {**TINY_DEEPSEEK[2], "num_hidden_layers": 2, "vocab_size": 512}


def pipeline_config(folder: Path, device: torch.device, args: argparse.Namespace, max_batch: int) -> dict:
    """tessellm's pipeline for the model runs: attention `mla`, paged cache without prefix
    caching, continuous scheduler admitting every request of the largest batch at once."""
    return {"model": str(folder), "device": device.type,
            "dtype": "bfloat16" if device.type == "cuda" else "float32",
            "max_model_len": args.prompt_len + args.new_tokens + 16,
            "attention": {"name": "mla", "options": {"form": args.form}},
            "cache": {"name": "paged", "options": {"prefix_caching": False}},
            "scheduler": {"name": "continuous",
                          "options": {"max_num_seqs": max_batch,
                                      "max_num_batched_tokens": max(max_batch * args.prompt_len, 2048)}}}


def model_run(llm, batch: int, args: argparse.Namespace) -> dict:
    """``batch`` requests of random prompts, greedy, all at t=0: tokens/s and time per token."""
    from tessellm.bench.offline import run_offline
    from tessellm.bench.workloads import BenchRequest

    g = torch.Generator().manual_seed(batch)
    vocab = min(llm.engine.vocab_size, 100000)
    requests = [BenchRequest(f"r{i}", torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist(),
                             args.new_tokens) for i in range(batch)]
    m = run_offline(llm, requests).metrics()
    tpot = m["tpot_ms"]["mean"]
    return {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "output_tokens_per_s": m["output_tokens_per_s"], "total_tokens_per_s": m["total_tokens_per_s"],
            "elapsed_s": m["elapsed_s"], "ttft_ms_mean": m["ttft_ms"]["mean"], "tpot_ms_mean": tpot,
            "decode_tokens_per_s": round(batch * 1e3 / tpot, 1) if tpot else None,
            "kernel_builds": m["kernel_builds"]}


def run_model(args: argparse.Namespace, device: torch.device) -> dict:
    """The ``--part model`` report: what was built, the pipeline, one entry per batch size."""
    from tessellm import LLM

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        shapes = build_smoke_model(folder) if args.smoke else build_v2_lite(folder, args.layers, device)
        built_s = time.perf_counter() - start
        params = count_parameters(folder)
        config = pipeline_config(folder, device, args, max(args.model_batches))
        start = time.perf_counter()
        llm = LLM(config)
        load_s = time.perf_counter() - start
        runs = []
        for batch in args.model_batches:
            runs.append(model_run(llm, batch, args))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        resolved = llm.pipeline.resolved
        chosen = {kind: {"name": c.entry.cls.name, "options": c.options.model_dump(mode="json")}
                  for kind, c in resolved.choices.items()}
        del llm
        gc.collect()
    return {"model": "tiny DeepSeek-V2 (smoke)" if args.smoke else
            f"DeepSeek-V2-Lite shapes, {args.layers} layers, random bf16 weights",
            "shapes": {k: v for k, v in shapes.items() if k != "rope_parameters"},
            "rope": shapes.get("rope_parameters"), "parameters": params, "pipeline": config, "resolved": chosen,
            "build_s": round(built_s, 1), "load_s": round(load_s, 1), "runs": runs}


def model_table(report: dict) -> str:
    cols = ["batch", "prompt_len", "new_tokens", "output_tokens_per_s", "decode_tokens_per_s", "tpot_ms_mean",
            "ttft_ms_mean", "elapsed_s"]
    rows = [[str(r.get(c)) for c in cols] for r in report["runs"]]
    attn = report["resolved"].get("attention", {})
    head = f"{report['model']}; attention mla {attn.get('options', {})}"
    return head + "\n" + format_table(cols, rows)


# ---------------------------------------------------------------- main


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None, cuda: bool) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["attention", "model"], default="attention")
    ap.add_argument("--contexts", type=int_list, default=None,
                    help="comma-separated context lengths (default: 4096 on a CPU, 4096,8192,16384 on CUDA)")
    ap.add_argument("--batches", type=int_list, default=None,
                    help="comma-separated batch sizes for --part attention (default: 1,4,16 on a CPU, 16,32,64 on CUDA)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=None, help="timed samples per arm (default: 5 on a CPU, 20 on CUDA)")
    ap.add_argument("--inner", type=int, default=10, help="calls averaged per sample on CUDA")
    ap.add_argument("--layers", type=int, default=27, help="--part model: layers kept of DeepSeek-V2-Lite's 27")
    ap.add_argument("--model-batches", type=int_list, default=[1, 64], help="--part model: batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--form", choices=["auto", "naive", "absorbed"], default="auto", help="--part model: mla's form")
    ap.add_argument("--workdir", default=None, help="--part model: where the model folder is written (default: $TMPDIR)")
    ap.add_argument("--sweep", action="store_true", help="--part attention: also time the kernel's launch shapes and "
                    "split counts at each point")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds: checks the code path")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    if args.part == "model" and not cuda and not args.smoke:
        ap.error("--part model needs a CUDA GPU (DeepSeek-V2-Lite's shape has 15.7B parameters); "
                 "run --part attention on a CPU, or add --smoke for a tiny model's code path")
    if args.smoke:
        args.contexts = args.contexts or [64]
        args.batches = args.batches or [1, 2]
        args.model_batches = [1, 2]
        args.prompt_len, args.new_tokens = min(args.prompt_len, 16), min(args.new_tokens, 8)
    args.contexts = args.contexts or ([4096, 8192, 16384] if cuda else [4096])
    args.batches = args.batches or ([16, 32, 64] if cuda else [1, 4, 16])
    args.reps = args.reps or (20 if cuda else 5)
    return args


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    args = parse_args(argv, cuda)
    device = torch.device("cuda" if cuda and not args.smoke else "cpu")
    torch.manual_seed(0)
    report = {"command": command_line(argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": describe(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "part": args.part, "smoke": args.smoke}
    if args.part == "attention":
        report.update(run_attention(args, device))
        print(attention_table(report))
        status = 0 if all(p["agree"] for p in report["points"]) else 1
    else:
        report.update(run_model(args, device))
        print(model_table(report))
        status = 0
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
