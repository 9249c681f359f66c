"""The probes in bench/probes/: stream_schedule's reading of a scheduled HLO entry computation (the text XLA
prints in order), and host_overhead driving the real batcher through whole workloads without a model."""
import pytest

from bench.probes.host_overhead import drive
from bench.probes.stream_schedule import region_windows

HLO = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %call-start = ((f32[8]{0}), f32[8]{0}) call-start(%p), to_apply=%a
  %call-start.1 = ((f32[8]{0}), f32[8]{0}) call-start(%p), to_apply=%b
  %fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, calls=%f
  %call-done = f32[8]{0} call-done(%call-start)
  %call-start.2 = ((f32[8]{0}), f32[8]{0}) call-start(%p), to_apply=%c
  %call-done.2 = f32[8]{0} call-done(%call-start.2)
  %call-done.1 = f32[8]{0} call-done(%call-start.1)
  ROOT %add = f32[8]{0} add(%call-done, %call-done.1)
}
"""


def test_region_windows_count_what_runs_before_each_done():
    w = {x["start"]: x for x in region_windows(HLO)}
    assert w["call-start"]["between"] == 2
    assert w["call-start"]["kernels_or_regions"] == ["call-start.1", "fusion.3"]
    assert w["call-start.2"]["between"] == 0                     # a lone region: its done follows at once
    assert w["call-start.1"]["between"] == 4


def _batcher(num_pages: int) -> dict:
    return {"cache": {"num_pages": num_pages}, "batcher": {"max_seqs": 8, "token_buckets": (32, 64)}}


def test_drive_runs_every_request_to_completion_under_memory_pressure():
    roomy = drive("16x8", 24, _batcher(4096))
    # 8 usable pages hold 4 sequences of 16 + 8 tokens at their predicted ends: admission waits for room
    tight = drive("16x8", 24, _batcher(9))
    assert tight["mean_decodes"] <= 4 < roomy["mean_decodes"]
    assert tight["steps"] > roomy["steps"] >= 8          # every request's 8 tokens, fewer at a time when tight


def test_kv_probe_fake_schemes_match_the_format_and_wait_for_full_pages():
    """kv_int4_variants: rot64 is kv_quant's int4 round trip; a per-page scheme reads a page still filling exactly
    (or through its /SCHEME), and its bits count the per-page parameters."""
    import numpy as np
    import jax.numpy as jnp
    from bench.probes import kv_int4_variants as p
    from pallas_kernels import kv_quant as kq
    x = jnp.asarray(np.random.RandomState(0).randn(2, 256, 3, 64).astype(np.float32))
    lens = jnp.asarray([100, 256])
    y = p.fake(x, p.parse_scheme("rot64"), 0, lens)
    q, s, c = kq.quantize_int4(kq.rotate(x, jnp.float32))
    np.testing.assert_allclose(y, kq.rotate(kq.dequantize_int4(q, s, c), jnp.float32), atol=1e-5)
    kivi = p.fake(x, p.parse_scheme("kivi64"), 0, lens)
    assert np.array_equal(kivi[0, 64:], x[0, 64:])                  # positions 64..99 fill a page still open
    assert not np.allclose(kivi[0, :64], x[0, :64]) and not np.allclose(kivi[1, 192:], x[1, 192:])
    tail = p.fake(x, p.parse_scheme("kivi64/rot64"), 0, lens)
    np.testing.assert_allclose(tail[0, 64:100], y[0, 64:100], atol=1e-6)
    # per channel: each channel of a page spans its own 16 levels
    page = np.asarray(kivi[1, :64, 0])
    assert all(len(np.unique(page[:, ch])) <= 16 for ch in range(64))
    assert p.bits(p.parse_scheme("kivi16"), 64) == 6.0 and p.bits(p.parse_scheme("rot64"), 128) == 4.5
    # @sN: a block starting at position 8 keeps positions < 20 in bf16, the rest through the inner scheme
    sink = p.fake(x, p.parse_scheme("rot64@s20"), 8, lens)
    inner = p.fake(x, p.parse_scheme("rot64"), 8, lens)
    np.testing.assert_array_equal(sink[:, :12], x[:, :12].astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(sink[:, 12:], inner[:, 12:])
    # cal+rfp8: centered by the calibrated mean, then rfp8; with a zero mean and unit std it is rfp8 itself
    plain = (jnp.zeros((3, 64)), jnp.ones((3, 64)))
    np.testing.assert_array_equal(p.fake(x, p.parse_scheme("cal+rfp8"), 0, lens, plain),
                                  p.fake(x, p.parse_scheme("rfp8"), 0, lens))
    shifted = (jnp.full((3, 64), 3.0), jnp.ones((3, 64)))
    np.testing.assert_allclose(p.fake(x + 3.0, p.parse_scheme("cal+rfp8"), 0, lens, shifted),
                               p.fake((x + 3.0) - 3.0, p.parse_scheme("rfp8"), 0, lens) + 3.0, atol=1e-6)


def test_batcher_replay_forms_every_step_and_sets_the_model_beside_a_measured_run(capsys):
    """batcher_replay: bench/offline.py's workload run to the end on a small pool, the policies switched by
    variant flags, and the measured step kinds read from a bench result."""
    from bench.probes import batcher_replay as r
    from bench.workloads import parse
    from nfjax.config import BatcherConfig
    work = parse("sharegpt", 48, r.LLAMA3_8B.vocab_size, seed=1)
    cfg = BatcherConfig(token_buckets=(16, 32, 64, 128, 256), max_seqs=64)
    now = r.replay(work, 2000, cfg, r.GEMM_MS)
    before = r.replay(work, 2000, cfg, r.GEMM_MS, batcher_cls=r.policy(False, 0.0, 1.0))
    longest = max(o for _, o in work)
    assert before["steps"] >= now["steps"] >= longest and now["preemptions"] == before["preemptions"] == 0
    assert now["padding"] < before["padding"] and now["model_s"] < before["model_s"]
    assert sum(d["steps"] for d in now["kind_detail"].values()) == now["steps"]
    from pathlib import Path
    result = Path(__file__).parents[2] / "bench/results/offline-sharegpt2000-forecast-20261125.json"
    m = r.measured_kinds(str(result))[("sharegpt", 2000)]
    assert m["decode@16"][0] == 282 and 8 < m["decode@16"][1] < 8.2       # mean 11.1 ms less 3.0 ms waiting
    r.main(["--workloads", "sharegpt", "--num-requests", "48", "--num-pages", "2000",
            "--variants", "before=--fcfs --no-defer --no-shorten --buckets 16,64,256;now=--buckets 16,64,256"])
    out = capsys.readouterr().out
    assert "sharegpt  before" in out and "sharegpt  now" in out


def test_pass_trace_counts_each_lane_once_per_pass():
    """offload_pass_trace: passes split at every `per_pass`-th computation; a lane's busy time is the union of its
    spans within the pass (two I/O threads loading at once count once), clipped to the pass."""
    import pytest
    from bench.probes.offload_pass_trace import parse_policy, pass_stats
    ev = [dict(lane="load cache", label="a", start_ms=0.0, end_ms=4.0),
          dict(lane="load cache", label="b", start_ms=2.0, end_ms=6.0),      # overlaps a: union 0-6
          dict(lane="compute", label="L0 B0", start_ms=5.0, end_ms=8.0),
          dict(lane="compute", label="L0 B0 unpack", start_ms=8.0, end_ms=9.0),   # not a pass's computation
          dict(lane="compute", label="L0 B1", start_ms=8.0, end_ms=10.0),
          dict(lane="load cache", label="c", start_ms=9.0, end_ms=12.0),     # 1 ms in pass 0, 2 in pass 1
          dict(lane="compute", label="L0 B0", start_ms=12.0, end_ms=13.0),
          dict(lane="compute", label="L0 B1", start_ms=13.0, end_ms=15.0)]
    p0, p1 = pass_stats(ev, 2)
    assert p0["wall_ms"] == 10.0 and p0["load_cache_ms"] == 7.0 and p0["compute_ms"] == 5.0
    assert p1["wall_ms"] == 5.0 and p1["load_cache_ms"] == 2.0 and p1["compute_ms"] == 3.0
    assert parse_policy("16x2:25/75/0")["cache"] == (25.0, 75.0, 0.0)
    with pytest.raises(SystemExit, match="BSxNB"):
        parse_policy("16x2")


def test_address_changes_count_programs_whose_buffers_moved_since_the_step_before():
    from bench.probes.itl_spikes import address_changes
    calls = [("embed16", 1e-3, 0, (1, 2)), ("steps16", 2e-3, 0, (3,)),          # step 0: nothing to compare with
             ("embed16", 1e-3, 0, (1, 2)), ("steps16", 9e-3, 0, (4,)),          # step 1: the layer program moved
             ("embed16", 1e-3, 0, (5, 2)), ("steps16", 2e-3, 0, (4,))]          # step 2: the embed moved
    out = address_changes(calls)
    assert [s["moved"] for s in out["steps"]] == [[], ["steps16"], ["embed16"]]
    assert out["slow_changed_mean"] == 1 and abs(out["slow_enqueue_ms_mean"] - 10.0) < 1e-9     # step 1: slowest
    assert out["rest_changed_mean"] == 0.5


def test_thread_log_records_own_rusage_and_names_a_busy_thread_beside_the_launch():
    import threading
    import time
    from bench.probes.itl_spikes import ThreadLog, thread_summary

    class Runner:
        def launch(self, batch):
            if batch == "slow":
                t = time.thread_time()
                while time.thread_time() - t < 0.03:        # 30 ms of this thread's own CPU
                    pass
            return batch

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))
    runner = Runner()
    log = ThreadLog(runner)
    busy = threading.Thread(target=spin, name="busy-neighbor")
    busy.start()
    try:
        for b in ["fast"] * 8 + ["slow"] * 2:
            assert runner.launch(b) == b
            time.sleep(0.01)
    finally:
        stop.set()
        busy.join()
    out = thread_summary(log.take())
    assert len(out["rows"]) == 10 and log.take() == []
    assert out["slow"]["user_ms"] + out["slow"]["sys_ms"] >= 25 > out["rest"]["user_ms"] + out["rest"]["sys_ms"]
    assert out["slow"]["ms"] > out["rest"]["ms"]
    assert out["slow_busiest_others"][0][0] == "busy-neighbor"
    assert all(r["steal_ms"] >= 0 and r["steal_own_cpu_ms"] >= 0 for r in out["rows"])    # /proc/stat's counter


def test_split_k_gemm_equals_the_plain_product():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench.probes.skinny_gemm import SPLITS, splitk_of
    x = jax.random.normal(jax.random.key(0), (5, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 24), jnp.float32)
    for s in SPLITS:
        np.testing.assert_allclose(np.asarray(splitk_of(x, w, s)), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


def test_dequant_probe_variants_parse_and_refuse_unknown_knobs():
    import pytest
    from bench.probes.dequant_sass import parse_variant, slug
    assert slug("int8:none@block_kv=64+num_stages=4") == "int8_none_block_kv64_num_stages4"
    assert parse_variant("fp8") == ("fp8", frozenset(), {})
    assert parse_variant("int8:none@block_kv=64+num_stages=4") == ("int8", {"none"}, {"block_kv": 64, "num_stages": 4})
    assert parse_variant("int4:nodeq+nomma") == ("int4", {"nodeq", "nomma"}, {})
    assert parse_variant("int4@pipeline=1+num_ctas=264") == ("int4", frozenset(), {"pipeline": 1, "num_ctas": 264})
    assert parse_variant("int4@group_accs=1") == ("int4", frozenset(), {"group_accs": 1})
    for bad in ("int8:xor", "int8@stages=4", "int4@block_kv=x"):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad)


def test_dequant_probe_runs_without_matmuls_on_every_consumer_path():
    """The probe's `nomma` skip replaces each of the consumer's matmul entry points (the score wgmmas, vp, and the
    pipelined consumer's both at once): the kernel runs through in interpret mode, and with no P V product every
    output is 0."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench.kernels.kv_decode import make_cache
    from bench.probes import dequant_sass
    from pallas_kernels import paged_decode_swapped as sw
    kc, vc, aux = make_cache(jax.random.key(0), "fp8", 8, 16, 64, kvh=2)
    q = jax.random.normal(jax.random.key(1), (2, 8, 64), jnp.bfloat16)
    args = (q, kc, vc, jnp.int32(0), jnp.arange(8, dtype=jnp.int32).reshape(2, 4), jnp.asarray([64, 0], jnp.int32))
    real = sw.Ops
    try:
        sw.Ops = dequant_sass._NoMatmulOps
        for kw in ({"fp8_mma": True}, {"fp8_mma": False, "k_in_consumer": True, "dequant_wgs": 1, "num_stages": 4},
                   {"fp8_mma": True, "pipeline": True, "row_sums": "wgmma"}):
            out = sw.paged_decode_attention_swapped(*args, scale=0.125, num_ctas=2, block_kv=64, interpret=True,
                                                    aux_cache=aux, **kw)
            assert np.all(np.asarray(out, np.float32) == 0)
        # int8_mma: K's codes in int8 wgmmas, as stored or unpacked; int4's a group an accumulator (group_accs)
        for fmt, kw in (("int8", {}), ("int4", {}), ("int4", {"group_accs": True})):
            kc, vc, aux = make_cache(jax.random.key(0), fmt, 8, 16, 128, kvh=2)
            q = jax.random.normal(jax.random.key(1), (2, 8, 128), jnp.bfloat16)
            out = sw.paged_decode_attention_swapped(q, kc, vc, *args[3:], scale=0.125, num_ctas=2, block_kv=64,
                                                    interpret=True, aux_cache=aux, int8_mma=True, **kw)
            assert np.all(np.asarray(out, np.float32) == 0)
    finally:
        sw.Ops = real


def test_dense_swiglu_probe_checks_and_times_both_paths_on_cpu(tmp_path):
    """The probe's CPU smoke (interpret mode, a two-tile gate/up): both paths agree and the summary holds both."""
    import json
    from bench.probes import dense_swiglu
    dense_swiglu.main(["--smoke", "--out", str(tmp_path)])
    (f,) = tmp_path.glob("dense_swiglu-*.json")
    d = json.loads(f.read_text())
    assert set(d["summary"]) == {"us_m136_xla", "us_m136_128x256_s4_ws"}
    (row,) = d["data"]["rows"]
    assert row["128x256_s4_ws"][1] < 1e-2            # the epilogue's values against XLA's dot + swiglu


def test_skinny_gemm_probe_persistent_rows_lower_for_the_gpu_and_refuse_unknown_configs(capsys):
    """Every default tile config of the probe's persistent-GEMM rows lowers for CUDA at a decode size of the
    narrowest and widest weights it times (so a device call does not spend its time on a config error)."""
    import jax
    import jax.numpy as jnp
    import pytest
    from bench.probes import skinny_gemm
    from pallas_kernels.persistent_gemm import persistent_gemm
    sds = jax.ShapeDtypeStruct
    for cfg in skinny_gemm.PGEMM_CONFIGS:
        for name in ("o", "gate_up"):
            k, n = skinny_gemm.SHAPES[name]
            persistent_gemm.trace(sds((16, k), jnp.bfloat16), sds((k, n), jnp.bfloat16), config=cfg).lower(
                lowering_platforms=("cuda",))
    with pytest.raises(SystemExit):
        skinny_gemm.main(["--pgemm-configs", "128x128_s5_ws,nope"])
    assert "unknown 'nope'" in capsys.readouterr().err



def test_split_k_through_the_grouped_gemm_equals_the_product():
    """The probe's split K as one grouped GEMM (interpret mode): ragged rows (5, padded to the 64-row tile), K in 2
    and 4 slices of whole 64-column steps; and it lowers for CUDA at a decode size of o."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench.probes.skinny_gemm import SHAPES, grouped_splitk
    x = jax.random.normal(jax.random.key(0), (5, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (256, 256), jnp.bfloat16)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
    for s in (2, 4):
        got = np.asarray(grouped_splitk(x, w, s, interpret=True), np.float32)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2, s
    k, n = SHAPES["o"]
    sds = jax.ShapeDtypeStruct
    jax.jit(lambda a, b: grouped_splitk(a, b, 4)).trace(sds((16, k), jnp.bfloat16), sds((k, n), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",))


def test_engine_window_tells_pallas_kernels_apart_and_counts_idle_time():
    """engine_window: Pallas kernels keyed by their grid (the decode kernel's SM count, the prefill kernel's tiles),
    per-step ms over the window, and the GPU's idle share of the window's wall time."""
    from types import SimpleNamespace as NS
    from bench.probes.engine_window import kernel_key, window_table
    dec = {"kernel_details": "regs:255 grid:132,1,1 block:512,1,1", "hlo_op": "command_buffer_1"}
    pre = {"kernel_details": "grid:1152,1,1", "hlo_op": "command_buffer_1"}
    assert kernel_key("body_mosaic_gpu_kernel", dec) == "body_mosaic_gpu_kernel [grid:132,1,1 command_buffer_1]"
    assert kernel_key("body_mosaic_gpu_kernel", {}) == "body_mosaic_gpu_kernel"
    assert kernel_key("gemm_fusion_dot", dec) == "gemm_fusion_dot"
    ev = lambda name, start, dur, stats: NS(name=name, start_ns=start, duration_ns=dur, stats=list(stats.items()))
    # two steps of 10 ms wall: 6 ms of kernels each, the rest idle
    events = [ev("body_mosaic_gpu_kernel", 0, 2e6, dec), ev("gemm", 2e6, 4e6, {}),
              ev("body_mosaic_gpu_kernel", 10e6, 2e6, pre), ev("gemm", 12e6, 4e6, {}), ev("gemm", 16e6, 4e6, {})]
    pd = NS(planes=[NS(name="/device:GPU:0", lines=[NS(name="Stream #13", events=events)])])
    t = window_table(pd, steps=2)
    assert abs(t["wall_ms_per_step"] - 10) < 1e-9 and abs(t["busy_ms_per_step"] - 8) < 1e-9
    assert abs(t["idle_share"] - 0.2) < 1e-9
    top = {r["name"]: r for r in t["top"]}
    assert top["gemm"]["ms"] == 6 and top["gemm"]["count"] == 1.5
    assert top["body_mosaic_gpu_kernel [grid:1152,1,1 command_buffer_1]"]["ms"] == 1
    assert window_table("no trace", 2) == {"error": "no trace"}


def test_engine_window_parses_windows_and_refuses_bad_ones():
    from bench.probes.engine_window import parse_windows
    assert parse_windows(None, 60, 20) == [(60, 20)]
    assert parse_windows("100:16,250:8", 60, 20) == [(100, 16), (250, 8)]
    for bad in ("100", "100:16,110:4", "0:3", "a:b", "5:0"):
        with pytest.raises(SystemExit, match="--windows"):
            parse_windows(bad, 60, 20)


def test_engine_window_reports_each_window_of_one_run(tmp_path):
    """CPU smoke: two windows of one smoke run, each with the steps it held (no GPU lines on the CPU: the kernel
    table says so)."""
    import json
    import subprocess
    from bench.common import module_command
    cmd = module_command("bench.probes.engine_window", "--shape", "smoke", "--workload", "64x16", "--num-requests",
                         "8", "--windows", "2:3,8:4", "--variants", "a=", "--out", str(tmp_path))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((tmp_path / "engine_window_a.json").read_text())
    assert [w["window"] for w in d["windows"]] == [[2, 5], [8, 12]]
    assert [sum(w["kinds"].values()) for w in d["windows"]] == [3, 4]
    assert d["window"] == [2, 5] and d["steps"] >= 12
    assert all(w["host_ms_per_step"] > 0 and "error" in w["kernels"] for w in d["windows"])


def test_step_gap_places_a_gap_by_step_range(tmp_path):
    """step_gap: two runs' per-step cycles summed over equal ranges of steps; the range where run b is slower shows
    the difference, and a file without per-step records is a clear error."""
    import json
    from bench.probes.step_gap import per_step, ranges
    a = {"kind": ["decode+prefill@2048"] * 4 + ["decode@384"] * 4, "decode_tokens": [100] * 4 + [300] * 4,
         "cycle_ms": [50.0] * 8}
    b = {**a, "cycle_ms": [50.0] * 4 + [60.0] * 4}
    rs = ranges(a, b, 2)
    assert [r["steps"] for r in rs] == ["0-3", "4-7"]
    assert [round(r["s_b"] - r["s_a"], 6) for r in rs] == [0.0, 0.04]
    assert rs[1]["kind_a"] == "decode@384" and rs[1]["decode_a"] == 300
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"data": {"engines": {"e": {"results": {"w": {"per_step": a}, "old": {}}}}}}))
    assert per_step(str(f), "w", None) == ("e", a)
    with pytest.raises(SystemExit, match="no per-step record"):
        per_step(str(f), "old", None)
    with pytest.raises(SystemExit, match="no engine 'x'"):
        per_step(str(f), "w", "x")


def test_rotation_probe_ways_agree_with_the_hadamard_product_and_the_smoke_reports_each(tmp_path):
    """Every way of the rotation probe computes x @ H (unnorm: times sqrt(D)) to the input's precision, and the CPU
    smoke writes both places' cost for each way."""
    import json
    import jax.numpy as jnp
    import numpy as np
    import pytest
    from bench.probes import rotation
    from pallas_kernels.kv_quant import hadamard
    x = np.random.default_rng(0).standard_normal((5, 3, 64)).astype(np.float32)
    want = x @ hadamard(64)
    for way in rotation.WAYS:
        got = np.asarray(rotation.rotate_by(way, jnp.asarray(x)), np.float64) / (8.0 if way == "unnorm" else 1.0)
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), err_msg=way)
    np.testing.assert_allclose(np.asarray(rotation.rotate_by("fwht", jnp.asarray(x))), want, atol=1e-5)
    with pytest.raises(ValueError, match="unknown way"):
        rotation.rotate_by("nope", jnp.asarray(x))
    rotation.main(["--smoke", "--out", str(tmp_path)])
    (f,) = tmp_path.glob("rotation-*.json")
    d = json.loads(f.read_text())
    assert set(d["summary"]) == {f"{p}_us_t64_{w}" for p in ("q", "out") for w in rotation.WAYS}
    assert all(r["q_relerr"] < 4e-3 for r in d["data"]["rows"])      # bf16 rounding of the rotated queries


