"""What structured outputs cost: generated tokens/s of the `mixed` workload with every request
constrained by a JSON schema, against the same requests unconstrained, in one process.

What it measures
----------------
The requests are ``tessellm bench --workload mixed``'s (``tessellm.bench.workloads``: random
ordinary-token prompts and log-normal output lengths, seed ``--seed``), each output cut to
``--max-tokens`` if given. Both sides run them as one batch through ``LLM.generate`` on one
pipeline, sampling at ``--temperature`` with request i seeded ``--seed + i`` and
``ignore_eos``; the constrained side adds ``structured_output=GrammarSpec.schema(...)`` to
every request, nothing else changes. The schema is an object holding an array of
``{"name": string (at most 24 characters), "qty": integer}`` items with ``minItems`` (default:
half the longest output length, plus one): no output can complete its JSON before its
``max_tokens``, so both sides generate exactly the same number of tokens per request and
the batch shrinks alike (``lengths_match`` checks it; ``--min-items`` lower lets outputs end).

Runs alternate, ``--repeats`` of each: U C, C U, U C, ... Every run starts with an empty
prefix cache and fresh engine stats, after one warm-up of each side.

- headline: ``ratio`` = median constrained / median unconstrained generated tokens/s (all
  output tokens over the wall time of the whole ``generate`` call); the target is >= 0.90;
- per side: mean output tokens, steps, step time (the engine's ``step_seconds``), TPOT;
- the grammar's host cost per engine step, from timing wrappers set on this pipeline's
  objects (no core code changed): ``fill`` (``GrammarSession.fill`` less the backend's
  ``apply_mask``: the matchers writing their bitmasks and the buffer; the logits copy is the
  engine's, shared by every logits processor),
  ``apply_mask`` (the bitmask to the device and onto the logits; on CUDA this includes
  waiting for the step's forward, which the copy queues behind), ``accept`` (advancing the
  matchers and checking for completion, per generated token);
- compile time of the schema through the pipeline's grammar backend: the first compile in
  the process, the median of three fresh variants (a different ``title`` each, so none is
  cached) and the median cached call; the runs then find it cached, as a server's would;
- constrained outputs: finish reasons, whether the ones the grammar ended parse and fit the
  schema, the share of whitespace in their text and a sample. The pipeline's grammar options
  apply as configured: where ``any_whitespace`` allows blanks between JSON elements a small
  model may spend most of its tokens on them (``--set grammar.options.any_whitespace=...``).

Where the pipeline schedules asynchronously (CUDA's default), constrained requests take the
synchronous step (their tokens are picked on the host, after the mask): ``overlapped_steps``
shows what each side kept, and the ratio includes that loss.

How to run
----------
    .venv/bin/python bench/structured_outputs.py --json so_cpu.json       # CPU: 16 requests, 3 repeats each
    python bench/structured_outputs.py --num-requests 256 --json so_gpu.json   # CUDA (the config's device: auto)
    .venv/bin/python bench/structured_outputs.py --num-requests 4 --max-tokens 32 --repeats 1   # the code path
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import statistics
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from tessellm import LLM
from tessellm.bench.offline import describe_device, request_limit, summarize, warm_up
from tessellm.bench.workloads import get_workload
from tessellm.core.config import default_config_data
from tessellm.core.engine.stats import EngineStats
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.core.interfaces.sequence import SamplingParams

NAME_MAX = 24
TARGET_RATIO = 0.90
SIDES = ("unconstrained", "constrained")


def items_schema(min_items: int, title: str | None = None) -> dict:
    """An object with one array of ``{"name", "qty"}`` items, at least ``min_items`` of them."""
    item = {"type": "object", "properties": {"name": {"type": "string", "maxLength": NAME_MAX},
                                             "qty": {"type": "integer"}}, "required": ["name", "qty"]}
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": item, "minItems": min_items}},
              "required": ["items"]}
    return schema if title is None else {"title": title, **schema}


def check_output(text: str, min_items: int) -> str:
    """``valid``, ``not JSON`` or ``off schema`` for a completed constrained output."""
    try:
        value = json.loads(text)
    except ValueError:
        return "not JSON"
    items = value.get("items") if isinstance(value, dict) else None
    fits = (isinstance(items, list) and set(value) == {"items"} and len(items) >= min_items
            and all(isinstance(i, dict) and set(i) == {"name", "qty"} and isinstance(i["name"], str)
                    and len(i["name"]) <= NAME_MAX and type(i["qty"]) is int for i in items))
    return "valid" if fits else "off schema"


class GrammarClock:
    """Seconds spent in the engine's grammar calls, by bucket, from wrappers set on the
    instances (``GrammarSession.fill`` / ``accept`` / ``is_complete`` and the backend's
    ``apply_mask``); removed on exit, so the class methods answer again."""

    def __init__(self, llm: LLM):
        self.session = llm.engine.grammar
        self.backend = self.session.backend
        self.seconds: dict[str, float] = {}
        self.reset()

    def reset(self) -> None:
        self.seconds = {"fill": 0.0, "apply_mask": 0.0, "accept": 0.0}

    def _timed(self, bucket: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - start
        return wrapper

    def __enter__(self) -> "GrammarClock":
        for obj, name, bucket in self._targets():
            setattr(obj, name, self._timed(bucket, getattr(obj, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, name, _ in self._targets():
            delattr(obj, name)

    def _targets(self) -> list[tuple[Any, str, str]]:
        return [(self.session, "fill", "fill"), (self.backend, "apply_mask", "apply_mask"),
                (self.session, "accept", "accept"), (self.session, "is_complete", "accept")]

    def per_step_ms(self, steps: int) -> dict[str, float]:
        s = self.seconds
        ms = {"fill": s["fill"] - s["apply_mask"], "apply_mask": s["apply_mask"], "accept": s["accept"]}
        ms["total"] = sum(ms.values())
        return {k: round(v * 1e3 / max(steps, 1), 4) for k, v in ms.items()}


def compile_times(backend: Any, min_items: int) -> dict[str, Any]:
    """The benchmark schema's first compile, three fresh variants' and the cached call's."""
    def ms(spec: GrammarSpec) -> float:
        start = time.perf_counter()
        backend.compile(spec)
        return (time.perf_counter() - start) * 1e3

    first = ms(GrammarSpec.schema(items_schema(min_items)))
    fresh = [ms(GrammarSpec.schema(items_schema(min_items, title=f"fresh-{i}"))) for i in range(3)]
    cached = [ms(GrammarSpec.schema(items_schema(min_items))) for _ in range(200)]
    return {"first_ms": round(first, 3), "fresh_ms": round(statistics.median(fresh), 3),
            "fresh_ms_each": [round(x, 3) for x in fresh], "cached_us": round(statistics.median(cached) * 1e3, 3)}


