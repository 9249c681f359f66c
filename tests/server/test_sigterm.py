"""`python serve.py` as a real process: prints its address, serves, and on SIGTERM stops accepting, aborts the
stream still running after the grace period (error event + [DONE]) and exits 0."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from nfjax.cli import SUBCOMMANDS
from nfjax.commands import serve as serve_cmd

ROOT = Path(__file__).resolve().parents[2]


def test_nfjax_serve_subcommand_is_registered(capsys):
    assert SUBCOMMANDS["serve"] == "nfjax.commands.serve"
    parser = argparse.ArgumentParser(prog="nfjax")
    serve_cmd.add_parser(parser.add_subparsers(dest="command"), "serve")
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--token-buckets", "--max-seqs", "--max-queue", "--num-pages"):
        assert flag in out


def test_sigterm_stops_gracefully_with_exit_0(model_dir):
    cmd = [sys.executable, "serve.py", "--port", "0", "--token-buckets", "32", "--max-seqs", "4",
           "--shutdown-timeout", "1", "--log-level", "warning"]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                ready.set()
    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while not ready.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("server did not start:\n" + "".join(lines))
        url = next(ln for ln in lines if "listening on" in ln).split("listening on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        got: list[str] = []
        first = threading.Event()

        def stream():
            body = {"prompt": "The class", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line:
                        got.append(line)
                        first.set()
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first.wait(60), "no token streamed"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "".join(lines)
        t.join(30)
        assert not t.is_alive()
        assert got[-1] == "data: [DONE]"
        err = json.loads(got[-2][len("data: "):])["error"]
        assert err["code"] == "server_shutting_down" and "shutting down" in err["message"]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.parametrize("entry", [["serve.py"], ["-m", "nfjax.cli", "serve"]])
def test_port_in_use_fails_at_once_before_loading(entry):
    """A port another process listens on: one error line naming host:port, exit 2, before the model loads."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, *entry, "--port", str(port), "--model", "/nonexistent/model"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    prog = "serve.py" if entry == ["serve.py"] else "nfjax serve"
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"{prog}: error: cannot listen on 127.0.0.1:{port}: Address already in use\n", r.stderr
    assert took < 30, took         # --model is never read: the port is checked first
