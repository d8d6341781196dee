"""One mixture-of-experts layer (core/model/moe.py) timed in its two forms: the grouped path
(experts stacked, tokens sorted by expert, one batched product per projection) against the
reference (one expert at a time over its tokens).

What it measures
----------------
One ``MoE.forward`` (router, routed experts, shared experts if any) on ``T`` tokens of
hidden states, at layer shapes scaled down from released models so a 2-core CPU runs them
in seconds (``--shapes``; the full-size figures in brackets):

- ``mixtral``: Mixtral-8x7B's routing, top-2 of 8 softmax renormalised, hidden 1024 and
  expert width 1792 (4096, 14336);
- ``qwen3-moe``: Qwen3-30B-A3B's, top-8 of 128 renormalised, hidden 512 and width 192
  (2048, 768);
- ``deepseek``: DeepSeek-V3's, sigmoid scores with a correction bias, top-8 of 64 in 8
  groups of which 4 are kept (noaux_tc), weights renormalised and scaled by 2.5, one shared
  expert; hidden 512 and width 256 (7168, 2048; 256 experts).

Per shape and token count (``--tokens``, default 1, 16, 128, 512): ``reference_ms`` and
``grouped_ms`` (medians over ``--reps`` samples after a warm-up, the two forms taking
turns; on CUDA each sample averages ``--inner`` back-to-back calls), ``speedup`` =
reference_ms / grouped_ms, how many experts the tokens used (``experts_used``) and the
grouped batch's padding (``pad``: its rows, the experts in the batch x the busiest
expert's count, over the T x top_k rows there is work for; all experts enter the batch
once more than a third have tokens). Both forms run on the same weights (random, seed 0,
each matrix scaled by 1/sqrt(fan-in)); their outputs are compared (``max_abs_diff``,
``agree``): a disagreement is flagged in the table and the exit status is 1. float32 by
default (``--dtype``), on CUDA when there is one, else the CPU (``--device``).

``--smoke``: tiny shapes on the CPU in seconds, to check the script runs.

How to run
----------
    python bench/moe.py --json moe_cpu.json                       # every shape, tokens 1,16,128,512
    python bench/moe.py --shapes mixtral --tokens 1,512 --reps 9  # one shape, two points
    python bench/moe.py --smoke --json /tmp/moe_smoke.json        # tiny, code path only
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from tessellm.core.model.moe import MoE, _batch_experts
from tessellm.core.model.spec import ModelSpec, MoESpec

SHAPES: dict[str, dict] = {
    "mixtral": dict(hidden=1024, num_experts=8, top_k=2, intermediate_size=1792, norm_topk_prob=True),
    "qwen3-moe": dict(hidden=512, num_experts=128, top_k=8, intermediate_size=192, norm_topk_prob=True),
    "deepseek": dict(hidden=512, num_experts=64, top_k=8, intermediate_size=256, shared_intermediate_size=256,
                     scoring="sigmoid", topk_method="noaux_tc", num_groups=8, topk_group=4, norm_topk_prob=True,
                     routed_scaling_factor=2.5, score_bias=True),
}
"""Layer shapes timed by default: ``hidden`` and MoESpec's fields."""

SMOKE_SHAPES: dict[str, dict] = {
    "mixtral": dict(hidden=64, num_experts=8, top_k=2, intermediate_size=96, norm_topk_prob=True),
    "deepseek": dict(hidden=64, num_experts=16, top_k=4, intermediate_size=32, shared_intermediate_size=32,
                     scoring="sigmoid", topk_method="noaux_tc", num_groups=4, topk_group=2, norm_topk_prob=True,
                     routed_scaling_factor=2.5, score_bias=True),
}
"""The shapes ``--smoke`` times: the routed-only and the shared-expert, grouped-routing kinds."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fns: dict[str, Callable[[], object]], device: torch.device, reps: int, inner: int,
              warmup: int) -> dict[str, float]:
    """Per function, the median over ``reps`` samples of its time in milliseconds, each
    sample ``inner`` back-to-back calls averaged, after ``warmup`` calls. The functions take
    turns sample by sample, so a change in the machine's load reaches all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def describe(device: torch.device) -> str:
    from tessellm.bench.offline import describe_device

    return describe_device(device)


def command_line(argv: list[str] | None) -> str:
    """The command as typed (``main``'s arguments as if typed when called from Python)."""
    if argv is None:
        return shlex.join(["python", *sys.argv])
    return shlex.join(["python", "bench/moe.py", *argv])


# ---------------------------------------------------------------- one layer


def layer_spec(shape: dict) -> ModelSpec:
    """A one-layer ModelSpec around ``shape``'s MoE: the block reads only the hidden size,
    the MLP bias flag and the MoESpec."""
    fields = {k: v for k, v in shape.items() if k != "hidden"}
    moe = MoESpec(sparse_layers=frozenset({0}), **fields)
    hidden = shape["hidden"]
    return ModelSpec(model_type="bench", vocab_size=1, hidden_size=hidden, intermediate_size=moe.intermediate_size,
                     num_layers=1, num_heads=1, num_kv_heads=1, head_dim=hidden, rms_norm_eps=1e-6,
                     max_position_embeddings=1, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                     mlp_bias=False, sliding_window=None, rope_type="default", hf_config=None, moe=moe)


