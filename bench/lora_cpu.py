"""Where the torch LoRA kernel's time goes on a CPU (docs/benchmarks.md, "LoRA adapters"):

1. one projection, both forms of the torch kernel (stacked: one shrink and expand over every
   slot; grouped: rows gathered per slot) against the base projection, at several row counts,
   rows dealt to ``--slots`` adapters in turn;
2. one decode forward of the embedded SmolLM2 over ``--seqs`` sequences, without adapters and
   with the adapters in ``--adapters`` (made by bench/lora_adapters.py) dealt in turn.

    python bench/lora_adapters.py --out /tmp/smollm2-loras --count 4 --rank 16
    python bench/lora_cpu.py --adapters /tmp/smollm2-loras --json bench/results/lora_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tessellm.bench.offline import describe_device
from tessellm.core.interfaces.lora import LoraMapping, LoraWeights
from tessellm.plugins.lora.torch_ref import TorchLora


def timed(fn, repeats: int) -> float:
    """Mean microseconds of ``fn()`` over ``repeats`` calls, after a few untimed ones."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def projection_rows(slots: int, rank: int, k: int, n: int, rows_list: list[int], repeats: int) -> list[dict]:
    """Per row count: the base projection, and the kernel's stacked and grouped forms."""
    g = torch.Generator().manual_seed(0)
    weights = LoraWeights(torch.randn(slots, rank, k, generator=g), torch.randn(slots, n, rank, generator=g))
    base = torch.randn(n, k, generator=g)
    cpu, f32 = torch.device("cpu"), torch.float32
    kernels = {form: type(form, (TorchLora,), {"stacked_row_slots": limit})(TorchLora.Options(), cpu, f32)
               for form, limit in (("stacked", 1 << 30), ("grouped", 0))}
    out = []
    for rows in rows_list:
        x, y = torch.randn(rows, k, generator=g), torch.zeros(rows, n)
        seq_slots = [i % slots for i in range(rows)]
        slot_t = torch.tensor(seq_slots, dtype=torch.int32)
        mapping = LoraMapping(slot_t, slot_t.long(), torch.arange(rows + 1, dtype=torch.int32), seq_slots,
                              list(range(rows + 1)), slots, 1)
        row = {"rows": rows, "base_us": round(timed(lambda: torch.nn.functional.linear(x, base), repeats), 1)}
        for form, kernel in kernels.items():
            plan = kernel.plan(mapping)
            row[f"{form}_us"] = round(timed(lambda: kernel.apply(y, x, weights, plan), repeats), 1)
        out.append(row)
    return out


def decode_forward(adapters: Path, seqs: int, repeats: int) -> dict:
    """Milliseconds of one decode forward of ``seqs`` sequences, without and with adapters."""
    from tessellm import LLM
    from tessellm.core.engine.batch_builder import build_batch
    from tessellm.core.interfaces.batch import ScheduledSeq
    from tessellm.core.interfaces.sequence import SamplingParams

    names = sorted(p.name for p in adapters.iterdir() if (p / "adapter_config.json").is_file())
    llm = LLM({"device": "cpu", "dtype": "float32",
               "lora": {"adapters": {n: str(adapters / n) for n in names}, "max_loras": max(1, len(names))}})
    engine = llm.engine
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    for i in range(seqs):
        engine.add_request(f"r{i}", list(range(100 + i, 160 + i)), params, lora=names[i % len(names)])
    while sum(1 for s in engine.scheduler.running_sequences() if s.num_output_tokens) < seqs:
        engine.step()
    running = list(engine.scheduler.running_sequences())
    slots = [s.lora_slot for s in running]
    for s in running:  # rerun the last decode position: the same cache slots each time
        s.num_computed_tokens -= 1
    result = {}
    for label, use in (("base_ms", False), ("lora_ms", True)):
        for s, slot in zip(running, slots):
            s.lora_slot = slot if use else -1
        batch = build_batch([ScheduledSeq(s, 1) for s in running], engine.cache, torch.device("cpu"))
        result[label] = round(timed(lambda b=batch: engine.runner.forward(b), repeats) / 1e3, 2)
    for s, slot in zip(running, slots):
        s.lora_slot, s.num_computed_tokens = slot, s.num_computed_tokens + 1
    return {"seqs": seqs, "adapters": names, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=Path, help="a folder of adapters (bench/lora_adapters.py --out)")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--shape", default="576,1536", help="in,out features of the projection")
    parser.add_argument("--rows", default="16,64,128,256,1024")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    k, n = map(int, args.shape.split(","))
    report = {"command": "python bench/lora_cpu.py " + " ".join(
                  f"--{key} {value}" for key, value in vars(args).items() if value is not None and key != "json"),
              "device": describe_device("cpu"), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "slots": args.slots, "rank": args.rank, "shape": [k, n],
              "projection": projection_rows(args.slots, args.rank, k, n, [int(r) for r in args.rows.split(",")],
                                            args.repeats)}
    if args.adapters is not None:
        report["decode_forward"] = decode_forward(args.adapters, args.seqs, max(5, args.repeats // 5))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
