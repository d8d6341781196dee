"""A streamed request's host cost per step, as its output grows: handing out the step's new
token and turning it into text, now (the engine thread slices the new tokens, the request's
reader decodes a window of a few tokens) and the engine-thread detokenizer it replaced (restated
here: the engine thread decoded, sliced and joined the whole output at every step, and decoded
all of it at the last).

What it measures
----------------
One request, one sample, streamed for ``--lengths`` output tokens (500 and 4,000 by
default), one token per step; no model runs. The output is real text (this repository's docs
and a multilingual passage whose characters span several tokens) encoded by SmolLM2's
tokenizer (``--tokenizer``: a folder; by default the embedded SmolLM2-135M's), after a prompt
of ``--prompt-tokens``. At each step the bench appends the next token to the request's
``Sequence`` (the engine's part, not timed; the last step finishes it by length), then times:

- ``new``: ``GenerateKind.record`` (the engine core's part: a record holding the new token's
  id; serve/engine_core.py) plus its decoding and ``RequestText.fill`` (the reading
  coroutine's part: its text), on a stub engine holding the request; ``engine_thread_us``
  and ``reader_us`` split it;
- ``old``: the same step's work as the engine thread did it in the design this replaced (its
  ``_publish``, ``_delta`` and ``IncrementalDetokenizer``, restated below in ``Legacy``),
  all of it on the engine thread.

Each arm runs ``--repeats`` times per length, with and without a stop string (``--stop``:
the text is then held back by the stop string's length less one, as a server does); per run
the per-step times are summarised, and the report gives the median over runs of: the median
step over the whole output, the median of its last 10% of steps (``tail_median_us``: the cost
at that length), p99, and the final step (the old way decoded the whole output there).
``growth`` is ``tail_median_us`` at the longest length over the shortest, per arm: 1.0 means
the cost per step does not depend on the output's length.

How to run
----------
    .venv/bin/python bench/stream_detokenize.py --json bench/results/stream_detokenize_cpu_DATE.json
    .venv/bin/python bench/stream_detokenize.py --lengths 50 200 --repeats 1     # the code path
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from tessellm.bench.offline import cpu_name
from tessellm.core.engine.request import RequestState
from tessellm.core.interfaces.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from tessellm.serve.detokenize import RequestText
from tessellm.serve.engine_client import GENERATE, SampleDelta, StepOutput
from tessellm.serve.engine_core import GenerateKind, Progress

ROOT = Path(__file__).resolve().parents[1]
MULTILINGUAL = ("Grüße aus Zürich: “naïve café” — 日本語の文章を書きます。한국어 문장입니다. Ωμέγα και άλφα. "
                "Emoji 😀🤖🎉 and math ∑∫√∞. Ñandú, façade, Ærøskøbing.\n")


def output_ids(tokenizer: Any, count: int) -> list[int]:
    """``count`` token ids of real text: the repository's docs, a multilingual passage every ~2 kB."""
    docs = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))] or ["Some text. " * 5000]
    text = "".join(MULTILINGUAL + d[i:i + 2000] for d in docs for i in range(0, len(d), 2000))
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


class StubEngine:
    """What the engine core's ``GenerateKind.record`` reads of an engine: the live requests."""

    def __init__(self, state: RequestState):
        self.requests = {state.request_id: state}

    def pop_finished(self, request_id: str) -> RequestState:
        return self.requests.pop(request_id)


