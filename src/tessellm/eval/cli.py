"""``tessellm eval ppl|passkey|lm-eval``: its arguments and what each runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable


def add_parser(sub: Any, add_config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    ev = sub.add_parser("eval", help="evaluate a pipeline: perplexity, passkey retrieval, lm-evaluation-harness")
    kinds = ev.add_subparsers(dest="eval_command", metavar="EVAL", required=True)

    p = kinds.add_parser("ppl", help="sliding-window perplexity of a text")
    add_config_args(p)
    p.add_argument("--text", metavar="FILE|NAME", default=None,
                   help="a UTF-8 file, or a bundled text: the-tempest (default), paradise-lost")
    p.add_argument("--window", type=int, default=None, help="tokens per scored window (default min(max_model_len, 1024))")
    p.add_argument("--stride", type=int, default=None, help="new tokens each window after the first scores, the rest of it their context (default window/2)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object (key 'perplexity' and the settings)")

    k = kinds.add_parser("passkey", help="passkey retrieval accuracy at a context length")
    add_config_args(k)
    k.add_argument("--context", type=int, default=1024, help="prompt tokens, at most (default 1024; 128 up to max_model_len - 8)")
    k.add_argument("--trials", type=int, default=30,
                   help="prompts, the key's depth uniform over the context, fillers, phrasings and key lengths in "
                        "turn (default 30)")
    k.add_argument("--seed", type=int, default=0, help="seed of the keys, depths and key lengths (default 0)")
    k.add_argument("--json", action="store_true", help="print one JSON object (key 'accuracy' and every trial)")

    h = kinds.add_parser("lm-eval", help="run lm-evaluation-harness with the 'tessellm' model registered (the [eval] extra)",
                         description="Every argument after lm-eval goes to lm_eval's own command line, e.g. "
                                     "tessellm eval lm-eval --model tessellm --model_args 'set=quant.name=int8-weight' "
                                     "--tasks lambada_openai",
                         add_help=False)
    h.add_argument("harness_args", nargs=argparse.REMAINDER)


def cmd_eval(args: argparse.Namespace) -> int:
    return {"ppl": _ppl, "passkey": _passkey, "lm-eval": _lm_eval}[args.eval_command](args)


def _ppl(args: argparse.Namespace) -> int:
    from tessellm.core.engine.llm import LLM
    from tessellm.eval.perplexity import perplexity
    from tessellm.eval.texts import load_text

    label, text = load_text(args.text)  # a bad --text fails before a model loads
    llm = LLM(args.config, overrides=args.overrides)
    result = perplexity(llm, text, window=args.window, stride=args.stride, max_tokens=args.max_tokens,
                        label=label, progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"perplexity {result.perplexity:.4f} on {label}: {result.tokens_scored} tokens scored of "
              f"{result.text_tokens}, window {result.window}, stride {result.stride}, {result.seconds:.1f} s")
    return 0


def _passkey(args: argparse.Namespace) -> int:
    from tessellm.core.engine.llm import LLM
    from tessellm.eval.passkey import passkey

    llm = LLM(args.config, overrides=args.overrides)
    result = passkey(llm, context=args.context, trials=args.trials, seed=args.seed)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        for t in result.trials:
            print(f"depth {t.depth:.2f}  {t.filler:<5}  phrasing {t.phrasing}  key {t.key:<7}  "
                  f"{'ok  ' if t.correct else 'MISS'}  answer {t.answer!r}")
        print("by depth decile (found/trials): " + "  ".join(f"{i / 10:.1f}: {f}/{n}" for i, (f, n)
                                                             in enumerate(result.by_decile) if n))
        if result.selection:
            print("share of the key's blocks selected, per sparse layer: " + "  ".join(
                f"{layer}: {share:.2f}" for layer, share in result.selection.items()))
        print(f"passkey accuracy {result.accuracy:.0%} ({sum(t.correct for t in result.trials)}/{len(result.trials)}) "
              f"at {result.prompt_tokens} tokens of context, {result.seconds:.1f} s")
    return 0


def _lm_eval(args: argparse.Namespace) -> int:
    from tessellm.extras import require

    require("lm_eval", "eval")
    import tessellm.eval.lm_eval_adapter  # noqa: F401  (registers the 'tessellm' model)
    from lm_eval.__main__ import cli_evaluate

    harness_args = args.harness_args[1:] if args.harness_args[:1] == ["--"] else args.harness_args
    saved = sys.argv
    sys.argv = ["lm-eval", *harness_args]
    try:
        cli_evaluate()
    except SystemExit as exc:  # lm_eval's argparse exits on --help and on bad arguments
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    return 0
