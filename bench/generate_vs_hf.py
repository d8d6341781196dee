"""Output tokens/s of tessellm's generation vs transformers' ``generate``, same model, same prompts.

What it measures
----------------
The embedded SmolLM2-135M-Instruct in float32 on the CPU, loaded twice: once as a tessellm
``LLM`` (sdpa attention, contiguous cache, static scheduler) and once as transformers'
``AutoModelForCausalLM``. A fixed set of varied prompts is tokenized once and both sides get
the identical token ids. Every prompt generates exactly ``--max-tokens`` tokens greedily
(tessellm: ``ignore_eos``; transformers: ``min_new_tokens = max_new_tokens`` and no EOS).

Two settings, each timed on both sides:

- ``batch``: all prompts as one batch. tessellm gets the list in one ``llm.generate`` call;
  transformers gets one left-padded batch with an attention mask.
- ``single``: one prompt at a time (batch size 1, no padding on either side).

The figure is output tokens / wall-clock seconds (prefill included), the median of
``--repeats`` runs after one warm-up per side; the two sides are interleaved (A, B, A, B) so
that noise from other processes on the machine hits both. The report also says how many
prompts produced identical token ids on both sides: for batch size 1 they should all agree;
a padded transformers batch can differ by float rounding, which is reported, not failed.

How to run
----------
    .venv/bin/python bench/generate_vs_hf.py                # human-readable table
    .venv/bin/python bench/generate_vs_hf.py --json         # one JSON object on stdout
    .venv/bin/python bench/generate_vs_hf.py --max-tokens 16 --num-prompts 4 --repeats 1   # quick check
    .venv/bin/python bench/generate_vs_hf.py --threads 2 --out bench.json

CPU figures are sensitive to whatever else runs on the machine: with another process busy on
the same cores a run can be many times slower, on one side and not the other. Check that the
per-repeat ``seconds`` agree (and the load averages reported) before trusting a ratio, and
compare ratios rather than absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from typing import Callable

# Set before transformers/tokenizers load: the fork-safety warning and INFO logs are noise here.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

MODEL = "smollm2-135m"

# Varied on purpose: short and long, questions, instructions, code, lists, other languages,
# so a padded batch really has padding and the prompts' lengths spread.
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain, in simple terms, why the sky is blue during the day and red at sunset.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three benefits of regular exercise:\n1.",
    "Translate to French: The cat is sleeping on the warm windowsill.",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who",
    "What is 17 multiplied by 23?",
    "Q: Who wrote 'Pride and Prejudice'?\nA:",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "SELECT name, email FROM users WHERE",
    "Give me a recipe for a simple tomato pasta sauce. Ingredients:",
    "The three laws of thermodynamics state that",
    "Hola, ¿cómo estás? Me llamo",
    "Here is a haiku about autumn leaves:",
    "In machine learning, overfitting happens when a model learns the training data too well, "
    "including its noise, and as a result it performs poorly on new, unseen data. Common ways to reduce it are",
]


# ----------------------------------------------------------------------------- setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tessellm vs transformers generate: output tokens/s (CPU, float32).")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help=f"how many of the {len(PROMPTS)} fixed prompts to use (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side and setting; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--out", metavar="FILE", help="also write the JSON object to FILE")
    args = p.parse_args(argv)
    if not 1 <= args.num_prompts <= len(PROMPTS):
        p.error(f"--num-prompts must be between 1 and {len(PROMPTS)}")
    if args.max_tokens < 1 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        p.error("--max-tokens, --repeats and --threads must be at least 1")
    return args


def quiet_libraries() -> None:
    from transformers.utils import logging as hf_logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    hf_logging.disable_progress_bar()  # the "Loading weights" bar would clutter --json output on a tty


def tokenize(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids exactly as ``LLM.encode`` makes them, so both sides see the same input."""
    if not chat:
        return [tokenizer(p)["input_ids"] for p in prompts]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def load_tessellm(batch_size: int, max_model_len: int):
    from tessellm import LLM

    # The reference plugins, sized so that the whole prompt set is one static batch.
    # max_model_len is capped to what this benchmark needs: the contiguous cache reserves a
    # max_model_len region per sequence, and the model's 8192 would allocate GiBs for nothing.
    return LLM({"model": MODEL, "device": "cpu", "dtype": "float32", "max_model_len": max_model_len,
                "attention": {"name": "sdpa"},
                "cache": {"name": "contiguous", "options": {"max_seqs": batch_size}},
                "scheduler": {"name": "static", "options": {"max_batch_size": batch_size}}})


