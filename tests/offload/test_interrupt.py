"""An interrupted offload run leaves no disk-tier files: `nfjax generate --offload` on the shipped tiny model,
with weights and KV on disk, stopped by SIGINT or SIGTERM mid-generation, exits 130 with its folder removed; one
killed by SIGKILL (no chance to clean up) leaves its folder, and the next run removes it. Also the trace: in the
zig-zag schedule a layer's weights load while the layer before computes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nfjax.engine import SamplingParams
from nfjax.offload import Policy, Split
from nfjax.offload.engine import OffloadEngine
from nfjax.offload.store import DiskFolder
from tests.offload.common import MAX_LEN, PROMPTS, model, tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    off = tmp_path / "offload"
    pol = tmp_path / "policy.json"
    Policy(gpu_batch_size=1, weights=Split(0, 50, 50), cache=Split(0, 0, 100), offload_dir=str(off)).save(pol)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "nfjax.cli", "generate", "--offload", str(pol), "--token-ids", "1 2 3",
                          "--max-tokens", "1000", "--temperature", "0", "--max-model-len", "1024"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        folders = [d for d in off.glob(".nfjax-offload-*")] if off.is_dir() else []
        if folders and any(f.name.startswith("kv") for f in folders[0].iterdir()):
            time.sleep(1.0)                   # generating: KV files exist once a block has started
            return p, off
        time.sleep(0.2)
    p.kill()
    raise AssertionError(f"the run did not start generating: {p.communicate()[1][-2000:]}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_removes_the_disk_tier(tmp_path, sig):
    p, off = _start(tmp_path)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    assert list(off.iterdir()) == [], "disk-tier files left behind"


def test_a_killed_runs_folder_is_removed_by_the_next_run(tmp_path):
    p, off = _start(tmp_path)
    p.kill()
    p.wait(timeout=60)
    left = list(off.iterdir())
    assert len(left) == 1 and any(left[0].iterdir())
    d = DiskFolder(off)
    try:
        assert [x.name for x in off.iterdir()] == [d.path.name]
    finally:
        d.close()
    assert list(off.iterdir()) == []


def test_trace_shows_weight_loads_overlapping_compute(tmp_path):
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0, 50, 50), cache=Split(0, 100, 0),
                 offload_dir=str(tmp_path))
    with OffloadEngine.from_model(model("opt"), tokenizer("opt"), pol, max_model_len=MAX_LEN, trace=True) as eng:
        eng.generate(PROMPTS[:4], SamplingParams.greedy(max_tokens=3, ignore_eos=True))
        events = eng.trace.to_json()
    lanes = {e["lane"] for e in events}
    assert {"compute", "load weights", "load cache", "store cache"} <= lanes
    compute = sorted((e for e in events if e["lane"] == "compute"), key=lambda e: e["start_ms"])
    L, nb = model("opt").cfg.num_layers, 2
    loads = {j: sorted((e for e in events if e["lane"] == "load weights" and e["label"] == f"L{j}"),
                       key=lambda e: e["start_ms"]) for j in range(L)}
    assert len(compute) == 3 * L * nb                                   # prefill + 2 decode passes
    assert [len(loads[j]) for j in range(L)] == [4] + [3] * (L - 1)     # L0 also for the pass after the last
    for p in range(3):
        for j in range(L):
            # layer j's weights were on their way while layer j-1's batches computed (layer 0: the previous
            # pass's last layer)
            if p == 0 and j == 0:
                continue
            last_of_prev = compute[p * L * nb + j * nb - 1]
            assert last_of_prev["label"] == f"L{(j - 1) % L} B{nb - 1}"
            assert loads[j][p]["start_ms"] < last_of_prev["end_ms"], (p, j)
