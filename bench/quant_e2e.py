"""Quantized weights end to end on a GPU: batch-1 decode and prefill of each quantizer against
bfloat16 at Llama-3.2-1B's and Llama-3.1-8B's shapes, and decode at batch 256.

What it measures
----------------
Random-weight models with each shape (bench/e2e_gpu.py's builder, initialised on the GPU,
saved once to a folder, ``--workdir``, /dev/shm where there is one) run by tessellm's default
CUDA pipeline (flash, paged, continuous, CUDA graphs, greedy), one pipeline per variant:

- ``bf16`` (quant none), ``int8-weight``, ``int4-weight`` (group 64), ``w4a16`` (int4-weight,
  group 128: what W4A16 checkpoints hold), ``fp8`` (per channel), each with ``kernel: auto``
  reading ``--kernel-table`` (bench/quant_kernels.py's) where given, the default table else;
- ``decode``: one request, ``--prompt-len`` tokens, ``--new-tokens`` generated; the median
  time per output token over ``--rounds`` runs, and ``tokens_per_s`` = 1000 / that;
- ``prefill``: ``--prefill-seqs`` prompts of ``--prefill-len`` tokens, one token each: prompt
  tokens per second of the whole run (the same pipeline);
- ``batch256`` (``--batch-models``, default the 1B shape): bf16, w8a8 and fp8 with 256
  sequences at once, ``--batch-new-tokens`` each: decode tokens/s = 256 * 1000 / median TPOT.

Each variant's ``vs_bf16`` is its rate over bf16's on the same shape and part. Targets
(issue 59): batch-1 decode int8-weight 1.4x, int4-weight 1.8x, fp8 1.3x; W4A16 prefill 0.8x;
w8a8 and fp8 at batch 256 1.1x. The JSON is written after every variant (a run cut short
keeps what it measured).

    python bench/quant_e2e.py --out quant_e2e.json --kernel-table quant_table.json   # GPU
    python bench/quant_e2e.py --smoke --out /tmp/qe.json                             # CPU: tiny, code path
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from e2e_gpu import LLAMA_31_8B, LLAMA_32_1B, TINY, build_model  # noqa: E402

from tessellm import LLM  # noqa: E402
from tessellm.bench.offline import describe_device, run_offline  # noqa: E402
from tessellm.bench.workloads import BenchRequest  # noqa: E402

MODELS = {"llama-3.2-1b": LLAMA_32_1B, "llama-3.1-8b": LLAMA_31_8B, "tiny": TINY}
VARIANTS = {
    "bf16": None,
    "int8-weight": {"name": "int8-weight"},
    "int4-weight": {"name": "int4-weight", "options": {"group_size": 64}},
    "w4a16": {"name": "int4-weight", "options": {"group_size": 128}},
    "fp8": {"name": "fp8"},
    "w8a8": {"name": "w8a8"},
}


def config(folder: Path, quant: dict | None, table: str | None, max_seqs: int, cuda: bool, max_len: int) -> dict:
    """tessellm's default CUDA pipeline for these runs, ``max_seqs`` sequences at once (graphs
    captured up to that batch), a quarter of the GPU's free memory for K/V (on the CPU, for
    ``--smoke``, sdpa rather than flash interpreted)."""
    quant = None if quant is None else {**quant, "options": {**quant.get("options", {}),
                                                             **({"kernel_table": table} if table else {})}}
    return {"model": str(folder), "device": "cuda" if cuda else "cpu", "dtype": "bfloat16" if cuda else "float32",
            "max_model_len": max_len, "attention": {"name": "flash" if cuda else "sdpa"},  # CPU: no interpreter
            "cache": {"name": "paged", "options": {"gpu_memory_fraction": 0.25, "prefix_caching": False}},
            "scheduler": {"name": "continuous", "options": {"max_num_seqs": max_seqs,
                                                             "max_num_batched_tokens": 8192}},
            "decoding": {"name": "greedy"}, "quant": quant or {"name": "none"}}


def requests(n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> list[BenchRequest]:
    g = torch.Generator().manual_seed(seed)
    return [BenchRequest(f"r{seed}-{i}", torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), new_tokens)
            for i in range(n)]


def decode_and_prefill(llm, args, vocab: int) -> dict:
    """Batch-1 time per output token (median over rounds) and the prefill's prompt tokens/s."""
    tpots = []
    for r in range(args.rounds):
        m = run_offline(llm, requests(1, args.prompt_len, args.new_tokens, vocab, r)).metrics()
        tpots.append(m["tpot_ms"]["p50"])
    tpot = statistics.median(tpots)
    out = {"tpot_ms": round(tpot, 3), "tpot_ms_rounds": tpots, "tokens_per_s": round(1e3 / tpot, 2)}
    m = run_offline(llm, requests(args.prefill_seqs, args.prefill_len, 1, vocab, 99), warmup=False).metrics()
    out.update(prefill_tokens_per_s=round(m["total_prompt_tokens"] / m["elapsed_s"], 1),
               prefill_s=m["elapsed_s"], kernel_builds=m["kernel_builds"])
    return out


