"""End to end, long contexts: `quest` against dense attention on the same model and prompts,
arms interleaved round by round in one run.

What it measures: a random-weight model built here from its config with
``torch.manual_seed(0)`` (bench/e2e_gpu.py's builder; ``--shape``: Llama-3.2-1B's shapes and
long RoPE, bf16 on CUDA; ``cpu``: the same attention geometry per KV head, head dim 64 and
GQA 4, with one KV head and a 256-wide residual, float32, so that on a CPU, as on a GPU at
long contexts, attention is most of a decode step), through the paged cache and continuous
batching, prefix caching off. On a CPU every arm's engine stays loaded for the whole run and
each round runs every arm in turn (the order rotating); on CUDA the arms run one after the
other (each engine takes most of the GPU's memory), their rounds back to back. A round is
one request per context in ``--contexts``
(``--new-tokens`` each, ignore_eos), and records its time to first token (``ttft_ms``: the
prompt, prefilled dense in every arm, plus the first decode step's launch) and time per
output token (``tpot_ms``). Arms: dense (`flash` on CUDA, `sdpa` on a CPU) and `quest` at
each ``--budgets`` and key-bounds page in ``--pages`` (its first two layers dense, QUEST's
default). Per arm, context and round the ratio to dense of the same round; the report gives
their medians and ranges.

``--concurrent N...``: besides, per arm, the decode rate of N sequences at
``--concurrent-context`` tokens each: their K/V written straight into the cache (random
values: the cost of a step does not depend on them, and a prefill of 64 x 32k tokens would
take a minute an arm), then ``--rate-steps`` decode steps through the engine's runner (the
replayed CUDA graph where one was captured), timed together: sequences x steps / seconds.

How to run
----------
    python bench/quest_e2e.py --contexts 8192 32768 131072 --concurrent 16 64 --json out.json   # GPU
    OMP_NUM_THREADS=2 python bench/quest_e2e.py --shape cpu --contexts 8192 16384 --budgets 512 \\
        --pages 4 16 --rounds 2 --new-tokens 16 --json out.json                                # a CPU
    python bench/quest_e2e.py --smoke                                                       # code path only
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from e2e_gpu import LLAMA_32_1B, TINY, build_model  # bench/ is the script's folder
from tessellm import LLM
from tessellm.bench.offline import describe_device, run_offline
from tessellm.bench.workloads import BenchRequest

CPU_SHAPE = dict(LLAMA_32_1B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                 vocab_size=2048, bos_token_id=0, eos_token_id=1)
"""Llama-3.2-1B's 16 layers, head dim 64, GQA 4 and long RoPE; one KV head and narrow
projections: a 16k prompt's prefill in a minute or two on a CPU."""
CPU_WIDE_SHAPE = dict(CPU_SHAPE, num_attention_heads=32, num_key_value_heads=8)
"""Llama-3.2-1B's whole attention (32 query heads, 8 KV heads, head dim 64) on a 256-wide
residual: a decode step at 8k-16k tokens is mostly attention on a CPU too (its prompts take
hours to prefill there: for decode rates, whose contexts are written straight into the cache)."""
SHAPES = {"llama-3.2-1b": LLAMA_32_1B, "cpu": CPU_SHAPE, "cpu-wide": CPU_WIDE_SHAPE}


def make_llm(folder: Path, cuda: bool, dtype: torch.dtype, max_len: int, attention: dict, page: int,
             memory_share: float, max_seqs: int) -> LLM:
    cache = {"prefix_caching": False, "bounds_page_size": page}
    if cuda:
        cache["gpu_memory_fraction"] = memory_share
    else:  # the OS commits a CPU cache's pages as they are written: room for the rates' sequences
        cache["cpu_memory_bytes"] = 8 * 2**30
    return LLM({"model": str(folder), "device": "cuda" if cuda else "cpu", "dtype": str(dtype).split(".")[1],
                "max_model_len": max_len, "attention": attention, "cache": {"name": "paged", "options": cache},
                "scheduler": {"name": "continuous", "options": {"max_num_seqs": max_seqs,
                                                                "max_num_batched_tokens": 8192}}})


