"""The ``tessellm`` command: ``plugins``, ``generate`` and ``new-plugin`` here; ``bench`` and
``ab`` (tessellm/bench/cli.py), ``serve`` (tessellm/serve/cli.py) and ``eval``
(tessellm/eval/cli.py) and ``router`` (tessellm/serve/router/cli.py) beside their apps (``serve`` needs the ``[serve]`` extra, ``bench`` and
``ab`` parts of ``[bench]``, ``eval lm-eval`` the ``[eval]`` extra).

Bad input (config, model, request) prints one line, ``tessellm: error: ...``, and exits with
status 2, as argparse does for bad arguments; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tessellm.bench import cli as bench_cli
from tessellm.core.errors import ConfigError, InvalidRequestError, TessellmError
from tessellm.eval import cli as eval_cli
from tessellm.serve import cli as serve_cli
from tessellm.serve.router import cli as router_cli


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="pipeline config (.yaml, .toml or .json); default: the embedded one")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config field, e.g. --set decoding.name=sample --set scheduler.options.max_num_seqs=4 "
                        "--set model=PATH (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessellm", description="A plugin-based LLM inference engine.")
    parser.add_argument("--version", action="store_true", help="print the version and plugin-API version")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list every registered plugin")
    p.add_argument("--json", action="store_true", help="print a JSON array of plugins")
    p.add_argument("--check", metavar="KIND:NAME",
                   help="run KIND's conformance suite on the installed plugin NAME (needs the [conformance] extra)")
    p.add_argument("--options", metavar="JSON", default="{}", help="with --check: the plugin's options, as JSON")
    p.add_argument("--shapes", metavar="JSON", default=None,
                   help="with --check model:NAME: config fields of the tiny checkpoints, as JSON, per model_type "
                        "('{\"gpt_neox\": {\"num_hidden_layers\": 3}}') or for every type the plugin declares "
                        "('{\"num_hidden_layers\": 3}')")
    p.add_argument("--examples", type=int, default=20, metavar="N",
                   help="with --check: at most N cases per property, and N parameter sets of a parametrized "
                        "one (default 20)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="with --check: show pytest's output and each failure's whole traceback")

    g = sub.add_parser("generate", help="generate text from prompts (run as one batch)")
    _add_config_args(g)
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 (default) keeps every token")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this times as likely as the "
                   "most likely one; 0 (default) keeps every token")
    g.add_argument("--extra-args", metavar="JSON", default=None,
                   help="settings for the decoding plugin beyond these (SamplingParams.extra_args), as JSON")
    g.add_argument("--seed", type=int, default=None, help="seed of each request's sampler")
    g.add_argument("-n", type=int, default=1, help="samples per prompt (forked after the prompt)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt per line")
    g.add_argument("--lora", metavar="NAME", default=None,
                   help="run the prompts under this LoRA adapter (registered by the config's lora.adapters)")
    g.add_argument("--min-tokens", type=int, default=0, help="fewest tokens before EOS or a stop may end a sample")
    g.add_argument("--sampling", metavar="JSON", default=None,
                   help="further SamplingParams fields as a JSON object, over the flags above: penalties, "
                        "bad_words, allowed_token_ids, logits_processors, ... e.g. "
                        "'{\"presence_penalty\": 0.5, \"logits_processors\": [\"my-processor\"]}'")

    n = sub.add_parser("new-plugin", help="write a ready plugin package (code, tests, pyproject) for one kind")
    n.add_argument("kind", metavar="KIND", help="attention, cache, scheduler, decoding, quant, model, logits, lora or routing")
    n.add_argument("name", metavar="NAME", help="the plugin's name, as a config selects it (e.g. my-attention)")
    n.add_argument("--dir", metavar="DIR", default=None, help="where to write it (default ./tessellm-NAME)")

    bench_cli.add_parsers(sub, _add_config_args)
    serve_cli.add_parser(sub, _add_config_args)
    router_cli.add_parser(sub)
    eval_cli.add_parser(sub, _add_config_args)
    return parser


def cmd_plugins(args: argparse.Namespace) -> int:
    from tessellm.core.registry import get_registry

    if args.check:
        return cmd_check(args)

    registry = get_registry()
    rows = [e.describe() for e in registry.entries()]
    for failure in registry.failures:
        print(f"tessellm: warning: {failure}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print("\n".join(plugin_lines(rows)))
    return 0


def plugin_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``tessellm plugins``' lines for plugins described as ``PluginEntry.describe`` does:
    kind.name, auto priority, package, and description (a model plugin's model types first)."""
    width = max((len(f"{r['kind']}.{r['name']}") for r in rows), default=10)
    package_width = max((len(r["package"]) for r in rows), default=12)
    lines = []
    for r in rows:
        auto = "-" if r["auto_priority"] is None else str(r["auto_priority"])
        description = r["description"]
        if r.get("model_types"):  # what a model plugin builds, before what it is
            description = f"[{', '.join(r['model_types'])}] {description}"
        lines.append(f"{r['kind'] + '.' + r['name']:<{width}}  auto {auto:>3}  {r['package']:<{package_width}}  "
                     f"{description}")
    return lines


