"""``tessellm serve``: its arguments and the server it starts."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from tessellm.core.errors import ConfigError

LORA_FORM = "NAME=PATH (an adapter's name and its PEFT folder, e.g. sql=/adapters/sql-lora)"


def add_parser(sub: Any, add_config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    sv = sub.add_parser("serve", help="serve the pipeline over an OpenAI-compatible HTTP API")
    add_config_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    sv.add_argument("--served-model-name", default=None, help="the model id clients send (default: the config's model)")
    sv.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    sv.add_argument("--max-waiting", type=int, default=1024,
                    help="requests waiting to run before new ones get 429 (default 1024)")
    sv.add_argument("--stream-interval", type=int, default=1, metavar="N",
                    help="after a request's first token, stream its text every N tokens (and at its end): fewer, "
                         "larger events when many streams run (default 1: every token)")
    sv.add_argument("--data-parallel", type=int, default=1, metavar="N",
                    help="N replicas of the pipeline, each its own process on this machine, behind one endpoint "
                         "(a router on --host/--port; see tessellm router for its flags; default 1)")
    add_lora_args(sv)
    add_image_args(sv)
    add_engine_core_args(sv)
    from tessellm.serve.router.cli import add_router_args

    group = sv.add_argument_group("with --data-parallel N > 1: the router")
    add_router_args(group, listen=False)


def add_engine_core_args(sv: argparse.ArgumentParser) -> None:
    """Where the engine core runs and what happens when it (or a replica) exits."""
    group = sv.add_argument_group("the engine core (and, with --data-parallel N > 1, the replicas)")
    group.add_argument("--engine-core", choices=("process", "thread"), default="process",
                       help="process (default): the engine steps in its own process, HTTP and tokenizing in this one; "
                            "thread: both in one process (for debugging; slower at GPU step rates)")
    group.add_argument("--no-restart", dest="restart", action="store_false",
                       help="do not restart an engine core (or replica) process that exits")
    group.add_argument("--max-restarts", type=int, default=5, metavar="N",
                       help="give up after N exits in a row, each within 60 s of its start (default 5)")
    group.add_argument("--keep-running", action="store_true",
                       help="stay up (answering 503, /health saying why) when the engine can no longer serve, "
                            "instead of exiting with status 1")


def add_lora_args(sv: argparse.ArgumentParser) -> None:
    """LoRA adapters: each flag sets a field of the config's ``lora`` section (over the
    config file's; adapters are added to the file's)."""
    sv.add_argument("--lora", "--lora-modules", dest="lora", metavar="NAME=PATH", nargs="+", action="extend",
                    type=lora_module, default=[],
                    help="serve LoRA adapters: a request's model NAME runs under the PEFT adapter in PATH "
                         "(repeatable; vLLM's JSON form {\"name\": ..., \"path\": ...} too)")
    sv.add_argument("--max-loras", type=int, default=None, metavar="N",
                    help="adapters resident on the device at once (lora.max_loras, default 4)")
    sv.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                    help="largest adapter rank served (lora.max_rank, default 16)")
    sv.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora.runtime_updates)")


def add_image_args(sv: argparse.ArgumentParser) -> None:
    """Images in requests: each flag sets a field of the config's ``images`` section."""
    group = sv.add_argument_group("images in requests (a model that takes them)")
    group.add_argument("--limit-mm-per-prompt", type=mm_limit, default=None, metavar="image=N",
                       help="most images one prompt may hold (images.max_per_prompt, default 8); vLLM's JSON form "
                            "{\"image\": N} too")
    group.add_argument("--allow-image-urls", action="store_true",
                       help="fetch http(s) image URLs in requests (images.fetch_urls; off by default: only data: "
                            "URLs are read)")
    group.add_argument("--image-fetch-timeout", type=float, default=None, metavar="S",
                       help="longest a fetched image may take, in seconds (images.fetch_timeout_s, default 10)")
    group.add_argument("--image-fetch-max-bytes", type=int, default=None, metavar="N",
                       help="largest fetched image, in bytes (images.fetch_max_bytes, default 20 MiB)")


MM_FORM = "image=N (or JSON {\"image\": N})"


def mm_limit(text: str) -> int:
    """``--limit-mm-per-prompt``'s ``image=N`` (or ``{"image": N}``) as N; other modalities
    are refused by name, as this server takes images only."""
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({exc.msg}); expected {MM_FORM}") from None
        if not isinstance(given, dict):
            raise argparse.ArgumentTypeError(f"expected {MM_FORM}, got {text!r}")
        pairs = list(given.items())
    else:
        pairs = [item.partition("=")[::2] for item in text.split(",")]
    limit = None
    for name, value in pairs:
        name = str(name).strip()
        if name != "image":
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: modality {name!r} is not served; this server "
                                             f"takes images only ({MM_FORM})")
        try:
            limit = int(value)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {value!r} is not a whole number; expected "
                                             f"{MM_FORM}") from None
        if limit < 0:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: image={limit} must be 0 or more")
    if limit is None:
        raise argparse.ArgumentTypeError(f"expected {MM_FORM}, got {text!r}")
    return limit


def images_section(args: argparse.Namespace, current: dict[str, Any]) -> dict[str, Any] | None:
    """The config's ``images`` section (``current``) with the image flags applied; None if no
    flag was given."""
    flags: dict[str, Any] = {}
    if getattr(args, "limit_mm_per_prompt", None) is not None:
        flags["max_per_prompt"] = args.limit_mm_per_prompt
    if getattr(args, "allow_image_urls", False):
        flags["fetch_urls"] = True
    if getattr(args, "image_fetch_timeout", None) is not None:
        flags["fetch_timeout_s"] = args.image_fetch_timeout
    if getattr(args, "image_fetch_max_bytes", None) is not None:
        flags["fetch_max_bytes"] = args.image_fetch_max_bytes
    return {**current, **flags} if flags else None


def lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` (or vLLM's ``{"name": ..., "path": ...}``) as (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({exc.msg}); expected {LORA_FORM}") from None
        name, path = (given.get("name"), given.get("path")) if isinstance(given, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(path, str):
            raise argparse.ArgumentTypeError(f"{text!r} needs string fields name and path; expected {LORA_FORM}")
    else:
        name, _, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected {LORA_FORM}, got {text!r}")
    return name, path


def lora_section(args: argparse.Namespace, current: dict[str, Any]) -> dict[str, Any] | None:
    """The config's ``lora`` section (``current``) with the LoRA flags applied; None if no
    flag was given."""
    names = [name for name, _ in args.lora]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--lora names adapter {twice[0]!r} more than once; each NAME serves one adapter")
    flags: dict[str, Any] = {}
    if args.lora:
        flags["adapters"] = {**current.get("adapters", {}), **dict(args.lora)}
    if args.max_loras is not None:
        flags["max_loras"] = args.max_loras
    if args.max_lora_rank is not None:
        flags["max_rank"] = args.max_lora_rank
    if args.allow_runtime_lora_updating:
        flags["runtime_updates"] = True
    return {**current, **flags} if flags else None


def serve_config(args: argparse.Namespace) -> Any:
    """The pipeline config: ``--config`` and ``--set``, then the LoRA and image flags."""
    from tessellm.core.config import config_from_dict, load_config

    config = load_config(args.config, args.overrides)
    sections = {"lora": lora_section(args, config.lora.model_dump()),
                "images": images_section(args, config.images.model_dump())}
    sections = {name: value for name, value in sections.items() if value is not None}
    if not sections:
        return config
    return config_from_dict({**config.model_dump(), **sections}, "tessellm serve's flags")



def log_server_events(name: str = "tessellm.server", tag: str = "") -> None:
    """The server's own log lines (``tessellm.server``: a client that left, 499; an engine
    failure; ``tessellm.router``: a replica out or back, with ``tag``) on stderr from info
    level up, while uvicorn's stay at warning level."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(levelname)s:     {tag}%(message)s"))
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.propagate = False


def cmd_serve(args: argparse.Namespace) -> int:
    from tessellm.extras import require

    uvicorn = require("uvicorn", "serve")  # every server library is checked before a model loads
    for module in ("fastapi", "zmq", "msgpack", "prometheus_client"):
        require(module, "serve")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.data_parallel < 1:
        raise ConfigError(f"--data-parallel must be at least 1, got {args.data_parallel}")
    if args.max_request_bytes < 1024 or args.max_waiting < 1:
        raise ConfigError("--max-request-bytes must be at least 1024 and --max-waiting at least 1")
    if args.stream_interval < 1:
        raise ConfigError(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    if args.data_parallel > 1:
        from tessellm.serve.router.cli import cmd_serve_data_parallel

        return cmd_serve_data_parallel(args)
    config = serve_config(args)
    client = (thread_engine(config) if args.engine_core == "thread" else process_engine(config))
    return run_server(uvicorn, client, args)


def thread_engine(config: Any) -> Any:
    from tessellm.core.engine.llm import LLM

    return LLM(config)


def process_engine(config: Any) -> Any:
    """The engine core started in its own process; the tokenizer loaded here."""
    from tessellm.core.engine.pipeline import image_processor_for
    from tessellm.core.model.loader import load_tokenizer
    from tessellm.core.resolve import model_dir_for
    from tessellm.serve.engine_client import EngineClient
    from tessellm.serve.engine_process import ProcessTransport

    folder = model_dir_for(config)  # a GGUF file is converted here, once, before the core reads it
    transport = ProcessTransport(config)
    transport.start()
    try:
        tokenizer = load_tokenizer(folder)
    except BaseException:
        transport.stop()
        raise
    client = EngineClient(transport, tokenizer)
    client.image_processor_factory = lambda: image_processor_for(config, folder)
    client.images = config.images
    return client


def run_server(uvicorn: Any, engine: Any, args: argparse.Namespace) -> int:
    """Serve ``engine`` (an ``LLM`` or an ``EngineClient``) until stopped; 1 when the engine
    could no longer serve and the server stopped for it."""
    from tessellm.serve.app import build_app
    from tessellm.serve.supervise import CoreSupervisor

    app = build_app(engine, model_name=args.served_model_name, api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes, max_waiting=args.max_waiting,
                    stream_interval=args.stream_interval)
    client = app.state.engine
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    gave_up: list[str] = []

    def give_up(why: str) -> None:
        gave_up.append(why)
        if not args.keep_running:
            server.should_exit = True

    if client.transport.describe()["mode"] == "process":
        CoreSupervisor(client, restart=args.restart, max_restarts=args.max_restarts, give_up=give_up)
    info = client.info
    adapters = f" and LoRA adapters {', '.join(sorted(info.lora_adapters))}" if info.lora_adapters else ""
    print(f"tessellm: serving {args.served_model_name or info.model!r}{adapters} on http://{args.host}:{args.port}/v1 "
          f"(engine core: {args.engine_core}, pid {info.pid}; server pid {os.getpid()})", file=sys.stderr, flush=True)
    log_server_events()
    try:
        server.run()
    finally:
        client.shutdown()
    if gave_up and not args.keep_running:
        print(f"tessellm: stopped: {gave_up[0]}", file=sys.stderr, flush=True)
        return 1
    return 0