def build_layer(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> MoE:
    """The MoE block of ``shape`` with random weights (each matrix N(0, 1/fan-in), the score
    bias N(0, 0.01^2), small as a trained one's), experts stacked: ``grouped`` picks the form."""
    torch.manual_seed(seed)
    moe = MoE(layer_spec(shape))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
        for b in moe.buffers():
            b.normal_(0, 0.01)
    moe = moe.to(device=device, dtype=dtype).eval()
    moe.stack_experts()
    assert moe.grouped, "the bench layer's experts must stack"
    return moe


def routing_stats(moe: MoE, x: torch.Tensor) -> dict:
    """How the tokens spread over the experts: how many are used, and the grouped batch's
    rows (experts in the batch x the busiest one's count) over the rows with work."""
    ids, _ = moe.gate(x)
    counts = torch.bincount(ids.reshape(-1), minlength=moe.gate.weight.shape[0])
    batch = _batch_experts(counts, moe._stacked)[1][0].shape[0]  # experts in the batched products
    return {"experts_used": int((counts > 0).sum()), "pad": round(batch * int(counts.max()) / ids.numel(), 2)}


def agrees(diff: float, scale: float, dtype: torch.dtype) -> bool:
    """Whether a max abs difference is rounding: relative to the output's largest value,
    1e-4 in float32, 2e-2 in 16-bit types."""
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    return diff <= rtol * max(scale, 1e-3)


def layer_point(name: str, moe: MoE, tokens: int, args: argparse.Namespace, dtype: torch.dtype,
                device: torch.device) -> dict:
    """Both forms' time at ``tokens`` tokens, and whether their outputs agree."""
    x = torch.randn(tokens, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
    x = x.to(device=device, dtype=dtype)
    cuda = device.type == "cuda"
    inner, warmup = (args.inner, 3) if cuda else (1, 2)
    forms = {form: _form_call(moe, x, form == "grouped") for form in ("reference", "grouped")}
    with torch.no_grad():
        outputs = {form: call() for form, call in forms.items()}
        times = median_ms(forms, device, args.reps, inner, warmup)
    moe.grouped = True
    scale = float(outputs["reference"].float().abs().max())
    diff = float((outputs["grouped"].float() - outputs["reference"].float()).abs().max())
    with torch.no_grad():
        stats = routing_stats(moe, x)
    return {"shape": name, "tokens": tokens, "reference_ms": round(times["reference"], 4),
            "grouped_ms": round(times["grouped"], 4), "speedup": round(times["reference"] / times["grouped"], 3),
            **stats, "max_abs_diff": diff, "max_abs_out": scale, "agree": agrees(diff, scale, dtype)}


def _form_call(moe: MoE, x: torch.Tensor, grouped: bool) -> Callable[[], torch.Tensor]:
    """One forward of ``moe`` on ``x`` in the grouped form or the reference."""

    def call() -> torch.Tensor:
        moe.grouped = grouped
        return moe(x)

    return call


def run(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> dict:
    """The report's shapes and points: every shape at every token count."""
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    chosen = {name: shapes[name] for name in (args.shapes or shapes)}
    points = []
    for name, shape in chosen.items():
        moe = build_layer(shape, dtype, device)
        for tokens in args.tokens:
            points.append(layer_point(name, moe, tokens, args, dtype, device))
            print(json.dumps(points[-1]), file=sys.stderr, flush=True)  # kept if a later point fails
        del moe
    return {"shapes": chosen, "points": points}


def table(report: dict) -> str:
    """The points as a text table."""
    cols = ["shape", "tokens", "reference_ms", "grouped_ms", "speedup", "experts_used", "pad", "max_abs_diff", "agree"]
    rows = [[_cell(p, c) for c in cols] for p in report["points"]]
    head = (f"MoE layer forward, {report['dtype']}, {report['device']}, {report['threads']} threads; "
            f"median of {report['reps']}")
    return head + "\n" + format_table(cols, rows)


def _cell(point: dict, col: str) -> str:
    if col == "agree":
        return "yes" if point["agree"] else "MISMATCH"
    if col == "max_abs_diff":
        return f"{point[col]:.1e}"
    return str(point[col])


def format_table(cols: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)] if rows else [len(c) for c in cols]
    line = lambda cells: "  ".join(s.rjust(w) for s, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(cols), *(line(r) for r in rows)])


# ---------------------------------------------------------------- main


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=lambda s: [x for x in s.split(",") if x], default=None,
                    help=f"comma-separated layer shapes (default: all of {', '.join(SHAPES)})")
    ap.add_argument("--tokens", type=int_list, default=None,
                    help="comma-separated token counts (default: 1,16,128,512)")
    ap.add_argument("--reps", type=int, default=None, help="timed samples per form (default: 9 on a CPU, 20 on CUDA)")
    ap.add_argument("--inner", type=int, default=10, help="calls averaged per sample on CUDA")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when there is one")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds: checks the code path")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    known = SMOKE_SHAPES if args.smoke else SHAPES
    unknown = [s for s in args.shapes or [] if s not in known]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.smoke:
        args.device = "cpu"
        args.tokens = args.tokens or [1, 16]
        args.reps = args.reps or 2
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if cuda else "cpu"
    args.tokens = args.tokens or [1, 16, 128, 512]
    args.reps = args.reps or (20 if cuda else 9)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    report = {"command": command_line(argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": describe(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "dtype": args.dtype, "reps": args.reps, "smoke": args.smoke}
    report.update(run(args, dtype, device))
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(p["agree"] for p in report["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
