"""``tessellm bench`` and ``tessellm ab``: their arguments and what they run."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
from typing import Any, Callable

from tessellm.core.errors import ConfigError
from tessellm.extras import require


def add_parsers(sub: Any, add_config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    b = sub.add_parser("bench", help="offline benchmark: a workload's requests all at once, timed",
                       description="Submit every request of a workload at t=0 and report throughput, "
                                   "TTFT/TPOT/e2e percentiles and KV-cache figures.")
    add_config_args(b)
    b.add_argument("--workload", default="mixed", metavar="NAME|PATH.jsonl",
                   help="mixed (default), shared-prefix, scoring, multi-turn, embed (an embedding or reranking "
                        "pipeline against sentence-transformers on the same texts), vision (prompts with images against "
                        "transformers' generate on the same requests), or a .jsonl file of {prompt | "
                        "prompt_token_ids, max_tokens, chat} objects")
    b.add_argument("--workload-set", dest="workload_overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a workload parameter, e.g. prefix_len=512 (repeatable)")
    b.add_argument("--num-requests", type=int, default=None,
                   help="requests to run (default 100; a .jsonl file: all its lines)")
    b.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload (default 0)")
    b.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    b.add_argument("--plot", metavar="FILE.png", help="also draw TTFT/TPOT CDFs and throughput into FILE.png")
    b.add_argument("--baseline", choices=["hf", "plain"],
                   help="also run the same requests through transformers' generate (hf), or through this "
                        "pipeline with plain decoding instead of its decoding plugin (plain: speculative "
                        "decoding's speedup, and whether outputs are identical)")
    b.add_argument("--baseline-batch-size", type=int, default=16,
                   help="static batch size of the baseline (default 16)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--serve", metavar="URL", help="benchmark a running server (tessellm serve) at URL instead of "
                                                  "running the pipeline in this process")
    b.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="--serve: Poisson arrivals at R requests/s (default: all at once)")
    b.add_argument("--max-concurrency", type=int, default=None, metavar="C",
                   help="--serve: at most C requests in flight")
    b.add_argument("--served-model-name", default=None, help="--serve: the model id to send (default: the config's model)")
    b.add_argument("--api-key", default=None, help="--serve: the server's API key")
    b.add_argument("--slo-ttft-ms", type=float, default=None, help="--serve: TTFT objective for goodput")
    b.add_argument("--slo-tpot-ms", type=float, default=None, help="--serve: TPOT objective for goodput")


    ab = sub.add_parser("ab", help="A/B test two pipelines: interleaved rounds, throughput ratio, output agreement",
                        description="Run one workload through two pipelines in interleaved rounds (A B, B A, ...); "
                                    "report each arm's throughput and latency, the throughput ratio B/A with a "
                                    "95% interval from the paired rounds, and how far their greedy outputs agree; "
                                    "when either arm's requests sample, also whether their sampled outputs "
                                    "differ in distribution.")
    ab.add_argument("configs", nargs="*", metavar="CONFIG", help="A's and B's config files (instead of --a/--b)")
    add_config_args(ab)
    for arm in ("a", "b"):
        ab.add_argument(f"--{arm}", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help=f"overrides of arm {arm.upper()} on top of --config and --set, e.g. "
                             f"attention.name=sdpa,dtype=float32 (repeatable)")
    ab.add_argument("--workload", default="mixed", metavar="NAME|PATH.jsonl",
                    help="mixed (default), shared-prefix, scoring, multi-turn, or a .jsonl file, as for bench")
    ab.add_argument("--workload-set", dest="workload_overrides", metavar="KEY=VALUE", action="append", default=[],
                    help="override a workload parameter (repeatable)")
    ab.add_argument("--num-requests", type=int, default=16, metavar="N", help="requests per run (default 16)")
    ab.add_argument("--rounds", type=int, default=5, metavar="N",
                    help="timed runs of each arm, interleaved (default 5, at least 2)")
    ab.add_argument("--warmup-rounds", type=int, default=1, metavar="N",
                    help="untimed runs of the workload by each arm before the timed rounds (default 1)")
    ab.add_argument("--seed", type=int, default=0, metavar="S",
                    help="seed of the workload and of the sampled-output draws (default 0)")
    ab.add_argument("--num-agreement-prompts", type=int, default=8, metavar="N",
                    help="workload prompts on which to compare greedy outputs and KL, and sampled outputs "
                         "when an arm samples (default 8; 0 skips)")
    ab.add_argument("--params", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="request parameters of both arms' requests (timed runs and agreement check), e.g. "
                         "temperature=1.0,top_p=0.9 (repeatable; default: greedy)")
    for arm in ("a", "b"):
        ab.add_argument(f"--{arm}-params", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help=f"arm {arm.upper()}'s own request parameters on top of --params, e.g. min_p=0.1")
    ab.add_argument("--num-samples", type=int, default=64, metavar="N",
                    help="when an arm samples: continuations per agreement prompt and arm (default 64)")
    ab.add_argument("--sample-tokens", type=int, default=8, metavar="T",
                    help="when an arm samples: tokens per sampled continuation (default 8)")
    ab.add_argument("--alpha", type=float, default=0.05,
                    help="when an arm samples: level of the distribution test (default 0.05)")
    ab.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ab.add_argument("--plot", metavar="FILE.png", help="also draw per-round throughput and the ratio into FILE.png")
    ab.add_argument("--no-progress", action="store_true", help="no progress bar")
    live = ab.add_argument_group("live A/B (--serve): the arms behind one endpoint, every request mirrored")
    live.add_argument("--serve", action="store_true",
                      help="serve one replica per arm behind one OpenAI endpoint: every request goes to both, the "
                           "client gets A's answer; GET /ab and the exit (Ctrl-C) report speed and agreement")
    live.add_argument("--host", default="127.0.0.1", help="--serve: address to listen on (default 127.0.0.1)")
    live.add_argument("--port", type=int, default=8000, help="--serve: port (default 8000)")
    live.add_argument("--api-key", default=None, help="--serve: require 'Authorization: Bearer KEY' on /v1/ routes")
    live.add_argument("--served-model-name", default=None,
                      help="--serve: the model id both arms answer to (default: A's config's model)")


def cmd_bench(args: argparse.Namespace) -> int:
    from tessellm.bench.offline import build_report, describe_device, format_report, progress_enabled, request_limit, run_offline
    from tessellm.bench.workloads import get_workload
    from tessellm.core.engine.llm import LLM

    if args.workload == "embed":
        return _bench_embed(args)
    if args.workload == "vision":
        return _bench_vision(args)
    # every argument is checked before a model is loaded
    workload = get_workload(args.workload, args.workload_overrides)
    if args.num_requests is not None and args.num_requests < 1:
        raise ConfigError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be 0 or more, got {args.seed}")
    if args.baseline_batch_size < 1:
        raise ConfigError(f"--baseline-batch-size must be at least 1, got {args.baseline_batch_size}")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot {args.plot!r}: the figure is written as PNG; give a FILE.png")
    if args.plot is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise ConfigError(f"--plot {args.plot!r}: folder {os.path.dirname(os.path.abspath(args.plot))!r} does not exist")
    plots = require("tessellm.bench.plots", "bench") if args.plot else None  # before any model loads
    progress = progress_enabled(args.no_progress, args.json)
    if args.serve:
        return _bench_serve(args, workload, progress, plots)
    llm = LLM(args.config, overrides=args.overrides)
    p = llm.pipeline
    requests = workload.requests(seed=args.seed, num_requests=args.num_requests, tokenizer=llm.tokenizer,
                                 max_model_len=request_limit(llm), vocab_size=p.spec.vocab_size, encode=llm.encode)
    result = run_offline(llm, requests, progress=progress)
    llm.close()  # a disk KV tier's queued writes land before the report (and a next run reads them)
    results = {"tessellm": result}
    info = dict(workload=workload.describe(args.seed, len(requests)),
                pipeline=json.loads(json.dumps(p.resolved.summary(), default=str)),
                device=describe_device(p.resolved.device),
                command=shlex.join(["tessellm", *(sys.argv[1:] if args.argv is None else args.argv)]))
    baseline = baseline_info = None
    if args.baseline == "hf" and not all(r.ignore_eos for r in requests):
        raise ConfigError("--baseline hf runs every request to its max_tokens; the workload has requests that "
                          "stop at EOS (\"ignore_eos\": false), so the two would not generate the same tokens")
    if args.baseline == "plain":
        config = p.config.model_dump()
        config["decoding"] = {"name": "auto", "options": {}}  # the best plain decoder (sample)
        del llm, p  # one model in memory at a time
        gc.collect()
        plain = LLM(config)
        baseline = results["plain"] = run_offline(plain, requests, progress=progress)
        baseline_info = {"name": "plain", "decoding": plain.pipeline.resolved.choices["decoding"].entry.name}
    elif args.baseline == "hf":
        from tessellm.bench.hf_baseline import load_transformers, pad_token_id, run_hf_baseline

        model_dir, dtype, device, pad = p.model_dir, p.resolved.dtype, p.resolved.device, pad_token_id(llm.tokenizer)
        del llm, p  # free tessellm's weights and KV cache before loading the model a second time
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        model = load_transformers(model_dir, dtype, device)
        baseline = results["hf"] = run_hf_baseline(model, requests, pad_id=pad, batch_size=args.baseline_batch_size,
                                                   progress=progress)
        baseline_info = {"name": "hf", "batch_size": args.baseline_batch_size,
                         "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    report = build_report(result, baseline=baseline, baseline_info=baseline_info, **info)
    if args.plot:
        plots.plot_report(report, results, args.plot)
    print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    return 0


def _bench_embed(args: argparse.Namespace) -> int:
    """``tessellm bench --workload embed``: against sentence-transformers, interleaved."""
    from tessellm.bench.embed import EmbedParams, embed_texts, format_embed_report, run_embed_bench
    from tessellm.bench.offline import progress_enabled
    from tessellm.bench.workloads import workload_params
    from tessellm.core.engine.llm import LLM

    _refuse_flags(args, "embed", "sentence-transformers")
    params = workload_params("embed", EmbedParams, args.workload_overrides)
    llm = LLM(args.config, overrides=args.overrides)
    if llm.pipeline.task == "generate":
        raise ConfigError("--workload embed needs an embedding or reranking pipeline; this one generates (its "
                          "checkpoint names no pooling): serve an embedding model or set pooling.name")
    texts = embed_texts(params, llm.tokenizer, args.seed, args.num_requests or 100, llm.pipeline.resolved.max_model_len)
    report = run_embed_bench(llm, texts, params, progress_enabled(args.no_progress, args.json))
    print(_described(report, args, llm, "embed", params, format_embed_report), flush=True)
    return 0


def _refuse_flags(args: argparse.Namespace, workload: str, reference: str) -> None:
    """ConfigError for a flag of the serving/offline bench that a comparison workload ignores."""
    for flag in ("serve", "plot", "baseline"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag} does not apply to --workload {workload} (it always compares with "
                              f"{reference}, in this process)")


def _described(report: dict, args: argparse.Namespace, llm: Any, name: str, params: Any,
               fmt: Callable[[dict], str]) -> str:
    """A whole-process bench's report with its seed, workload, pipeline, device and command
    added: as JSON with ``--json``, else ``fmt``'s text."""
    from tessellm.bench.offline import describe_device

    report.update(seed=args.seed, workload={"name": name, "params": params.model_dump()},
                  pipeline=json.loads(json.dumps(llm.pipeline.resolved.summary(), default=str)),
                  device=describe_device(llm.pipeline.resolved.device),
                  command=shlex.join(["tessellm", *(sys.argv[1:] if args.argv is None else args.argv)]))
    return json.dumps(report, indent=2) if args.json else fmt(report)


