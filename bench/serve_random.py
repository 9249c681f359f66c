"""The engine bench/serving.py drives, served over HTTP in a process of its own (so the benchmark's client does
not share the engine loop's GIL): a checkpoint (default: the shipped tiny model) or a random-weight model of a
named shape, built exactly as the in-process mode builds it, served by nfjax.server.launch.serve until SIGTERM.

Once the server listens, `--info-json PATH` gets {"url", "model", "vocab_size", "max_model_len", "engine": {...}}
(written to a temporary name, then renamed: a reader never sees half a file).

usage: python bench/serve_random.py --shape llama3-8b --port 8000 [--info-json /tmp/info.json]
       python bench/serve_random.py --shape smoke --port 0 --token-buckets 32,128 --max-seqs 8
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")    # as bench/offline.py (GPU only)

CPU_NUM_PAGES = 512       # KV pages when the device reports no memory statistics (CPU) and none are given


def ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The flags that choose and size the engine (shared with bench/serving.py)."""
    ap.add_argument("--model", default=None, help="nfjax checkpoint folder (default: the shipped tiny model)")
    ap.add_argument("--shape", default=None, help="serve a random-weight model of this shape instead "
                                                  "(llama3-8b, llama3-70b, smoke); token-id prompts only")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--token-buckets", type=ints, default=None)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (with --model)")
    ap.add_argument("--max-seqs", type=int, default=None)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--max-pages-per-seq", type=int, default=None)


ENGINE_FLAGS = ("model", "shape", "dtype", "token_buckets", "tp", "max_seqs", "num_pages", "page_size",
                "max_pages_per_seq")


def engine_argv(args) -> list[str]:
    """`args`' engine flags back as a command line (for the server process)."""
    out = []
    for name in ENGINE_FLAGS:
        v = getattr(args, name)
        if v is None or (name == "tp" and v == 1):
            continue
        out += [f"--{name.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, tuple) else str(v)]
    return out


def build_engine(args):
    """The engine to serve: a checkpoint (default: the tiny model) or a random-weight model of a named shape."""
    from nfjax.engine import Engine
    if args.shape is None:
        engine = Engine.from_pretrained(args.model, dtype=args.dtype, page_size=args.page_size,
                                        num_pages=args.num_pages, max_pages_per_seq=args.max_pages_per_seq,
                                        token_buckets=args.token_buckets, max_seqs=args.max_seqs, tp=args.tp)
        from nfjax.server import model_name_for
        return engine, model_name_for(args.model)
    from nfjax.config import CacheConfig, EngineConfig, BatcherConfig
    from nfjax.kv.cache import pages_that_fit
    from nfjax.models.random_init import SHAPES, random_model
    from nfjax.tokenizer.silent import SilentTokenizer
    cfg = SHAPES[args.shape]
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    model = random_model(cfg)
    ps = args.page_size or 16
    num_pages = args.num_pages
    if not num_pages:
        try:
            num_pages = pages_that_fit(cfg, ps, 0.9)
        except RuntimeError:          # CPU: no memory statistics
            num_pages = CPU_NUM_PAGES
    per_seq = args.max_pages_per_seq or -(-cfg.max_position_embeddings // ps)
    cache = CacheConfig(page_size=ps, num_pages=num_pages, max_pages_per_seq=min(per_seq, num_pages - 1))
    sched = BatcherConfig(token_buckets=args.token_buckets or (256, 512, 1024, 2048),
                            max_seqs=args.max_seqs or 256)
    tok = SilentTokenizer(cfg.vocab_size, cfg.eos_token_ids)
    return Engine(model, tok, EngineConfig(cfg, cache, sched)), args.shape


def engine_info(engine) -> dict:
    import jax
    d = jax.devices()[0]
    return {"model_config": engine.model_config.to_json(), "cache": vars(engine.config.cache),
            "scheduler": vars(engine.config.batcher), "compile_s": engine.runner.compile_seconds,
            "device": f"{d.platform}:{getattr(d, 'device_kind', '?')}", "device_count": jax.device_count(),
            "jax": jax.__version__}


def write_json_atomic(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, default=repr)
    os.replace(tmp, path)


class ServerProcess:
    """bench/serve_random.py in a child process: started, waited for, stopped with SIGTERM."""

    def __init__(self, args):
        self._tmp = tempfile.TemporaryDirectory(prefix="nfjax-serving-")
        self.info_path = os.path.join(self._tmp.name, "info.json")
        cmd = [sys.executable, os.path.abspath(__file__), *engine_argv(args), "--port", "0",
               "--info-json", self.info_path]
        print("starting server:", " ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd)          # its output goes to ours
        self.info, self.url = {}, None

    def wait_ready(self, timeout: float) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.info_path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"server process exited with {self.proc.returncode} before listening")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not listen within {timeout:.0f}s")
            time.sleep(0.25)
        with open(self.info_path) as f:
            self.info = json.load(f)
        self.url = self.info["url"]
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print("server did not stop after SIGTERM; killing it", flush=True)
                self.proc.kill()
                self.proc.wait(30)
        self._tmp.cleanup()
        return self.proc.returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (see --info-json / the printed URL)")
    ap.add_argument("--info-json", default=None, help="write the URL and engine facts here once listening")
    ap.add_argument("--shutdown-timeout", type=float, default=5.0,
                    help="SIGTERM: seconds in-flight requests may still run before they are aborted")
    args = ap.parse_args(argv)

    from nfjax.config import ServerConfig
    from nfjax.server.launch import serve
    t = time.perf_counter()
    engine, model = build_engine(args)
    info = {"model": model, "vocab_size": engine.model_config.vocab_size, "max_model_len": engine.max_model_len,
            "startup_s": time.perf_counter() - t, "engine": engine_info(engine)}
    print(f"engine ready in {info['startup_s']:.1f}s (compile {info['engine']['compile_s']}s)", flush=True)

    def ready(url: str) -> None:
        if args.info_json:
            write_json_atomic(args.info_json, {"url": url, **info})

    cfg = ServerConfig(host=args.host, port=args.port, max_queue=1 << 20, log_level="warning",
                       shutdown_timeout_s=args.shutdown_timeout)
    return serve(engine, cfg, model, on_ready=ready)


if __name__ == "__main__":
    sys.exit(main())