def one_request(llm: LLM, context: int, new_tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, min(1000, llm.engine.vocab_size), (context,), generator=g).tolist()
    result = run_offline(llm, [BenchRequest(f"c{context}-{seed}", prompt, new_tokens)], warmup=False)
    metrics = result.metrics()
    return {"ttft_ms": metrics["ttft_ms"]["mean"], "tpot_ms": metrics["tpot_ms"]["mean"],
            "kernel_builds": result.kernel_builds}


def decode_rate(llm: LLM, batch: int, context: int, steps: int) -> dict:
    """Decode steps of ``batch`` sequences of ``context`` tokens through the engine's runner,
    their K/V random and written straight into the cache: sequences x steps per second."""
    from tessellm.core.engine.batch_builder import build_batch
    from tessellm.core.interfaces.batch import ScheduledSeq
    from tessellm.core.interfaces.sequence import SamplingParams, Sequence

    pipeline = llm.pipeline
    cache, runner, device = pipeline.cache, pipeline.runner, pipeline.resolved.device
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"rate-{i}", [1] * context, params)
        seq.token_ids.append(1)  # past its prompt: the next step is a decode
        seq.num_computed_tokens = context
        cache.reserve(seq, context + steps + 1)
        seqs.append(seq)
    bs = cache.layout.block_size
    slots = torch.cat([torch.tensor(cache.block_table(s), dtype=torch.long)[:, None] * bs + torch.arange(bs)
                       for s in seqs]).flatten().to(device)
    try:
        storage = cache.layer(cache.spec.held_layers[0])
        k = torch.randn(slots.shape[0], *storage.kv_tensors()[0].shape[1:], device=device).to(pipeline.resolved.dtype)
        for layer in cache.spec.held_layers:
            cache.layer(layer).store(k, k, slots)
        del k
        replays = runner.graphs.replays if runner.graphs is not None else 0
        scheduled = [ScheduledSeq(s, 1) for s in seqs]
        runner.forward(build_batch(scheduled, cache, device))  # first-call set-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            for s in seqs:
                s.token_ids.append(1)
                s.num_computed_tokens += 1
            runner.forward(build_batch(scheduled, cache, device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        graphed = runner.graphs is not None and runner.graphs.replays - replays == steps + 1
    finally:
        for s in seqs:
            cache.free(s)
    return {"sequences": batch, "context": context, "step_ms": round(1e3 * seconds / steps, 3),
            "tokens_per_s": round(batch * steps / seconds, 1), "cuda_graphs": graphed}


def arms_of(args, cuda: bool) -> list[dict]:
    arms = [{"attention": {"name": "flash" if cuda else "sdpa"}, "page": 4}] if not args.no_dense else []
    for budget in args.budgets:
        for page in args.pages:
            arms.append({"attention": {"name": "quest", "options": {"token_budget": budget}}, "page": page})
    return arms


def ratio_row(runs: list[dict], dense_runs: list[dict] | None, keys: tuple[str, ...], higher: str = "") -> dict:
    """Medians over rounds of ``keys``, and for each the median and range of the per-round
    ratio to dense's run of the same round (quest / dense)."""
    row = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    for k in keys if dense_runs else ():
        ratios = [r[k] / d[k] for r, d in zip(runs, dense_runs)]
        name = k.removesuffix("_ms").removesuffix("_per_s")
        row[f"{name}_ratio"] = round(statistics.median(ratios), 3)
        row[f"{name}_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return row


def summarize(arms: list[dict]) -> None:
    """Per arm: ``results`` per context (TTFT, TPOT) and ``rates`` per sequences x context
    (step time, tokens/s), medians over rounds with their ratios to dense."""
    dense = arms[0] if arms[0]["attention"]["name"] != "quest" else None
    for arm in arms:
        base = dense if dense is not None and arm is not dense else None
        arm["results"] = {c: {**ratio_row(runs, base and base["runs"][c], ("ttft_ms", "tpot_ms")),
                              "kernel_builds": sum(r["kernel_builds"] or 0 for r in runs)}
                          for c, runs in arm["runs"].items()}
        arm["rates"] = []
        for key, runs in arm["rate_runs"].items():
            row = ratio_row(runs, base and base["rate_runs"][key], ("step_ms", "tokens_per_s"))
            row.pop("step_ratio", None), row.pop("step_ratio_range", None)
            if "tokens_ratio" in row:
                row["rate_ratio"], row["rate_ratio_range"] = row.pop("tokens_ratio"), row.pop("tokens_ratio_range")
            arm["rates"].append({"sequences": runs[0]["sequences"], "context": runs[0]["context"], **row,
                                 "cuda_graphs": all(r["cuda_graphs"] for r in runs)})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``--smoke``'s tiny sizes put in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", "--context", dest="contexts", type=int, nargs="*", default=[32768])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--pages", "--page", dest="pages", type=int, nargs="+", default=[4],
                    help="tokens per key-bounds page (the cache's bounds_page_size): a quest arm each")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shape", choices=list(SHAPES), default=None,
                    help="the model's shapes (default: llama-3.2-1b on CUDA, cpu on a CPU)")
    ap.add_argument("--concurrent", type=int, nargs="*", default=[], help="decode rates of this many sequences")
    ap.add_argument("--concurrent-context", type=int, nargs="+", default=[32768])
    ap.add_argument("--rate-steps", type=int, default=20)
    ap.add_argument("--reload", action="store_true",
                    help="on a CPU, load each arm's engine for each round and free it after (memory), not once")
    ap.add_argument("--no-dense", action="store_true", help="quest arms only")
    ap.add_argument("--model-dir", help="the model's folder, built there if it holds none (reused across runs)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (CPU), short contexts")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    if args.smoke:
        args.contexts, args.budgets, args.new_tokens, args.rounds = [200], [32], min(args.new_tokens, 4), 1
        args.concurrent, args.concurrent_context, args.rate_steps = [2], [200], 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = args.shape or ("llama-3.2-1b" if cuda else "cpu")
    shapes = dict(TINY) if args.smoke else dict(SHAPES[shape])
    rate_len = max(args.concurrent_context) + args.rate_steps + 2 if args.concurrent else 0
    max_len = max(max(args.contexts, default=0) + args.new_tokens, rate_len) + 16
    shapes["max_position_embeddings"] = max(shapes["max_position_embeddings"], max_len)
    arms = arms_of(args, cuda)
    report = {"command": "python bench/quest_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": describe_device("cuda" if cuda else "cpu"), "shape": "tiny" if args.smoke else shape,
              "threads": torch.get_num_threads(), "contexts": args.contexts, "new_tokens": args.new_tokens,
              "rounds": args.rounds, "arms": arms}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model_dir or tmp)
        if not (folder / "config.json").exists():
            build_model(folder, shapes, dtype)
        run_rounds(args, arms, folder, cuda, dtype, max_len)
        summarize(arms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0


def run_rounds(args: argparse.Namespace, arms: list[dict], folder: Path, cuda: bool, dtype: torch.dtype,
               max_len: int) -> None:
    """Every round of every arm, its figures appended to the arm's ``runs`` and ``rate_runs``
    (and printed as they come): on CUDA arm after arm (each engine takes most of the memory),
    on a CPU rounds of every arm in turn, the order rotating."""
    for arm in arms:
        arm["runs"] = {str(c): [] for c in args.contexts}
        arm["rate_runs"] = {f"{n}x{c}": [] for n in args.concurrent for c in args.concurrent_context}
    n = len(arms)
    order = [(i, r) for i in range(n) for r in range(args.rounds)] if cuda else \
        [(i, r) for r in range(args.rounds) for i in (list(range(n))[r % n:] + list(range(n))[:r % n])]
    keep = not cuda and not args.reload
    llms: dict[int, LLM] = {}
    for i, r in order:
        arm = arms[i]
        if i not in llms:
            if not keep:
                llms.clear()
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            llms[i] = make_llm(folder, cuda, dtype, max_len, arm["attention"], arm["page"], 0.85,
                               max([1, *args.concurrent]))
        for context in args.contexts:
            arm["runs"][str(context)].append(one_request(llms[i], context, args.new_tokens, seed=r))
            print(json.dumps({"round": r, **arm["attention"], "page": arm["page"], "context": context,
                              **arm["runs"][str(context)][-1]}), flush=True)
        for key in arm["rate_runs"]:
            batch, context = (int(x) for x in key.split("x"))
            arm["rate_runs"][key].append(decode_rate(llms[i], batch, context, args.rate_steps))
            print(json.dumps({"round": r, **arm["attention"], "page": arm["page"], **arm["rate_runs"][key][-1]}),
                  flush=True)
        if args.reload:
            llms.clear()
            gc.collect()


if __name__ == "__main__":
    sys.exit(main())