def _bench_vision(args: argparse.Namespace) -> int:
    """``tessellm bench --workload vision``: prompts with images against transformers'
    generate on the same requests, interleaved."""
    from tessellm.bench.offline import progress_enabled
    from tessellm.bench.vision import VisionParams, format_vision_report, run_vision_bench, vision_requests
    from tessellm.bench.workloads import workload_params
    from tessellm.core.engine.llm import LLM

    _refuse_flags(args, "vision", "transformers' generate")
    params = workload_params("vision", VisionParams, args.workload_overrides)
    llm = LLM(args.config, overrides=args.overrides)
    requests = vision_requests(params, llm, args.seed, args.num_requests or 16)
    report = run_vision_bench(llm, requests, params, progress_enabled(args.no_progress, args.json))
    print(_described(report, args, llm, "vision", params, format_vision_report), flush=True)
    return 0


def _bench_serve(args: argparse.Namespace, workload: Any, progress: bool, plots: Any) -> int:
    """``tessellm bench --serve URL``: the workload against a running server."""
    from tessellm.bench.offline import build_report, format_report
    from tessellm.bench.serving import goodput, run_serving
    from tessellm.core.config import load_config
    from tessellm.core.model.loader import load_hf_config, load_tokenizer
    from tessellm.core.resolve import model_dir_for

    require("httpx", "bench")

    if args.baseline:
        raise ConfigError("--baseline runs in this process; it does not combine with --serve")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ConfigError(f"--request-rate must be above 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    config = load_config(args.config, args.overrides)
    model_dir = model_dir_for(config)
    tokenizer = load_tokenizer(model_dir, config.trust_remote_code)
    max_len = config.max_model_len or load_hf_config(model_dir, config.trust_remote_code).max_position_embeddings
    requests = workload.requests(seed=args.seed, num_requests=args.num_requests, tokenizer=tokenizer,
                                 max_model_len=max_len)
    result = run_serving(args.serve, requests, model=args.served_model_name or config.model,
                         request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                         api_key=args.api_key, progress=progress)
    report = build_report(result, workload=workload.describe(args.seed, len(requests)),
                          pipeline={"server": args.serve, "request_rate": args.request_rate,
                                    "max_concurrency": args.max_concurrency},
                          device="server at " + args.serve,
                          command=shlex.join(["tessellm", *(sys.argv[1:] if args.argv is None else args.argv)]))
    report.update(goodput(result, args.slo_ttft_ms, args.slo_tpot_ms))
    if args.plot:
        plots.plot_report(report, {"tessellm serve": result}, args.plot)
    print(json.dumps(report, indent=2) if args.json else format_report(report)
          + f"\ngoodput: {report['goodput_rps']} requests/s meeting the objectives", flush=True)
    return 0


def cmd_ab(args: argparse.Namespace) -> int:
    from tessellm.bench.ab import format_ab_report, load_arm_configs, parse_request_params, run_ab
    from tessellm.bench.offline import progress_enabled
    from tessellm.bench.workloads import get_workload
    from tessellm.core.engine.llm import LLM

    if args.serve:
        from tessellm.serve.router.cli import cmd_ab_serve

        return cmd_ab_serve(args)
    # every argument and both configs are checked before a model is loaded
    workload = get_workload(args.workload, args.workload_overrides)
    for flag, value, least in (("--num-requests", args.num_requests, 1), ("--rounds", args.rounds, 2),
                               ("--warmup-rounds", args.warmup_rounds, 0),
                               ("--seed", args.seed, 0), ("--num-agreement-prompts", args.num_agreement_prompts, 0),
                               ("--num-samples", args.num_samples, 2), ("--sample-tokens", args.sample_tokens, 1)):
        if value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}")
    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha must be between 0 and 1, got {args.alpha}")
    shared = parse_request_params(args.params, "--params")
    params = tuple(parse_request_params(own, f"--{arm}-params", shared)
                   for arm, own in (("a", args.a_params), ("b", args.b_params)))
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot {args.plot!r}: the figure is written as PNG; give a FILE.png")
    folder = os.path.dirname(os.path.abspath(args.plot or "."))
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {args.plot!r}: folder {folder!r} does not exist")
    plots = require("tessellm.bench.plots", "bench") if args.plot else None  # before any model loads
    config_a, config_b = load_arm_configs(args.configs, base=args.config, shared=args.overrides, a=args.a, b=args.b,
                                          params_differ=params[0] != params[1])
    llm_a = LLM(config_a)
    # arms that differ only in their request parameters share one pipeline
    llm_b = llm_a if config_a == config_b and params[0] != params[1] else LLM(config_b)
    report = run_ab(llm_a, llm_b, workload, seed=args.seed, num_requests=args.num_requests, rounds=args.rounds,
                    num_agreement_prompts=args.num_agreement_prompts, params=params, num_samples=args.num_samples,
                    sample_tokens=args.sample_tokens, alpha=args.alpha, warmup_rounds=args.warmup_rounds,
                    progress=progress_enabled(args.no_progress, args.json),
                    command=shlex.join(["tessellm", *(sys.argv[1:] if args.argv is None else args.argv)]))
    if args.json and report["a"]["kv_cache_slots"] != report["b"]["kv_cache_slots"]:  # the text report says so itself
        print(f"tessellm: warning: the arms' KV caches differ in size ({report['a']['kv_cache_slots']} vs "
              f"{report['b']['kv_cache_slots']} slots)", file=sys.stderr)
    if args.plot:
        plots.plot_ab_report(report, args.plot)
    print(json.dumps(report, indent=2) if args.json else format_ab_report(report), flush=True)
    return 0
