"""``tessellm serve``: its arguments and the server it starts."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


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



def log_server_events() -> None:
    """The server's own log lines (``tessellm.server``: a client that left, 499; an engine
    failure) on stderr from info level up, while uvicorn's stay at warning level."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("tessellm.server")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.propagate = False


def cmd_serve(args: argparse.Namespace) -> int:
    from tessellm.core.engine.llm import LLM
    from tessellm.core.errors import ConfigError
    from tessellm.extras import require

    uvicorn = require("uvicorn", "serve")  # every server library is checked before a model loads
    from tessellm.serve.app import build_app

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.max_request_bytes < 1024 or args.max_waiting < 1:
        raise ConfigError("--max-request-bytes must be at least 1024 and --max-waiting at least 1")
    llm = LLM(args.config, overrides=args.overrides)
    app = build_app(llm, model_name=args.served_model_name, api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes, max_waiting=args.max_waiting)
    print(f"tessellm: serving {args.served_model_name or llm.pipeline.config.model!r} on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    log_server_events()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
