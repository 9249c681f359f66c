"""The engine bench/serving.py drives, served over HTTP in a process of its own (so the benchmark's client does
not share the engine loop's GIL): a checkpoint (default: the shipped tiny model) or a random-weight model of a
named shape, built as the in-process mode builds it (bench/setup.py), served by nfjax.server.launch.serve until
SIGTERM.

Once the server listens, `--info-json PATH` gets {"url", "model", "vocab_size", "max_model_len", "engine": {...}}
(written to a temporary name, then renamed: a reader never sees half a file).

usage: python -m bench.server --shape llama3-8b --port 8000 [--info-json /tmp/info.json]
       python -m bench.server --shape smoke --port 0 --token-buckets 32,128 --max-seqs 8
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

from bench.common import module_command
from bench.setup import add_bench_args, bench_engine, config_record, engine_argv


def served_engine(args):
    """(engine, served model name): a random-weight model of --shape, or the --model checkpoint."""
    engine = bench_engine(args)
    if args.shape:
        return engine, args.shape
    from nfjax.server import model_name_for
    return engine, model_name_for(args.model)


def engine_info(engine) -> dict:
    import jax
    d = jax.devices()[0]
    return {"model_config": engine.model_config.to_json(), **config_record(engine.config),
            "compile_s": engine.runner.compile_seconds,
            "device": f"{d.platform}:{getattr(d, 'device_kind', '?')}", "device_count": jax.device_count(),
            "jax": jax.__version__}


def write_json_atomic(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, default=repr)
    os.replace(tmp, path)


class ServerProcess:
    """bench/server.py in a child process: started, waited for, stopped with SIGTERM."""

    def __init__(self, args):
        self._tmp = tempfile.TemporaryDirectory(prefix="nfjax-serving-")
        self.info_path = os.path.join(self._tmp.name, "info.json")
        cmd = module_command("bench.server", *engine_argv(args), "--port", "0", "--info-json", self.info_path)
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
    add_bench_args(ap, shape=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (see --info-json / the printed URL)")
    ap.add_argument("--info-json", default=None, help="write the URL and engine facts here once listening")
    ap.add_argument("--shutdown-timeout", type=float, default=5.0,
                    help="SIGTERM: seconds in-flight requests may still run before they are aborted")
    args = ap.parse_args(argv)

    from nfjax.config import ServerConfig
    from nfjax.server.launch import serve
    t = time.perf_counter()
    engine, model = served_engine(args)
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