def cmd_check(args: argparse.Namespace) -> int:
    """``plugins --check KIND:NAME``: the conformance table; exit 1 when a property fails."""
    from tessellm.core.errors import ConfigError
    from tessellm.core.plugin import KINDS
    from tessellm.extras import require

    kind, sep, name = args.check.partition(":")
    if not sep or kind not in KINDS or not name:
        raise ConfigError(f"--check takes KIND:NAME with KIND one of {', '.join(KINDS)}, e.g. attention:sdpa; "
                          f"got {args.check!r}")
    options = _json_object("--options", args.options, ConfigError)
    require("pytest", "conformance")
    require("hypothesis", "conformance")
    from tessellm.testing.conformance.check import run_check

    if args.examples < 1:
        raise ConfigError(f"--examples must be at least 1, got {args.examples}")
    shapes = _check_shapes(args.shapes, kind, name)
    report = run_check(kind, name, options, examples=args.examples, verbose=args.verbose, shapes=shapes)
    print(report.table())
    return 0 if report.ok else 1


def _check_shapes(text: str | None, kind: str, name: str) -> dict[str, dict[str, Any]] | None:
    """``--shapes``' JSON as model_type -> config fields; fields not keyed by a model type
    apply to every type the plugin declares. ConfigError for bad JSON or another kind."""
    if text is None:
        return None
    if kind != "model":
        raise ConfigError(f"--shapes sets the tiny checkpoints of the model suite; {kind} plugins take none")
    shapes = _json_object("--shapes", text, ConfigError)
    if shapes and all(isinstance(v, dict) for v in shapes.values()):
        return shapes
    if any(isinstance(v, dict) for v in shapes.values()):
        raise ConfigError("--shapes takes either {model_type: {field: value}} or {field: value} for every model "
                          f"type, not both; got {text!r}")
    from tessellm.core.registry import get_registry

    entry = get_registry().get("model", name)
    return {t: dict(shapes) for t in (entry.cls.model_types if entry is not None else ())}


def cmd_new_plugin(args: argparse.Namespace) -> int:
    """``new-plugin KIND NAME [--dir DIR]``: write the package and say how to go on."""
    from tessellm.core.errors import ConfigError
    from tessellm.core.registry import get_registry
    from tessellm.scaffold import check_name, new_plugin

    check_name(args.kind, args.name)
    existing = get_registry().get(args.kind, args.name)
    if existing is not None:
        raise ConfigError(f"new-plugin: {args.kind} plugin {args.name!r} already exists (package "
                          f"{existing.package!r}); choose another name")
    made = new_plugin(args.kind, args.name, args.dir)
    print(f"wrote {args.kind} plugin {args.name!r} into {made.directory}/:")
    for path in made.files:
        print(f"  {path.relative_to(made.directory)}")
    print("next:\n" + "\n".join(f"  {step}" for step in made.next_steps))
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "n": args.n,
                              "stop": args.stop, "ignore_eos": args.ignore_eos, "min_tokens": args.min_tokens}
    if args.seed is not None:
        params["seed"] = args.seed
    if args.extra_args is not None:
        params["extra_args"] = _json_object("--extra-args", args.extra_args)
    if args.sampling is not None:
        params.update(_json_object("--sampling", args.sampling))
    return params


