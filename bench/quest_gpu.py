"""The GPU checks of `quest` in one run: every part a child process under its own time limit,
so a part that hangs or fails loses only itself, and a summary of each target met or missed.

Parts (each writes its JSON into ``--out``):

- ``layer``: one layer's decode attention, Llama-3.2-1B's attention shape, budget
  2048, pages of 4, at 32k and 128k tokens, graph-replayed and timed with CUDA events
  (bench/quest.py): `flash`'s split-K decode against `quest`, and `quest`'s page scores,
  top-K and page tables alone (their share of its time);
- ``layer-pages``: the same at 128k for pages of 2, 8 and 16;
- ``e2e``: Llama-3.2-1B shapes, bf16 (bench/quest_e2e.py): time to first token
  at 8k, 32k and 128k and time per output token at each, `flash` against `quest` (pages of
  4); then decode rates of 16 and 64 sequences at 32k tokens (their K/V written straight into
  the cache), and whether `quest`'s decode steps replayed CUDA graphs;
- ``e2e-page-N``: a 128k prompt and 16 tokens through `quest` with pages of N (16, 8,
  2), each under ``--page-limit`` seconds: every page size the cache offers works at 128k.

How to run
----------
    python bench/quest_gpu.py --out /tmp/quest        # on the GPU machine (bench/gpu_checks.sh quest)
    python bench/quest_gpu.py --smoke --out /tmp/q    # a rehearsal on a CPU: tiny shapes, same parts
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).parent


def parts(smoke: bool, model: str) -> list[tuple[str, list[str], int]]:
    """(name, the script and its arguments, seconds allowed) of every part, in order."""
    if smoke:
        layer = ["quest.py", "--contexts", "512", "--budgets", "64", "--reps", "1", "--no-dense"]
        return [("layer", layer + ["--pages", "4"], 300),
                ("layer-pages", layer + ["--pages", "2", "16"], 300),
                ("e2e", ["quest_e2e.py", "--smoke", "--model-dir", model], 600),
                ("e2e-page-2", ["quest_e2e.py", "--smoke", "--no-dense", "--pages", "2", "--model-dir", model], 300)]
    layer = ["quest.py", "--budgets", "2048", "--no-dense", "--reps", "100"]
    e2e = ["quest_e2e.py", "--model-dir", model]
    return [("layer", layer + ["--contexts", "32768", "131072", "--pages", "4"], 45),
            ("layer-pages", layer + ["--contexts", "131072", "--pages", "2", "8", "16"], 35),
            ("e2e", e2e + ["--contexts", "8192", "32768", "131072", "--new-tokens", "32", "--pages", "4",
                           "--concurrent", "16", "64", "--concurrent-context", "32768", "--rate-steps", "10"], 100),
            *[(f"e2e-page-{p}", e2e + ["--contexts", "131072", "--new-tokens", "16", "--no-dense", "--pages", str(p)],
               40) for p in (16, 8, 2)]]


def build(folder: str, smoke: bool) -> None:
    """The e2e parts' model, once: Llama-3.2-1B's shapes in bf16 (positions for 128k and the
    tokens after), or the tiny smoke model in float32."""
    import torch

    sys.path.insert(0, str(BENCH))
    from e2e_gpu import LLAMA_32_1B, TINY, build_model

    shapes = dict(TINY) if smoke else dict(LLAMA_32_1B, max_position_embeddings=131072 + 256)
    build_model(Path(folder), shapes, torch.float32 if smoke else torch.bfloat16)


def run_part(name: str, argv: list[str], limit: int, out: Path) -> dict:
    path = out / f"quest_{name}.json"
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(BENCH / argv[0]), *argv[1:], "--json", str(path)],
                              capture_output=True, text=True, timeout=limit)
        status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        log = done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status = f"no result within {limit} s"
        log = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    (out / f"quest_{name}.log").write_text(log)
    seconds = round(time.perf_counter() - start, 1)
    print(json.dumps({"part": name, "status": status, "seconds": seconds}), flush=True)
    if status != "ok":
        print(log[-1500:], flush=True)
    return {"status": status, "seconds": seconds,
            "report": json.loads(path.read_text()) if path.exists() and status == "ok" else None}


def tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def targets(results: dict) -> dict:
    """Each QUEST GPU figure beside its target: {name: {"value", "target", "met"}}."""
    out = {}

    def put(name: str, value, target: str, met: bool) -> None:
        out[name] = {"value": value, "target": target, "met": bool(met)}

    layer = (results.get("layer") or {}).get("report")
    for p in (layer or {}).get("points", []):
        c, budget = tokens(p["context"]), next(k.split("_")[1] for k in p if k.endswith("_select_ms"))
        speedup, share = p.get(f"speedup_vs_flash_{budget}"), p[f"quest_{budget}_select_share"]
        if speedup is not None:
            want = 4 if p["context"] <= 32768 else 8
            put(f"2: layer speedup vs flash at {c}", speedup, f">= {want}", speedup >= want)
        put(f"2: score+select share of quest at {c}", share, "<= 0.25", share <= 0.25)
    e2e = (results.get("e2e") or {}).get("report")
    if e2e:
        arm = next(a for a in e2e["arms"] if a["attention"]["name"] == "quest")
        for context, row in arm["results"].items():
            c = tokens(int(context))
            put(f"1: TTFT quest / flash at {c}", row.get("ttft_ratio"), "<= 1.1", (row.get("ttft_ratio") or 9) <= 1.1)
            speedup = round(1 / row["tpot_ratio"], 3) if row.get("tpot_ratio") else None
            want = 1.5 if int(context) >= 131072 else 1.1
            put(f"3: TPOT speedup vs flash at {c}", speedup, f">= {want}", (speedup or 0) >= want)
        for rate in arm.get("rates", []):
            put(f"3: decode rate vs flash, {rate['sequences']} x {tokens(rate['context'])}", rate.get("rate_ratio"),
                ">= 2", (rate.get("rate_ratio") or 0) >= 2)
            put(f"3: quest decode steps replay CUDA graphs ({rate['sequences']} seqs)", rate["cuda_graphs"], "true",
                rate["cuda_graphs"])
    for name, result in results.items():
        if name.startswith("e2e-page-") or name == "layer-pages":
            put(f"4: {name} completes", result["status"], "ok", result["status"] == "ok")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a folder for every part's JSON and log, and summary.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU: the same parts, code paths only")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as model:
        start = time.perf_counter()
        build(model, args.smoke)
        print(json.dumps({"part": "build the model", "seconds": round(time.perf_counter() - start, 1)}), flush=True)
        for name, part_argv, limit in parts(args.smoke, model):
            results[name] = run_part(name, part_argv, limit, out)
    summary = {"command": "python bench/quest_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "parts": {k: {"status": v["status"], "seconds": v["seconds"]} for k, v in results.items()},
               "targets": targets(results)}
    (out / "quest_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if all(v["status"] == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