def timed_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], clock: GrammarClock) -> dict:
    """One ``generate`` of the whole batch from an empty prefix cache and fresh stats."""
    reset = getattr(llm.pipeline.cache, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    llm.engine.stats = EngineStats()
    clock.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats
    lens = [len(o.token_ids) for o in outs]
    tpot = [(o.e2e_s - o.ttft_s) / (n - 1) for o, n in zip(outs, lens) if o.ttft_s is not None and n > 1]
    return {"elapsed_s": round(elapsed, 4), "generated_tokens": sum(lens),
            "tokens_per_s": round(sum(lens) / elapsed, 3), "steps": stats.steps,
            "step_ms": summarize(list(stats.step_seconds)), "tpot_ms": summarize(tpot),
            "overlapped_steps": stats.overlapped_steps, "grammar_ms_per_step": clock.per_step_ms(stats.steps),
            "output_lens": lens, "finish_reasons": [o.finish_reason for o in outs], "texts": [o.text for o in outs]}


def side_summary(runs: list[dict]) -> dict:
    med = lambda key: round(statistics.median(key(r) for r in runs), 4)  # noqa: E731
    return {"tokens_per_s": {"per_run": [r["tokens_per_s"] for r in runs], "median": med(lambda r: r["tokens_per_s"])},
            "elapsed_s_median": med(lambda r: r["elapsed_s"]),
            "mean_output_tokens": round(statistics.mean(n for r in runs for n in r["output_lens"]), 3),
            "steps_median": med(lambda r: r["steps"]),
            "step_ms_mean_median": med(lambda r: r["step_ms"]["mean"]),
            "tpot_ms_p50_median": med(lambda r: r["tpot_ms"]["p50"] or 0.0),
            "overlapped_steps_median": med(lambda r: r["overlapped_steps"]),
            "grammar_ms_per_step_median": {k: med(lambda r: r["grammar_ms_per_step"][k])
                                           for k in runs[0]["grammar_ms_per_step"]},
            "finish_reasons": dict(Counter(f for r in runs for f in r["finish_reasons"]))}


def command_line(argv: list[str] | None) -> str:
    return shlex.join(["python", *sys.argv] if argv is None else ["python", "bench/structured_outputs.py", *argv])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="the config's model (default smollm2-135m)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per run (default 16 on a CPU, 128 on CUDA)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="cut every output length to this (default: the workload's own, up to 512)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved (default 3)")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of both sides (default 0.8)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed; request i samples with seed + i (default 0)")
    ap.add_argument("--min-items", type=int, default=None,
                    help="the schema's minItems (default: longest output length // 2 + 1, so none completes early)")
    ap.add_argument("--workload-set", dest="workload_overrides", metavar="KEY=VALUE", action="append", default=[],
                    help="override a mixed-workload parameter, as tessellm bench (repeatable)")
    ap.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                    help="override a pipeline config field, e.g. --set device=cuda (repeatable; YAML values)")
    ap.add_argument("--json", metavar="PATH", help="write the report here too")
    args = ap.parse_args(argv)
    for flag in ("num_requests", "max_tokens", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.min_items is not None and args.min_items < 0:
        ap.error("--min-items must be 0 or more")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json: the folder of {args.json!r} does not exist")
    args.error = ap.error
    return args


def format_report(r: dict) -> str:
    u, c = r["unconstrained"], r["constrained"]
    rows = [("generated tokens/s (median)", lambda s: s["tokens_per_s"]["median"]),
            ("mean output tokens", lambda s: s["mean_output_tokens"]),
            ("steps (median)", lambda s: s["steps_median"]),
            ("step ms (mean; median of runs)", lambda s: s["step_ms_mean_median"]),
            ("TPOT ms p50 (median of runs)", lambda s: s["tpot_ms_p50_median"])]
    lines = [f"structured outputs on {r['device']}: mixed, {r['workload']['num_requests']} requests, "
             f"{r['repeats']} repeats ({' '.join(r['order'])}), schema minItems {r['min_items']}",
             f"{'':32}{'unconstrained':>15}{'constrained':>15}"]
    lines += [f"{name:32}{get(u):>15.4g}{get(c):>15.4g}" for name, get in rows]
    g = c["grammar_ms_per_step_median"]
    lines.append(f"grammar host ms/step: fill {g['fill']:.3g}, apply_mask {g['apply_mask']:.3g}, "
                 f"accept {g['accept']:.3g}; total {g['total']:.3g} of {c['step_ms_mean_median']:.3g}")
    k = r["compile"]
    lines.append(f"schema compile: first {k['first_ms']:.3g} ms, fresh {k['fresh_ms']:.3g} ms, "
                 f"cached {k['cached_us']:.3g} us")
    o = r["constrained_outputs"]
    lines.append(f"constrained outputs: finish {c['finish_reasons']}; completed ones: {o['checks'] or 'none'}; "
                 f"lengths match: {r['lengths_match']}")
    lines.append(f"ratio constrained / unconstrained (generated tokens/s): {r['ratio']:.4g} "
                 f"(target >= {TARGET_RATIO})")
    lines.append(f"{r['date']}  $ {r['command']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        workload = get_workload("mixed", args.workload_overrides)
        llm = LLM({**default_config_data(), "model": args.model}, overrides=args.overrides)
    except ConfigError as exc:
        args.error(str(exc))
    backend = llm.pipeline.grammar
    if backend is None:
        args.error("this pipeline has no grammar backend (pip install xgrammar, or --set grammar.name=...)")
    device = llm.pipeline.resolved.device
    num = args.num_requests or (128 if device.type == "cuda" else 16)
    requests = workload.requests(seed=args.seed, num_requests=num, tokenizer=llm.tokenizer,
                                 max_model_len=request_limit(llm), vocab_size=llm.pipeline.spec.vocab_size,
                                 encode=llm.encode)
    lens = [min(r.output_len, args.max_tokens or r.output_len) for r in requests]
    min_items = args.min_items if args.min_items is not None else max(lens) // 2 + 1
    compiled = compile_times(backend, min_items)  # before any request: the first compile is a real one
    spec = GrammarSpec.schema(items_schema(min_items))
    prompts = [r.prompt_token_ids for r in requests]
    params = {side: [SamplingParams(max_tokens=n, temperature=args.temperature, seed=args.seed + i, ignore_eos=True,
                                    structured_output=spec if side == "constrained" else None)
                     for i, n in enumerate(lens)] for side in SIDES}
    warm_up(llm, requests)
    llm.generate([r.prompt_token_ids[:16] for r in requests[:2]],  # the constrained path's first calls
                 [p.model_copy(update={"max_tokens": 4}) for p in params["constrained"][:2]], progress=False)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    order = []
    with GrammarClock(llm) as clock:
        for i in range(args.repeats):
            sides = SIDES if i % 2 == 0 else SIDES[::-1]
            order.append("".join(s[0].upper() for s in sides))
            for side in sides:
                runs[side].append(timed_run(llm, prompts, params[side], clock))
                print(f"repeat {i} {side}: {runs[side][-1]['tokens_per_s']:.1f} generated tokens/s",
                      file=sys.stderr, flush=True)
    u, c = side_summary(runs["unconstrained"]), side_summary(runs["constrained"])
    texts = runs["constrained"][-1]["texts"]
    completed = [t for r in runs["constrained"] for t, f in zip(r["texts"], r["finish_reasons"]) if f == "stop"]
    report = {
        "command": command_line(argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": describe_device(device), "torch": torch.__version__,
        "xgrammar": importlib.metadata.version("xgrammar") if backend.name == "xgrammar" else None,
        "model": args.model, "pipeline": json.loads(json.dumps(llm.pipeline.resolved.summary(), default=str)),
        "workload": workload.describe(args.seed, len(requests)), "max_tokens": args.max_tokens,
        "temperature": args.temperature, "repeats": args.repeats, "order": order,
        "min_items": min_items, "schema": items_schema(min_items),
        "headline": "ratio: median constrained / median unconstrained generated tokens/s over the whole batch "
                    f"(target >= {TARGET_RATIO})",
        "ratio": round(c["tokens_per_s"]["median"] / u["tokens_per_s"]["median"], 4),
        "lengths_match": all(a["output_lens"] == b["output_lens"]
                             for a in runs["unconstrained"] for b in runs["constrained"]),
        "unconstrained": u, "constrained": c, "compile": compiled,
        "constrained_outputs": {
            "checks": dict(Counter(check_output(t, min_items) for t in completed)),
            "whitespace_share": round(sum(ch.isspace() for t in texts for ch in t) / max(1, sum(map(len, texts))), 4),
            "sample": texts[0][:240]},
        "runs": {side: [{k: v for k, v in r.items() if k != "texts"} for r in rs] for side, rs in runs.items()},
    }
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