# ----------------------------------------------------------------------------- the two sides
# Each runner takes a list of prompts (token ids) and returns one list of generated ids per prompt.


def tessellm_runner(llm, max_tokens: int) -> Callable[[list[list[int]]], list[list[int]]]:
    params = {"max_tokens": max_tokens, "ignore_eos": True}

    def run(batch: list[list[int]]) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(batch, params, progress=False)]

    return run


def transformers_runner(model, max_tokens: int, pad_id: int) -> Callable[[list[list[int]]], list[list[int]]]:
    from tessellm.bench.hf_baseline import greedy_kwargs, left_pad

    kwargs = greedy_kwargs(max_tokens, pad_id)  # every row runs to max_tokens, EOS never stops it

    def run(batch: list[list[int]]) -> list[list[int]]:
        input_ids, mask = left_pad(batch, pad_id)
        with torch.inference_mode():  # tessellm's engine runs under inference_mode too
            out = model.generate(input_ids, attention_mask=mask, **kwargs)
        return out[:, input_ids.shape[1]:].tolist()

    return run


def in_batches(run, prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Run prompts batch_size at a time (1 = one by one), outputs in prompt order."""
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        outputs.extend(run(prompts[start:start + batch_size]))
    return outputs


def timed(fn) -> tuple[float, float, list[list[int]]]:
    """Wall seconds (the figure reported) and this process's CPU seconds (all threads). On a quiet
    machine CPU seconds are about wall seconds x threads, and repeats agree closely. When other
    processes share the cores, both can balloon (OpenMP threads spin while a sibling thread is
    descheduled), so a repeat far from the others in either column was a disturbed one."""
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, outputs


# ----------------------------------------------------------------------------- measuring


def measure(runners: dict, prompts: list[list[int]], settings: dict[str, int], max_tokens: int,
            repeats: int) -> dict:
    """Time every (setting, side) ``repeats`` times, interleaving sides within each repeat."""
    # Warm-up: the first calls pay for lazy initialisation (thread pools, oneDNN primitives,
    # allocator growth), which is not generation speed. A few tokens in each shape suffice.
    warm = min(max_tokens, 8)
    for side, make in runners.items():
        run = make(warm)
        for batch_size in settings.values():
            in_batches(run, prompts[:batch_size], batch_size)

    results: dict = {name: {side: {"seconds": [], "cpu_seconds": []} for side in runners} for name in settings}
    for _ in range(repeats):
        for name, batch_size in settings.items():
            for side, make in runners.items():  # A, B, A, B, ...
                seconds, cpu_seconds, outputs = timed(lambda: in_batches(make(max_tokens), prompts, batch_size))
                entry = results[name][side]
                entry["seconds"].append(round(seconds, 4))
                entry["cpu_seconds"].append(round(cpu_seconds, 4))
                entry["outputs"] = outputs  # greedy, so every repeat gives the same ids
    for name in settings:
        for side in runners:
            entry = results[name][side]
            tokens = sum(len(o) for o in entry["outputs"])
            if tokens != max_tokens * len(prompts):  # a side stopping early would flatter its tokens/s
                raise RuntimeError(f"{side} ({name}) generated {tokens} tokens, expected {max_tokens * len(prompts)}")
            entry["output_tokens"] = tokens
            entry["median_s"] = round(statistics.median(entry["seconds"]), 4)
            entry["tokens_per_s"] = round(tokens / statistics.median(entry["seconds"]), 2)
    return results


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many prompts got identical ids, and where the others first diverge."""
    same = sum(x == y for x, y in zip(a, b))
    first_diff = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                  for x, y in zip(a, b) if x != y]
    return {"identical": same, "of": len(a), "first_divergence_at": first_diff}


