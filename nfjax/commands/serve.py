"""`nfjax serve`: the OpenAI-compatible HTTP server (same flags as `python serve.py`)."""
from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from nfjax.config import ServerConfig
    d = ServerConfig()
    p.add_argument("--served-model-name", default=None,
                   help="name in /v1/models and requests (default: the model folder's name; nfjax-tiny)")
    p.add_argument("--host", default=d.host, help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port (0: any free port; default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests allowed to wait for a batch slot; more get HTTP 429 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted "
                        "(default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="seconds a client has to send a request body once its headers arrived; then HTTP 408 "
                        "and the connection is closed (default: %(default)s)")
    p.add_argument("--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug"])
    from nfjax.engine.builder import add_engine_args
    add_engine_args(p)


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="serve the OpenAI-compatible HTTP API (default model: the shipped tiny model)",
                       description=__doc__.splitlines()[0])
    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from nfjax.config import ServerConfig
    from nfjax.engine.builder import from_flags
    from nfjax.server import model_name_for, serve
    from nfjax.server.launch import bind_socket
    cfg = ServerConfig(host=args.host, port=args.port, max_queue=args.max_queue,
                       served_model_name=args.served_model_name, shutdown_timeout_s=args.shutdown_timeout,
                       log_level=args.log_level, request_timeout_s=args.request_timeout)
    sock = bind_socket(cfg.host, cfg.port, listen=False)     # a port in use is an error now, not after loading
    try:
        t0 = time.perf_counter()
        engine = from_flags(args, progress=sys.stderr.isatty())
        print(f"[model loaded and compiled in {time.perf_counter() - t0:.1f}s]", file=sys.stderr, flush=True)
    except BaseException:
        sock.close()
        raise
    return serve(engine, cfg, cfg.served_model_name or model_name_for(args.model), sock=sock)