def batch_decode(llm, args, vocab: int) -> dict:
    """Decode tokens/s with ``args.batch`` sequences at once (256 * 1000 / median TPOT)."""
    m = run_offline(llm, requests(args.batch, args.prompt_len, args.batch_new_tokens, vocab, 7)).metrics()
    tpot = m["tpot_ms"]["p50"]
    return {"batch": args.batch, "tpot_ms": tpot, "decode_tokens_per_s": round(args.batch * 1e3 / tpot, 1),
            "output_tokens_per_s": m["output_tokens_per_s"], "kernel_builds": m["kernel_builds"]}


def kernels_of(llm) -> dict:
    """Which kernel choice the quantized layers hold (named or the table's), by layer type."""
    seen = {}
    for module in llm.pipeline.model.modules():
        choice = getattr(module, "kernel_choice", None)
        if choice is not None:
            seen[type(module).__name__] = choice.named or "auto"
    return seen


def run_variant(part: str, folder: Path, name: str, args, cuda: bool, vocab: int) -> dict:
    """One pipeline of variant ``name``, measured for ``part``; the error where it fails."""
    max_seqs = args.batch if part == "batch256" else 4
    max_len = max(args.prompt_len + max(args.new_tokens, args.batch_new_tokens), args.prefill_len) + 16
    start = time.perf_counter()
    try:
        llm = LLM(config(folder, VARIANTS[name], args.kernel_table, max_seqs, cuda, max_len))
    except Exception as exc:  # noqa: BLE001 - recorded; the other variants go on
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    result = {"load_s": round(time.perf_counter() - start, 1), "kernels": kernels_of(llm)}
    try:
        result.update(decode_and_prefill(llm, args, vocab) if part == "decode" else batch_decode(llm, args, vocab))
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def ratios(results: dict, key: str) -> None:
    """Each variant's ``vs_bf16`` on ``key`` (and its prefill's), in place."""
    base = results.get("bf16", {})
    for r in results.values():
        if key in r and key in base:
            r["vs_bf16"] = round(r[key] / base[key], 3)
        if "prefill_tokens_per_s" in r and "prefill_tokens_per_s" in base:
            r["prefill_vs_bf16"] = round(r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--kernel-table", help="bench/quant_kernels.py's table for kernel: auto (default: the built-in)")
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--variants", default="bf16,int8-weight,int4-weight,w4a16,fp8")
    ap.add_argument("--batch-models", default="llama-3.2-1b")
    ap.add_argument("--batch-variants", default="bf16,w8a8,fp8")
    ap.add_argument("--parts", default="decode,batch256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill-seqs", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batch-new-tokens", type=int, default=64)
    ap.add_argument("--workdir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        ap.error("no GPU: run with --smoke (and TRITON_INTERPRET=1) to check the code path on the CPU")
    if args.smoke:
        args.models = args.batch_models = "tiny"
        args.variants, args.batch_variants = "bf16,int8-weight,w4a16", "bf16,w8a8"
        args.prompt_len, args.new_tokens, args.rounds = 8, 4, 1
        args.prefill_seqs, args.prefill_len, args.batch, args.batch_new_tokens = 2, 16, 3, 3
    dtype = torch.bfloat16 if cuda else torch.float32
    report = {"command": " ".join(["python", "bench/quant_e2e.py", *(sys.argv[1:] if argv is None else argv)]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": describe_device("cuda" if cuda else "cpu"), "torch": torch.__version__,
              "kernel_table": args.kernel_table, "decode": {}, "batch256": {}}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    plan = [("decode", m, args.variants) for m in args.models.split(",") if "decode" in args.parts] + \
        [("batch256", m, args.batch_variants) for m in args.batch_models.split(",") if "batch256" in args.parts]
    folders: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for part, model, variants in plan:
            if model not in folders:
                folders[model] = Path(tmp) / model
                start = time.perf_counter()
                build_model(folders[model], MODELS[model], dtype, "cuda" if cuda else "cpu")
                report.setdefault("build_s", {})[model] = round(time.perf_counter() - start, 1)
            results = report[part].setdefault(model, {})
            for name in variants.split(","):
                results[name] = run_variant(part, folders[model], name, args, cuda, MODELS[model]["vocab_size"])
                ratios(results, "tokens_per_s" if part == "decode" else "decode_tokens_per_s")
                print(part, model, name, json.dumps(results[name]), file=sys.stderr, flush=True)
                save()
    save()
    print(json.dumps({part: {m: {v: {k: r.get(k) for k in ("tokens_per_s", "decode_tokens_per_s", "vs_bf16",
                                                          "prefill_vs_bf16", "error") if k in r}
                                 for v, r in res.items()} for m, res in report[part].items()}
                      for part in ("decode", "batch256")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
