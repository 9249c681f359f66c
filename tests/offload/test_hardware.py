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
    tokens = [t for t, _ in prof.gemm_curve]
    assert len(tokens) >= 2 and tokens == sorted(tokens) and prof.gemm_flops == max(r for _, r in prof.gemm_curve)
    assert prof.h2d_one_bytes > 0 and prof.version == hardware.PROFILE_VERSION
    from nfjax.offload.cpu_attention import THREADS
    assert prof.cpu_threads == THREADS and prof.cpu_attn_pieces == 8 and prof.cpu_attn_sat_bytes > 0
    assert prof.cpu_attn_one_bytes > 0
    sizes = [b for b, _ in prof.h2d_curve]
    assert len(sizes) == 6 and sizes == sorted(sizes) and all(r > 0 for _, r in prof.h2d_curve)
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
    # a profile of an older version (one small GEMM read as the matmul rate) is measured again, not used
    doc = json.loads(path.read_text())
    doc.pop("version")
    doc["gemm_flops"] = 123.0
    path.write_text(json.dumps(doc))
    assert hardware.measure(dtype="float32", disk_dir=tmp_path / "disk").gemm_flops != 123.0


def test_matmul_rate_grows_with_the_gemm():
    """The profiler's matmul probe (dependent GEMM pairs in one program, as a layer's fc1 / fc2) reads a rate that
    grows with the work of a call: a small GEMM is dominated by the call's fixed cost, as on a GPU a 2048-square
    one was (180 TFLOP/s measured on an H200 that runs 30B-sized GEMMs at ~720)."""
    dev = jax.devices()[0]
    small = hardware.matmul_rate(dev, "float32", 1, 64, 128, reps=1)
    large = hardware.matmul_rate(dev, "float32", 256, 256, 1024, reps=2)
    assert 0 < small < large, (small, large)


def test_profile_curve_and_rates():
    """A measured profile: the GEMM curve over token counts (ascending) with `gemm_flops` its best point, the rate
    interpolated between points and flat beyond them; the link rate is the pinned one where measured."""
    p = hardware.HardwareProfile("t", "t", gemm_flops=4.0, hbm_bytes=1.0, h2d_bytes=1.0, h2d_pinned_bytes=8.0,
                                 d2h_bytes=1.0, disk_read_bytes=1.0, disk_write_bytes=1.0, cpu_attn_bytes=1.0,
                                 dispatch_s=0.0, gemm_curve=[[10, 1.0], [1000, 4.0]])
    assert p.gemm_rate(1) == 1.0 and p.gemm_rate(5000) == 4.0 and math.isclose(p.gemm_rate(100), 2.5)
    assert p.link_h2d() == 8.0
    import dataclasses
    assert dataclasses.replace(p, h2d_pinned_bytes=None).link_h2d() == 1.0
    assert hardware.HardwareProfile.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert hardware.HardwareProfile("t", "t", 4.0, 1.0, 1.0, None, 1.0, 1.0, 1.0, 1.0, 0.0).gemm_rate(7) == 4.0


def _prof(**kw) -> hardware.HardwareProfile:
    base = dict(gemm_flops=4.0, hbm_bytes=1.0, h2d_bytes=2.0, h2d_pinned_bytes=8.0, d2h_bytes=1.0,
                disk_read_bytes=1.0, disk_write_bytes=1.0, cpu_attn_bytes=8.0, dispatch_s=0.0)
    return hardware.HardwareProfile("t", "t", **{**base, **kw})


def test_stage_rate_follows_the_curve_of_pair_sizes():
    p = _prof(h2d_curve=[[100, 10.0], [400, 20.0]])
    assert p.stage_rate(50) == 10.0 and p.stage_rate(1000) == 20.0 and math.isclose(p.stage_rate(200), 15.0)
    assert _prof().stage_rate(200) == 2.0                          # no curve: the pair rate
    assert hardware.HardwareProfile.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_kv_store_rate_is_the_pinned_way_only_where_the_runtime_takes_it():
    from nfjax.offload.store import PINNED_STORE_BYTES
    p = _prof(d2h_pinned_bytes=6.0)
    assert p.kv_store_rate("pinned", PINNED_STORE_BYTES) == 6.0
    assert p.kv_store_rate("pinned", PINNED_STORE_BYTES - 1) == 1.0          # small rows: numpy's way
    assert p.kv_store_rate("numpy", 10 * PINNED_STORE_BYTES) == 1.0
    assert _prof().kv_store_rate("pinned", 10 * PINNED_STORE_BYTES) == 1.0   # not measured: numpy's


def test_cpu_attention_runs_at_the_threads_its_pieces_keep_busy():
    """The bench's 8 pieces ran at 8 GB/s: 1 a thread. Three pieces get 3, 12 pieces on 16 threads 12, capped by the
    saturated bench's rate; a profile without the split reads the bench's rate for any block."""
    p = _prof(cpu_threads=16, cpu_attn_pieces=8, cpu_attn_sat_bytes=10.0)
    assert math.isclose(p.cpu_attention_s(30.0, 3), 10.0)
    assert math.isclose(p.cpu_attention_s(30.0, 12), 3.0)
    assert math.isclose(p.cpu_attention_s(30.0, 100), 3.0)
    assert math.isclose(p.cpu_attention_s(30.0, None), 30.0 / 8.0)
    assert math.isclose(_prof().cpu_attention_s(30.0, 3), 30.0 / 8.0)


def test_cpu_attention_threads_run_at_the_one_piece_rate_where_measured():
    """Profile v7: a thread runs at the one-piece bench's rate (2 GB/s here, where the 8-piece bench's 8 over 8
    threads gave 1), so 3 pieces get 6; many pieces are still capped by the saturated bench."""
    p = _prof(cpu_threads=16, cpu_attn_pieces=8, cpu_attn_sat_bytes=10.0, cpu_attn_one_bytes=2.0)
    assert math.isclose(p.cpu_attention_s(30.0, 3), 5.0)
    assert math.isclose(p.cpu_attention_s(30.0, 12), 3.0)
    assert hardware.HardwareProfile.from_json(json.loads(json.dumps(p.to_json()))) == p
