"""What bench/e2e_gpu.py's own step timer costs inside its timed span, one timer against
another on the same engine, rounds interleaved (CPU or GPU).

Builds e2e_gpu.py's tiny random Llama (the CPU) and runs a mixed workload (``--requests``
requests, prompts of median 64 tokens, ``--new-tokens`` each) through ``run_offline`` with
each step timer in turn, ``--rounds`` times: the timer of this tree's bench/e2e_gpu.py and,
with ``--old FILE``, an earlier one (``git show 7969c05:bench/e2e_gpu.py > FILE``: the
timer that read ``gc.get_freeze_count()`` after every step over 20 ms). Prints each run's
elapsed time, steps and time outside the engine's steps (absolute and as a share).

    python bench/step_timer_cost.py --old /tmp/old/e2e_gpu_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import e2e_gpu  # noqa: E402

from tessellm import LLM  # noqa: E402
from tessellm.bench.offline import run_offline  # noqa: E402
from tessellm.bench.workloads import make_workload  # noqa: E402
from tessellm.core.engine.gc_freeze import CollectorClock  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="an earlier bench/e2e_gpu.py whose StepTimeline to compare")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    timers = {"this": e2e_gpu}
    if args.old:
        spec = importlib.util.spec_from_file_location("e2e_gpu_old", args.old)
        timers["old"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(timers["old"])
    cuda = torch.cuda.is_available()
    shapes, dtype = (e2e_gpu.LLAMA_32_1B, torch.bfloat16) if cuda else (e2e_gpu.TINY, torch.float32)
    folder = Path(tempfile.mkdtemp())
    e2e_gpu.build_model(folder, shapes, dtype, "cuda" if cuda else "cpu")
    overrides = [] if cuda else ["attention.name=sdpa"]
    llm = LLM(e2e_gpu.pipeline_config(folder, cuda, dtype, [*overrides, "scheduler.options.max_num_seqs=128"]))
    requests = make_workload("mixed", seed=0, num_requests=args.requests, tokenizer=llm.tokenizer, max_model_len=2048,
                             prompt_median=64, prompt_sigma=0.5, prompt_min=16, prompt_max=256,
                             output_median=args.new_tokens, output_min=args.new_tokens, output_max=args.new_tokens)
    step = llm.engine.step
    for round_ in range(args.rounds):
        for name, module in timers.items():
            llm.engine.step = step
            clock = CollectorClock()
            timeline = module.StepTimeline(llm, clock)
            with clock:
                metrics = run_offline(llm, requests).metrics()
            summary = timeline.summary(llm.engine.stats.steps)
            inside = summary["graph_s"] + summary["other_s"]
            outside = metrics["elapsed_s"] - inside
            print(f"round {round_} timer {name}: elapsed {metrics['elapsed_s']:.3f} s, steps {llm.engine.stats.steps}, "
                  f"outside steps {outside:.3f} s ({100 * outside / metrics['elapsed_s']:.1f}%)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
