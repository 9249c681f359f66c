"""Peer engines (vLLM) run beside nfjax in the benches, each in a process of its own, so torch and JAX never
hold the GPU at once. `run_json_child` starts such a process and reads the one JSON line it ends with."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_MODULE = "bench.peers.vllm"          # run from ROOT: python -m bench.peers.vllm


def last_json_line(text: str) -> dict | None:
    """The last stdout line that parses as a JSON object (the peer's result), or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                return doc
    return None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_json_child(cmd: list[str], timeout: float, env: dict | None = None, label: str = "peer") -> dict:
    """Run `cmd` in a new process group, echo its output lines (prefixed with `label`) as they come, and return
    its last JSON line; {"error": ...} if it printed none or ran past `timeout` seconds (then the last JSON line
    it did print, if any, is kept under "partial_result"). The whole group is killed at the end: vLLM's engine
    core runs in a grandchild that would otherwise keep the GPU after a timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True, bufsize=1)
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            shown = line if len(line) < 400 else line[:400] + "...\n"   # the result line is long
            print(f"[{label}] {shown}", end="", flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(proc.pid)
        proc.wait()
        reader.join(timeout=10)
    out = "".join(lines)
    res = last_json_line(out)
    if timed_out:
        return {"error": f"{label} timed out after {timeout:.0f}s", "partial_result": res}
    if res is None:
        return {"error": f"{label} exited with {proc.returncode} and no JSON line: {out[-1500:]}"}
    return res