def test_engine_window_names_where_a_fusion_comes_from():
    """`fusion_sources` finds a compiled program's fusions by their kernel names ("." as "_") and reports the
    model op they came from (the named scope in their metadata); names that are no fusion get nothing."""
    import jax
    import jax.numpy as jnp
    from bench.probes.engine_window import FUSION_LINE, fusion_sources

    def f(a, b):
        with jax.named_scope("attn_prefill@0"):
            return jnp.concatenate([a * 2, b + 1], -1).sum(0)
    text = jax.jit(f).lower(jnp.ones((8, 4)), jnp.ones((8, 4))).compile().as_text()
    names = {m.group(1).replace(".", "_") for m in FUSION_LINE.finditer(text)}
    assert names
    src = fusion_sources([text], names | {"nvjet_sm90_gemm"})
    assert set(src) == names and all("attn_prefill" in v for v in src.values())


def test_query_parts_probe_ways_build_the_shipped_operand_and_the_smoke_reports_each(tmp_path):
    """Every way of building int8's query parts gives `kv_quant.int8_query_parts`' operand bit for bit (the probe
    stops on a difference), and the CPU smoke writes a time for each way and place."""
    import json
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench.probes import query_parts
    q = jax.random.normal(jax.random.key(1), (6, 8, 128), jnp.bfloat16)
    want = query_parts.parts_by("packed", q, kv_heads=2, rotated=True)
    for way in ("concat", "stacked", "where_i8"):
        got = query_parts.parts_by(way, q, kv_heads=2, rotated=True)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert np.count_nonzero(np.asarray(want[0])) > 0
    want8 = query_parts.parts_by("fp8", q, kv_heads=2, rotated=False)
    got8 = query_parts.parts_by("fp8_packed", q, kv_heads=2, rotated=False)
    np.testing.assert_array_equal(np.asarray(got8[0]).view(np.uint8), np.asarray(want8[0]).view(np.uint8))
    query_parts.main(["--smoke", "--out", str(tmp_path)])
    (f,) = tmp_path.glob("query_parts-*.json")
    d = json.loads(f.read_text())
    assert set(d["summary"]) == ({f"us_r16_{w}{s}" for w in ("concat", "stacked", "where_i8", "apart", "packed")
                                  for s in ("", "_rot")} | {"us_r16_fp8", "us_r16_fp8_packed"})


def test_tail_check_probe_reads_fp8r_as_the_reference_does_in_interpret_mode(tmp_path):
    """The fp8r probe's check (the kernels over the pages and the tail rows against the reference) passes in
    interpret mode at head_dim 64 and 128 and writes its errors; it exits non-zero on a difference."""
    import json
    from bench.probes import tail_check
    tail_check.main(["--interpret", "--out", str(tmp_path)])
    (f,) = tmp_path.glob("tail_check-*.json")
    summary = json.loads(f.read_text())["summary"]
    assert set(summary) == {"rel_err_d64", "rel_err_d128"} and all(0 < e < 1e-2 for e in summary.values())
