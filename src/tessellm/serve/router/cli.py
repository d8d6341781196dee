"""``tessellm router`` (replicas started elsewhere), ``tessellm serve --data-parallel N``
(N replicas started here) and ``tessellm ab --serve`` (one replica per arm, every request
mirrored): their arguments and what they run. Imports stay inside the commands, so
``tessellm --help`` loads no server library."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from tessellm.core.errors import ConfigError


def add_parser(sub: Any) -> None:
    r = sub.add_parser("router", help="one OpenAI endpoint in front of several tessellm serve replicas",
                       description="Route each request to one of the replicas (by load, by prompt prefix: a "
                                   "routing plugin), retry it on another when a replica fails before answering, "
                                   "and aggregate their /metrics with a replica label.")
    r.add_argument("--replica", dest="replicas", metavar="URL", action="append", default=[], required=True,
                   help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeatable)")
    r.add_argument("--mirror", action="store_true",
                   help="live A/B of exactly two replicas (A, then B): every request goes to both, the client gets "
                        "A's answer; GET /ab and the exit report speed and agreement (see tessellm ab --serve)")
    add_router_args(r)


def add_router_args(p: argparse.ArgumentParser, *, listen: bool = True) -> None:
    """The flags every router shares: its policy and its failure handling (and, with
    ``listen``, where it listens and its API key)."""
    p.add_argument("--policy", default="prefix-aware", metavar="NAME",
                   help="routing plugin: round-robin, least-load, prefix-aware (default) or an installed one")
    p.add_argument("--policy-option", dest="policy_options", metavar="KEY=VALUE", action="append", default=[],
                   help="an option of the policy, e.g. match_threshold=0.7 (repeatable)")
    p.add_argument("--max-retries", type=int, default=2, metavar="N",
                   help="other replicas tried when one fails before answering (default 2)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S",
                   help="seconds between health probes of each replica (default 1)")
    if not listen:  # serve --data-parallel: the replicas are started here
        p.add_argument("--replica-base-port", type=int, default=None, metavar="P",
                       help="replica i listens on 127.0.0.1:P+i (default: free ports, shown in the log and /health)")
    if listen:
        p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
        p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
        p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")


def config_from_args(args: argparse.Namespace, replicas: list[str]) -> Any:
    """The RouterConfig of the flags, its policy checked (name, options) before anything starts."""
    from tessellm.serve.router.config import load_policy, parse_policy_options, router_config

    config = router_config(replicas=replicas, policy=args.policy,
                           policy_options=parse_policy_options(args.policy_options), max_retries=args.max_retries,
                           health_interval_s=args.health_interval)
    load_policy(config.policy, config.policy_options, len(config.replicas))
    return config


def check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")


def run_router(config: Any, args: argparse.Namespace, *, mirror: Any = None, what: str = "",
               group: Any = None) -> int:
    """Serve the router on ``args.host``/``args.port`` until stopped; with ``group`` (the
    replicas started here) supervise them: 1 when none is left and the router stopped for it."""
    import uvicorn

    from tessellm.serve.cli import log_server_events
    from tessellm.serve.router.app import build_router_app

    app = build_router_app(config, api_key=args.api_key, mirror=mirror, group=group)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    gave_up: list[str] = []
    if group is not None:
        keep_running = getattr(args, "keep_running", False)

        def give_up(why: str) -> None:
            gave_up.append(why)
            if not keep_running:
                server.should_exit = True

        metrics = app.state.metrics
        group.supervise(restart=getattr(args, "restart", True), max_restarts=getattr(args, "max_restarts", 5),
                        on_exit=lambda i: metrics.replica_exits.labels(str(i)).inc(),
                        on_restart=lambda i: metrics.replica_restarts.labels(str(i)).inc(), on_give_up=give_up)
    processes = "".join(f"; {r.name}: pid {r.process.pid}, port {r.port}" for r in (group.replicas if group else ()))
    print(f"tessellm: routing {what or 'requests'} over {len(config.replicas)} replicas "
          f"({', '.join(config.replicas)}) with policy {config.policy if mirror is None else 'mirror'} on "
          f"http://{args.host}:{args.port}/v1{processes}", file=sys.stderr, flush=True)
    log_server_events()
    log_server_events("tessellm.router", "router: ")
    server.run()
    if gave_up and not getattr(args, "keep_running", False):
        print(f"tessellm: stopped: {gave_up[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from tessellm.extras import require

    require("uvicorn", "serve")
    require("httpx", "serve")
    check_port(args.port)
    config = config_from_args(args, args.replicas)
    if not args.mirror:
        run_router(config, args)
        return 0
    from tessellm.serve.router.ab_report import format_live_report
    from tessellm.serve.router.launcher import exit_on_sigterm
    from tessellm.serve.router.mirror import Mirror

    if len(config.replicas) != 2:
        raise ConfigError(f"--mirror compares exactly two replicas (A, then B); got {len(config.replicas)}")
    mirror = Mirror((config.replicas[0], config.replicas[1]),
                    shlex.join(["tessellm", *(sys.argv[1:] if args.argv is None else args.argv)]))
    exit_on_sigterm()
    try:
        run_router(config, args, mirror=mirror, what="every request to both replicas")
    finally:  # Ctrl-C included: the report of what was mirrored
        print(format_live_report(mirror.report(tuple(config.replicas))), flush=True)
    return 0


# ---------------------------------------------------------------- serve --data-parallel N


def replica_serve_args(args: argparse.Namespace) -> list[str]:
    """``tessellm serve``'s arguments for one replica of this command: the same config, flags
    and LoRA adapters (host and port are the launcher's)."""
    out: list[str] = ["--config", str(Path(args.config).resolve())] if args.config else []
    for item in args.overrides:
        out += ["--set", item]
    for flag, value in (("--api-key", args.api_key), ("--served-model-name", args.served_model_name),
                        ("--max-request-bytes", args.max_request_bytes), ("--max-waiting", args.max_waiting),
                        ("--stream-interval", getattr(args, "stream_interval", None)),
                        ("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank),
                        ("--limit-mm-per-prompt", _mm(args)),
                        ("--image-fetch-timeout", getattr(args, "image_fetch_timeout", None)),
                        ("--image-fetch-max-bytes", getattr(args, "image_fetch_max_bytes", None))):
        if value is not None:
            out += [flag, str(value)]
    for name, path in args.lora:
        out += ["--lora", f"{name}={path}"]
    if args.allow_runtime_lora_updating:
        out.append("--allow-runtime-lora-updating")
    if getattr(args, "allow_image_urls", False):
        out.append("--allow-image-urls")
    out += ["--engine-core", args.engine_core, "--max-restarts", str(args.max_restarts)]
    if not args.restart:
        out.append("--no-restart")
    return out


def _mm(args: argparse.Namespace) -> str | None:
    limit = getattr(args, "limit_mm_per_prompt", None)
    return None if limit is None else f"image={limit}"


def refuse_parallel_inside(config: Any, flag: str) -> None:
    """A replica runs in one process here: tensor or pipeline parallelism inside a replica
    would need torchrun per replica, which this launcher does not do."""
    from tessellm.core.parallel.group import in_launched_group

    if in_launched_group():
        raise ConfigError(f"{flag} starts its replicas itself; do not launch it with torchrun")
    parallel = config.parallel
    inside = {k: getattr(parallel, k, 1) for k in ("tensor", "pipeline")}
    if any(v > 1 for v in inside.values()):
        raise ConfigError(f"{flag} runs each replica in one process; parallel."
                          f"{next(k for k, v in inside.items() if v > 1)} > 1 needs torchrun per replica: start "
                          f"each replica with torchrun ... tessellm serve and put tessellm router in front")


def cmd_serve_data_parallel(args: argparse.Namespace) -> int:
    """``serve --data-parallel N``: N replicas on free local ports, the router on --host/--port."""
    from tessellm.core.config import load_config
    from tessellm.extras import require
    from tessellm.serve.router.launcher import ReplicaGroup, exit_on_sigterm, replica_threads

    require("uvicorn", "serve")
    require("httpx", "serve")
    check_port(args.port)
    config = load_config(args.config, args.overrides)  # a bad config fails here, once, not in N children
    refuse_parallel_inside(config, "--data-parallel")
    router = config_from_args(args, [f"http://127.0.0.1:{i}" for i in range(1, args.data_parallel + 1)])
    names = [f"replica {i}" for i in range(args.data_parallel)]
    base = args.replica_base_port
    if base is not None and not (0 < base and base + args.data_parallel - 1 < 65536):
        raise ConfigError(f"--replica-base-port must leave room for {args.data_parallel} ports below 65536, got {base}")
    exit_on_sigterm()
    with ReplicaGroup([replica_serve_args(args)] * args.data_parallel, names,
                      replica_threads(args.data_parallel), base_port=base) as group:
        return run_router(router.model_copy(update={"replicas": group.urls}), args,
                          what=f"{args.served_model_name or config.model!r}", group=group)


# ---------------------------------------------------------------- ab --serve


def write_arm_configs(configs: tuple[Any, Any], folder: Path) -> list[Path]:
    """Each arm's resolved config as a JSON file its replica loads."""
    paths = []
    for arm, config in zip("ab", configs):
        path = folder / f"arm-{arm}.json"
        path.write_text(json.dumps(config.model_dump(mode="json")))
        paths.append(path)
    return paths


def cmd_ab_serve(args: argparse.Namespace) -> int:
    """``ab --serve``: a replica per arm, every request mirrored, the report at exit."""
    from tessellm.bench.ab import load_arm_configs
    from tessellm.extras import require
    from tessellm.serve.router.ab_report import format_live_report
    from tessellm.serve.router.config import router_config
    from tessellm.serve.router.launcher import ReplicaGroup, exit_on_sigterm, replica_threads
    from tessellm.serve.router.mirror import Mirror

    require("uvicorn", "serve")
    require("httpx", "serve")
    check_port(args.port)
    configs = load_arm_configs(args.configs, base=args.config, shared=args.overrides, a=args.a, b=args.b)
    for config in configs:
        refuse_parallel_inside(config, "ab --serve")
    command = shlex.join(["tessellm", *(sys.argv[1:] if args.argv is None else args.argv)])
    labels = tuple(args.configs) if len(args.configs) == 2 else (" ".join(args.a) or "base", " ".join(args.b) or "base")
    mirror = Mirror(labels, command)
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="tessellm-ab-") as folder:
        paths = write_arm_configs(configs, Path(folder))
        name = args.served_model_name or configs[0].model
        serve_args = [["--config", str(p), "--served-model-name", name]
                      + (["--api-key", args.api_key] if args.api_key else []) for p in paths]
        with ReplicaGroup(serve_args, ["arm A", "arm B"], replica_threads(2)) as group:
            router = router_config(replicas=group.urls, policy="round-robin", max_retries=0)  # the mirror routes
            try:
                run_router(router, args, mirror=mirror, what="every request to both arms")
            finally:  # Ctrl-C included: the report of what was mirrored
                report = mirror.report(tuple(group.urls))
                print(json.dumps(report, indent=2) if args.json else format_live_report(report), flush=True)
    return 0