class Legacy:
    """The engine thread's per-step delta work as the replaced design did it
    (``EngineThread._publish``/``_delta`` and its ``IncrementalDetokenizer``), for one request."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.detok_text = ""
        self.emitted = 0
        self.text = ""
        self.done = False

    def _add(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        window = self.decode(self.ids[self.prefix:])
        before = self.decode(self.ids[self.prefix:self.read])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return
        self.prefix, self.read = self.read, len(self.ids)
        self.detok_text += window[len(before):]

    def step(self, seq: Sequence) -> StepOutput | None:
        if self.done:
            return None
        new = seq.output_token_ids[self.emitted:]
        if not new and not seq.is_finished:
            return None
        self.emitted += len(new)
        self._add(new)
        shown = self.text
        if seq.is_finished:
            self.done = True
            full = self.decode(seq.output_token_ids)
            if seq.stop_text_len is not None:
                full = full[:seq.stop_text_len]
            end = len(full)
        else:
            full = self.detok_text
            hold = max((len(x) for x in self.stop), default=1) - 1
            end = max(len(shown), len(full) - hold)
        text = full[len(shown):end]
        self.text = shown + text
        reason = seq.finish_reason.value if seq.is_finished and seq.finish_reason else None
        return StepOutput(seq.request_id, [SampleDelta(0, new, text, reason, None)], seq.is_finished,
                          seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens or 0, None)


def run(arm: str, ids: list[int], prompt: list[int], stop: list[str], llm: Any) -> dict[str, Any]:
    """One streamed request of ``len(ids)`` tokens: per-step microseconds, and its text."""
    params = SamplingParams(max_tokens=len(ids), stop=stop)
    seq = Sequence("r", prompt, params)
    seq.status = SequenceStatus.RUNNING
    core = type("Core", (), {"engine": StubEngine(RequestState("r", params, [seq]))})()
    kind, progress = GenerateKind(), Progress()

    def decode(token_ids: list[int]) -> str:
        return llm.tokenizer.decode(token_ids, skip_special_tokens=True)

    reader, legacy, read = RequestText(decode, stop), Legacy(decode, stop), GENERATE.reader()
    steps, engine_side, texts = [], [], []  # per step: all of it, the engine thread's part
    for i, token in enumerate(ids):
        seq.token_ids.append(token)
        if i == len(ids) - 1:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.LENGTH
        start = time.perf_counter_ns()
        if arm == "new":
            record = kind.record(core, "r", progress)  # the engine core's part
            published = time.perf_counter_ns()
            if record is not None:
                texts += [d.text for d in reader.fill(read([record])).samples]
            engine_side.append(published - start)
        else:
            out = legacy.step(seq)
            texts += [d.text for d in out.samples] if out else []
        steps.append(time.perf_counter_ns() - start)
    engine_side = engine_side or steps  # the old way did it all on the engine thread
    return {"steps_ns": steps, "engine_ns": engine_side, "reader_ns": [a - b for a, b in zip(steps, engine_side)],
            "text": "".join(texts)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def per_run(key: str, pick: Callable[[list[int]], float]) -> float:
        return round(statistics.median(pick(r[key]) / 1000 for r in runs), 3)

    def tail(xs: list[int]) -> float:
        return statistics.median(xs[-max(len(xs) // 10, 1):])

    def p99(xs: list[int]) -> float:
        return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]

    return {"median_us": per_run("steps_ns", statistics.median), "tail_median_us": per_run("steps_ns", tail),
            "p99_us": per_run("steps_ns", p99), "final_step_us": per_run("steps_ns", lambda xs: xs[-1]),
            "engine_thread_us": per_run("engine_ns", statistics.median),
            "engine_thread_tail_us": per_run("engine_ns", tail),
            "reader_us": per_run("reader_ns", statistics.median)}


class StubLLM:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.engine = None
        self.pipeline = type("Pipeline", (), {"tokenizer_lock": threading.Lock()})()


def measure(tokenizer: Any, lengths: list[int], stops: list[list[str]], repeats: int,
            prompt_tokens: int) -> list[dict[str, Any]]:
    llm, prompt = StubLLM(tokenizer), list(range(100, 100 + prompt_tokens))
    rows = []
    for stop in stops:
        for length in lengths:
            ids = output_ids(tokenizer, length)
            expected = tokenizer.decode(ids, skip_special_tokens=True)
            for arm in ("old", "new"):
                runs = [run(arm, ids, prompt, stop, llm) for _ in range(repeats)]
                assert all(r["text"] == expected for r in runs), f"{arm}: the streamed text is not the decoded output"
                rows.append({"arm": arm, "output_tokens": length, "stop": stop, **summarise(runs)})
    return rows


def growth(rows: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for row in rows:
        key = f"{row['arm']}{'_stop' if row['stop'] else ''}"
        same = [r for r in rows if r["arm"] == row["arm"] and r["stop"] == row["stop"]]
        low, high = min(same, key=lambda r: r["output_tokens"]), max(same, key=lambda r: r["output_tokens"])
        out[key] = round(high["tail_median_us"] / low["tail_median_us"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 4000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--stop", default="\n\nUser:", help="the stop string of the runs with one")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer folder (default: SmolLM2-135M's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from tessellm.core.model.loader import model_folder, resolve_model

        args.tokenizer = model_folder(resolve_model("smollm2-135m"))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = measure(tokenizer, sorted(args.lengths), [[], [args.stop]], args.repeats, args.prompt_tokens)
    report = {"command": "python bench/stream_detokenize.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_name(),
              "python": sys.version.split()[0], "tokenizer": str(args.tokenizer.name), "repeats": args.repeats,
              "rows": rows, "growth": growth(rows)}
    for row in rows:
        print(f"{row['arm']:>4} {row['output_tokens']:>6} tokens stop={row['stop']!r:<14} "
              f"step median {row['median_us']:8.1f} us  last 10% {row['tail_median_us']:8.1f} us  "
              f"p99 {row['p99_us']:8.1f} us  final {row['final_step_us']:9.1f} us  "
              f"engine thread {row['engine_thread_us']:7.1f} us")
    print("growth (last 10% of steps, longest over shortest):", report["growth"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
