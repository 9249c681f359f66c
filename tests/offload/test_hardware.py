"""The hardware profile (nfjax/offload/hardware.py): every rate measured on this machine (on a CPU-only machine the
device is the CPU), and the per-machine cache: read back as written, measured again on request."""
from __future__ import annotations

import json
import math

import jax

from nfjax.offload import hardware


def test_measure_caches_per_machine_and_remeasures_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("NFJAX_CACHE", str(tmp_path / "cache"))
    lines = []
    prof = hardware.measure(dtype="float32", disk_dir=tmp_path / "disk", log=lines.append)
    dev = jax.devices()[0]
    assert prof.device_kind == dev.device_kind
    for f in ("gemm_flops", "hbm_bytes", "h2d_bytes", "d2h_bytes", "disk_read_bytes", "disk_write_bytes",
              "cpu_attn_bytes", "dispatch_s"):
        v = getattr(prof, f)
        assert math.isfinite(v) and v > 0, f
    assert 1e6 < prof.gemm_flops < 1e16 and prof.dispatch_s < 1.0
    assert list((tmp_path / "disk").iterdir()) == []            # the disk probe's file is gone
    path = hardware.cache_path(dev.device_kind)
    assert path.is_file() and "measured" in lines[0]
    # the cache is what the next call returns (a value no measurement would give, written into it)
    doc = json.loads(path.read_text())
    doc["gemm_flops"] = 123.0
    path.write_text(json.dumps(doc))
    assert hardware.measure(dtype="float32", disk_dir=tmp_path / "disk").gemm_flops == 123.0
    again = hardware.measure(dtype="float32", disk_dir=tmp_path / "disk", remeasure=True)
    assert again.gemm_flops > 1e6 and json.loads(path.read_text())["gemm_flops"] == again.gemm_flops