def _json_object(flag: str, text: str, error: type[TessellmError] = InvalidRequestError) -> dict[str, Any]:
    """``flag``'s value parsed as a JSON object; ``error`` naming the flag otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{flag} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def cmd_generate(args: argparse.Namespace) -> int:
    from tessellm.core.engine.llm import LLM, to_sampling_params
    from tessellm.core.plugin import KINDS

    params = to_sampling_params(_sampling(args))  # reject bad sampling arguments before loading a model
    llm = LLM(args.config, overrides=args.overrides)
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, chat=args.chat, lora=args.lora)
    elapsed = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            record = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                      "finish_reason": out.finish_reason, "prompt_tokens": len(out.prompt_token_ids),
                      "completion_tokens": len(out.token_ids),
                      "ttft_ms": None if out.ttft_s is None else round(out.ttft_s * 1000, 3),
                      "e2e_ms": round(out.e2e_s * 1000, 3),
                      "tokens_per_s": round(len(out.token_ids) / out.e2e_s, 3) if out.e2e_s > 0 else None}
            if len(out.outputs) > 1:
                record["samples"] = [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                                     for c in out.outputs]
            print(json.dumps(record), flush=True)
        else:
            print(f"=== {prompt}")
            for c in out.outputs:
                print(c.text)
                print(f"--- {len(c.token_ids)} tokens, finish: {c.finish_reason}")
    r = llm.pipeline.resolved
    parts = [f"model {llm.pipeline.architecture.name}"]  # the model plugin, then the pipeline's plugins
    parts += [f"{kind} {r.choices[kind].entry.name}" for kind in KINDS if kind in r.choices and kind != "model"]
    print(f"tessellm: {generated} tokens for {len(outputs)} prompt{'s' if len(outputs) != 1 else ''} in {elapsed:.2f} s: "
          f"{generated / elapsed:.1f} tokens/s ({r.device}, {str(r.dtype).replace('torch.', '')}, "
          + ", ".join(parts) + ")", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``tessellm`` command; its exit status. A torchrun rank ends the process here (see
    ``end_rank``), a follower too (its pipeline raises SystemExit once rank 0 stops it)."""
    from tessellm.core.parallel.group import end_rank, in_launched_group

    try:
        code = _main(argv)
    except SystemExit as exc:
        if not in_launched_group():
            raise
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    if in_launched_group():
        end_rank(code)
    return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:2] == ["eval", "lm-eval"]:  # every later argument is lm_eval's, options included
        args = argparse.Namespace(command="eval", eval_command="lm-eval", harness_args=given[2:], version=False)
    else:
        args = parser.parse_args(argv)
    args.argv = argv  # the report's command line
    if args.version:
        from tessellm.core.version import PLUGIN_API_VERSION, __version__

        print(f"tessellm {__version__} (plugin API {PLUGIN_API_VERSION})")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    _quiet_libraries()
    try:
        _as_rank(args.command)
        return {"plugins": cmd_plugins, "generate": cmd_generate, "bench": bench_cli.cmd_bench,
                "ab": bench_cli.cmd_ab, "serve": serve_cli.cmd_serve, "router": router_cli.cmd_router,
                "new-plugin": cmd_new_plugin, "eval": eval_cli.cmd_eval}[args.command](args)
    except TessellmError as exc:
        print(f"tessellm: error{_rank_tag()}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tessellm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tessellm plugins --json | head`: the reader left, which is fine
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def _as_rank(command: str) -> None:
    """Under torchrun rank 0 alone prints; the other ranks compute in step with it (their
    pipeline never returns: they serve rank 0 until it stops). ``ab`` builds two pipelines
    at once, which the ranks cannot follow."""
    from tessellm.core.parallel.group import is_follower, launched_world

    world = launched_world()
    if world is not None and world[1] > 1 and command == "ab":
        raise ConfigError("tessellm ab does not run under torchrun: run each arm's pipeline with tessellm bench "
                          "under torchrun, or ab on one process")
    if is_follower():
        import os

        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's life)


def _rank_tag() -> str:
    """`` (rank N)`` on ranks other than 0 of a torchrun launch, whose errors say which rank."""
    from tessellm.core.parallel.group import is_follower, launched_world

    return f" (rank {launched_world()[0]})" if is_follower() else ""


def _quiet_libraries() -> None:
    import logging
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