# ----------------------------------------------------------------------------- reporting


def machine_info() -> dict:
    import transformers

    import tessellm
    from tessellm.bench.offline import cpu_name

    return {"platform": platform.platform(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "tessellm": tessellm.__version__,
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


FIELDS = ("tokens_per_s", "median_s", "seconds", "cpu_seconds", "output_tokens")


def build_report(args, info: dict, prompts: list[list[int]], settings: dict[str, int], results: dict,
                 llm, hf_model, max_model_len: int) -> dict:
    r = llm.pipeline.resolved
    report = {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "date": datetime.now(timezone.utc).isoformat(),
        "machine": {**info, "load_avg_1m_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None},
        "model": MODEL, "device": "cpu", "dtype": "float32",
        "max_tokens": args.max_tokens, "num_prompts": len(prompts), "repeats": args.repeats, "chat": args.chat,
        "prompt_tokens": {"total": sum(map(len, prompts)), "min": min(map(len, prompts)),
                          "max": max(map(len, prompts))},
        "tessellm_plugins": {kind: c.entry.name for kind, c in r.choices.items()},
        "tessellm_max_model_len": max_model_len,
        "transformers_attn_implementation": getattr(hf_model.config, "_attn_implementation", None),
        "settings": {},
    }
    for name, batch_size in settings.items():
        ours, theirs = results[name]["tessellm"], results[name]["transformers"]
        report["settings"][name] = {
            "batch_size": batch_size,
            "tessellm": {k: ours[k] for k in FIELDS},
            "transformers": {k: theirs[k] for k in FIELDS},
            "ratio_tessellm_over_transformers": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
            "greedy_agreement": agreement(ours["outputs"], theirs["outputs"]),
        }
    return report


def print_table(report: dict) -> None:
    m = report["machine"]
    print(f"tessellm vs transformers generate: {report['model']}, {report['dtype']}, {report['device']}")
    print(f"{report['num_prompts']} prompts ({report['prompt_tokens']['min']}-{report['prompt_tokens']['max']} "
          f"tokens), {report['max_tokens']} output tokens each, median of {report['repeats']}")
    print(f"{m['cpu']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads), {m['platform']}")
    print(f"python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, tessellm {m['tessellm']}")
    print(f"load avg (1 min) {m['load_avg_1m_at_start']} at start, {m['load_avg_1m_at_end']} at end")
    print(f"tessellm plugins: {', '.join(f'{k} {v}' for k, v in report['tessellm_plugins'].items())}")
    print()
    print(f"{'setting':<8} {'batch':>5} {'tessellm tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}  greedy agree")
    for name, s in report["settings"].items():
        agree = s["greedy_agreement"]
        print(f"{name:<8} {s['batch_size']:>5} {s['tessellm']['tokens_per_s']:>15.2f} "
              f"{s['transformers']['tokens_per_s']:>19.2f} {s['ratio_tessellm_over_transformers']:>7.3f}  "
              f"{agree['identical']}/{agree['of']}")
    print()
    print(f"{report['date']}  $ {report['command']}")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from tessellm.bench.hf_baseline import load_transformers, pad_token_id
    from tessellm.core.model.loader import model_folder, resolve_model

    folder = model_folder(resolve_model(MODEL))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = tokenize(tokenizer, PROMPTS[:args.num_prompts], args.chat)
    # Room for the longest prompt plus its output, rounded up to a multiple of 64.
    max_model_len = -(-(max(map(len, prompts)) + args.max_tokens) // 64) * 64
    info = machine_info()

    llm = load_tessellm(len(prompts), max_model_len)
    hf_model = load_transformers(folder, torch.float32, "cpu")
    pad_id = pad_token_id(tokenizer)
    runners = {"tessellm": lambda n: tessellm_runner(llm, n),
               "transformers": lambda n: transformers_runner(hf_model, n, pad_id)}
    settings = {"batch": len(prompts), "single": 1}

    results = measure(runners, prompts, settings, args.max_tokens, args.repeats)
    report = build_report(args, info, prompts, settings, results, llm, hf_model, max_model_len)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
