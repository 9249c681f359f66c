"""`nfjax serve`: the OpenAI-compatible HTTP server (same flags as `python serve.py`)."""
from __future__ import annotations

import argparse
import sys
import time


def _int_list(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    from nfjax.config import ServerConfig
    d = ServerConfig()
    p.add_argument("--model", default=None, help="nfjax checkpoint folder (default: the shipped tiny model)")
    p.add_argument("--served-model-name", default=None,
                   help="name in /v1/models and requests (default: the model folder's name; nfjax-tiny)")
    p.add_argument("--host", default=d.host, help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port (0: any free port; default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
    p.add_argument("--token-buckets", type=_int_list, default=None, metavar="N,N,...",
                   help="dense token budgets, one compiled step each (e.g. 64,256)")
    p.add_argument("--max-seqs", type=int, default=None, help="sequences per step")
    p.add_argument("--num-pages", type=int, default=None, help="KV-cache pages")
    p.add_argument("--page-size", type=int, default=None, help="tokens per KV page")
    p.add_argument("--max-pages-per-seq", type=int, default=None, help="page-table width (context = this x page size)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests allowed to wait for a batch slot; more get HTTP 429 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug"])


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="serve the OpenAI-compatible HTTP API (default model: the shipped tiny model)",
                       description=__doc__.splitlines()[0])
    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from nfjax.config import ServerConfig
    from nfjax.engine import Engine
    from nfjax.server import model_name_for, serve
    cfg = ServerConfig(host=args.host, port=args.port, max_queue=args.max_queue,
                       served_model_name=args.served_model_name, shutdown_timeout_s=args.shutdown_timeout,
                       log_level=args.log_level)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, page_size=args.page_size,
                                    num_pages=args.num_pages, max_pages_per_seq=args.max_pages_per_seq,
                                    token_buckets=args.token_buckets, max_seqs=args.max_seqs, tp=args.tp,
                                    progress=sys.stderr.isatty())
    print(f"[model loaded and compiled in {time.perf_counter() - t0:.1f}s]", file=sys.stderr, flush=True)
    return serve(engine, cfg, cfg.served_model_name or model_name_for(args.model))
