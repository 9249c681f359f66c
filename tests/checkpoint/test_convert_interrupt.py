"""`nfjax convert` interrupted (SIGINT, SIGTERM) or failing mid-write: the temp folder is removed, one stderr line,
a non-zero exit code; stale temp folders of earlier killed runs are removed, nothing else next to --out is."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

# The real CLI in a subprocess; reading a tensor is slowed (or fails) after the temp folder has been written to,
# so that the signal lands mid-write.
DRIVER = r"""
import sys, time
from nfjax import cli
from nfjax.checkpoint import convert as conv
mode = sys.argv[1]
orig = conv._Reader.get
def get(self, name, info):
    x = orig(self, name, info)
    if mode == "fail":
        raise OSError(28, "No space left on device")
    print("WRITING", flush=True)
    time.sleep(60)
    return x
conv._Reader.get = get
sys.exit(cli.main(["convert", "--no-progress", "--hf", sys.argv[2], "--out", sys.argv[3]]))
"""


def _temps(parent):
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


def _default_signals():
    """In the child before exec: SIGINT and SIGTERM at their defaults, as a user's shell starts a command. An
    ignored SIGINT is inherited across exec (and Python then keeps it ignored); the pytest worker that starts this
    test may hold one from whatever ran before it in that process, and the signal under test would be lost."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})      # a blocked one is inherited too


def _start(mode, hf, out):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-c", DRIVER, mode, str(hf), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_signals)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_write_removes_temp_folder(tiny_hf, tmp_path, sig):
    out = tmp_path / "out"
    proc = _start("slow", tiny_hf, out)
    try:
        assert proc.stdout.readline().strip() == "WRITING", proc.stderr.read()
        assert _temps(tmp_path), "the temp folder should exist mid-write"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("nfjax convert: interrupted"), err
    assert _temps(tmp_path) == [] and not out.exists()


def test_failure_mid_write_removes_temp_folder(tiny_hf, tmp_path):
    out = tmp_path / "out"
    proc = _start("fail", tiny_hf, out)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("nfjax convert: error: ") and "No space left" in err, err
    assert _temps(tmp_path) == [] and not out.exists()


def test_stale_temp_folders_of_dead_runs_are_removed(tiny_hf, tmp_path):
    from nfjax.checkpoint import convert as conv

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                              # a pid that no longer runs
    live = os.getppid()                                      # a running process: its folder is left alone
    stale_old = tmp_path / f".out.tmp-{dead.pid}-0123abcd"  # written before the marker existed
    (stale_old / ".staging").mkdir(parents=True)
    (stale_old / ".staging" / "x.npy").write_bytes(b"0" * 1000)
    stale_new = tmp_path / f".out.tmp-{dead.pid}-89abcdef"
    stale_new.mkdir()
    (stale_new / conv.TMP_MARKER).touch()
    (stale_new / "whatever").write_text("x")
    running = tmp_path / f".out.tmp-{live}-01234567"
    (running / "params").mkdir(parents=True)
    user_data = tmp_path / f".out.tmp-{dead.pid}-76543210"   # the right name but a file the converter never writes
    user_data.mkdir()
    (user_data / "notes.txt").write_text("mine")
    other = tmp_path / f".other.tmp-{dead.pid}-0123abcd"     # another output's temp folder
    (other / "params").mkdir(parents=True)
    not_ours = tmp_path / ".out.tmp-backup"
    not_ours.mkdir()

    conv.convert(tiny_hf, tmp_path / "out", progress=False)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["hf", "out", running.name, user_data.name, other.name, not_ours.name]), left
    assert not (tmp_path / "out" / conv.TMP_MARKER).exists()
