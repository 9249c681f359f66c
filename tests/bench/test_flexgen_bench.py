"""bench.flexgen on a CPU: the OPT smoke shape through the whole script (the grid, the LP's policy, CPU attention
on and off, the row-by-row baseline, the traced decode pass), writing the summary keys and the timeline picture."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flexgen_bench_runs_on_a_cpu(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NFJAX_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "bench.flexgen", "--shape", "opt-smoke", "--layers", "2",
                        "--prompt-len", "16", "--gen-len", "4", "--gpu-memory-gb", "1", "--out-dir", str(tmp_path),
                        "--offload-dir", str(tmp_path / "off"), "--offload", "auto", "--cpu-attention-ab",
                        "--max-block", "8"],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (res,) = tmp_path.glob("flexgen-*.json")
    doc = json.loads(res.read_text())
    s = doc["summary"]
    for k in ("flexgen_out_tok_s_optsmoke_1gb", "flexgen_vs_rowbyrow", "flexgen_out_tok_s_optsmoke_1gb_int4",
              "flexgen_vs_rowbyrow_int4", "flexgen_out_tok_s_optsmoke_1gb_kv4", "flexgen_vs_rowbyrow_kv4"):
        assert s[k] > 0, k
    runs = doc["data"]["runs"]           # each headline key from its own kind of run
    assert not runs[s["flexgen_best_policy_kv4"]]["policy"]["compress_weights"]
    assert runs[s["flexgen_best_policy_kv4"]]["policy"]["compress_cache"]
    assert runs[s["flexgen_best_policy_int4"]]["policy"]["compress_weights"]
    assert s["flexgen_best_policy"] in doc["data"]["runs"]
    # issue #25: the LP's policy ran beside the grid, CPU attention on and off, every zig-zag run predicted
    for k in ("lp_policy_vs_best_grid", "cpu_attention_speedup", "cost_model_mean_abs_err_pct"):
        assert s[k] > 0, k
    assert doc["data"]["runs"]["lp"]["policy"] == doc["data"]["lp"]["policy"]
    assert s["cost_model_runs"] == len(doc["data"]["runs"]) + 1
    ab = doc["data"]["cpu_attention_ab"]
    assert ab["on"]["policy"]["cpu_attention"] and not ab["off"]["policy"]["cpu_attention"]
    assert doc["data"]["hardware"]["gemm_flops"] > 0
    assert doc["data"]["rowbyrow"]["pinned"]["policy"]["schedule"] == "row_by_row"
    assert s["flexgen_vs_rowbyrow"] == s["flexgen_vs_rowbyrow_pinned"]
    lanes = {e["lane"] for e in doc["data"]["trace"]["events"]}
    assert {"compute", "load weights", "load cache", "store cache"} <= lanes
    assert (tmp_path / res.name.replace(".json", "-timeline.png")).stat().st_size > 10_000
    assert list((tmp_path / "off").iterdir()) == []


def test_merge_adds_earlier_parts(tmp_path):
    """`--merge`: an earlier part's runs join this invocation's (which win a name clash), with its LP and CPU
    attention records; a file that is not a result is an error naming it."""
    from bench.flexgen import _merge
    part = {"data": {"runs": {"a": {"out_tok_s": 1.0}, "b": {"out_tok_s": 2.0}}, "lp": {"predicted_tok_s": 3.0},
                     "cpu_attention_ab": "no run holds KV off the GPU"}}
    (tmp_path / "p0.json").write_text(json.dumps(part))
    runs = {"b": {"out_tok_s": 5.0}}
    got = _merge(str(tmp_path / "p0.json"), runs)
    assert runs == {"b": {"out_tok_s": 5.0}, "a": {"out_tok_s": 1.0}} and got == {"lp": {"predicted_tok_s": 3.0}}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="bad.json"):
        _merge(f"{tmp_path / 'p0.json'},{tmp_path / 'bad.json'}", {})


def _bench_args(tmp_path, *extra):
    return ["--shape", "opt-smoke", "--layers", "2", "--prompt-len", "16", "--gen-len", "6", "--gpu-memory-gb", "1",
            "--out-dir", str(tmp_path), "--offload-dir", str(tmp_path / "off"), *extra]


def _bench(tmp_path, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NFJAX_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "bench.flexgen", *_bench_args(tmp_path, *extra)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_baseline_only_then_merge(tmp_path):
    """`--baseline-only`: the row-by-row baseline alone, from pageable (numpy) and pinned host memory, timed over
    the prefill and a short decode and extrapolated to --gen-len (pass times recorded); `--merge-only` joins it
    with a policy run into one summary, the headline ratio over the pinned baseline."""
    out = _bench(tmp_path, "--baseline-only", "--baseline-gen-len", "3", "--baseline-batch", "3", "--name", "base")
    assert "pass 2 (decode)" in out and "extrapolated" in out
    (base,) = tmp_path.glob("base-*.json")
    doc = json.loads(base.read_text())
    rb = doc["data"]["rowbyrow"]
    assert list(rb) == ["numpy", "pinned"] and doc["data"]["runs"] == {}
    for mem, r in rb.items():
        assert r["policy"]["schedule"] == "row_by_row" and r["policy"]["host_memory"] == mem
        assert r["policy"]["gpu_batch_size"] == 3 and r["policy"]["num_gpu_batches"] == 1
        assert r["extrapolated"] and r["measured_passes"] == 3 and len(r["pass_s"]) == 3
        # the block's time is its setup, the measured prefill pass and 5 x the measured decode passes' mean
        assert r["seconds"] == pytest.approx(r["setup_s"] + r["pass_s"][0] + 5 * (r["pass_s"][1] + r["pass_s"][2]) / 2)
        assert r["out_tok_s"] == pytest.approx(3 * 6 / r["seconds"])
        assert r["predicted_tok_s"] > 0                 # the cost model's serial sum for row-by-row
    s = doc["summary"]
    assert s["flexgen_rowbyrow_basis"] == "pinned" and s["flexgen_rowbyrow_extrapolated"] is True
    assert s["flexgen_rowbyrow_out_tok_s"] == rb["pinned"]["out_tok_s"] and "flexgen_vs_rowbyrow" not in s

    _bench(tmp_path, "--policies", "w50-kvcpu-2x4", "--no-baseline", "--no-trace", "--name", "pol")
    (pol,) = tmp_path.glob("pol-*.json")
    run = json.loads(pol.read_text())["data"]["runs"]["w50-kvcpu-2x4"]
    assert not run["extrapolated"] and len(run["pass_s"]) == 6 and run["predicted_tok_s"] > 0
    # `--merge-only` runs nothing (no JAX, no device; `_merge_only` returns before them): main() in this process,
    # the script's own argument parsing and exit code, not a third Python process
    from bench import flexgen
    assert flexgen.main(_bench_args(tmp_path, "--merge-only", "--merge", f"{base},{pol}", "--name", "merged")) == 0
    (merged,) = tmp_path.glob("merged-*.json")
    s = json.loads(merged.read_text())["summary"]
    tok = run["out_tok_s"]
    assert s["flexgen_out_tok_s_optsmoke_1gb"] == tok and s["flexgen_best_policy"] == "w50-kvcpu-2x4"
    assert s["flexgen_vs_rowbyrow"] == s["flexgen_vs_rowbyrow_pinned"] == pytest.approx(tok / rb["pinned"]["out_tok_s"])
    assert s["flexgen_vs_rowbyrow_numpy"] == pytest.approx(tok / rb["numpy"]["out_tok_s"])
    assert s["cost_model_rowbyrow_err_pct_pinned"] == rb["pinned"]["predicted_err_pct"]
    assert s["cost_model_runs"] == 1


def test_warm_up_compiles_every_shape_of_the_timed_block(tmp_path):
    """The warm-up's two passes run at the timed block's shapes (KV arrays sized for the whole gen-len), so the timed
    block compiles nothing; a warm-up generating 2 tokens had 16 positions fewer and the timed block compiled the
    layer program twice more."""
    from bench.flexgen import _timed_generate
    from nfjax.models.random_init import SHAPES
    from nfjax.offload import Policy, Split
    from nfjax.offload.engine import OffloadEngine
    from nfjax.offload.random_layers import random_parts
    from nfjax.tokenizer.silent import SilentTokenizer
    cfg = SHAPES["opt-smoke"].replace(num_layers=2)
    rest_gd, rest_state, layer_gd, src = random_parts(cfg)
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0, 100, 0), cache=Split(0, 100, 0),
                 offload_dir=str(tmp_path))
    with OffloadEngine(cfg, rest_state, layer_gd, src, SilentTokenizer(cfg.vocab_size), pol, max_model_len=48,
                       rest_gd=rest_gd) as eng:
        prompts = [[5] * 16] * 4
        outs, passes, _ = _timed_generate(eng, prompts, 32, passes=2)
        assert outs is None and len(passes) == 2
        warm = eng.programs.layer[True]._cache_size()
        outs, passes, setup = _timed_generate(eng, prompts, 32)
        assert eng.programs.layer[True]._cache_size() == warm
        assert len(passes) == 32 and sum(len(o.token_ids) for o in outs) == 4 * 32 and setup >= 0


def test_summary_keys_come_from_their_own_kind_of_run():
    """The headline is the best policy with uncompressed weights (4-bit KV allowed); `_int4` has 4-bit weights,
    `_nocompress` neither compression, and a kind with no run has no key (not another kind's figure)."""
    import argparse

    from bench.flexgen import _baseline_summary, _summary

    def run(tok, w, kv):
        return {"out_tok_s": tok, "policy": {"compress_weights": w, "compress_cache": kv}}
    runs = {"kv4": run(40.0, False, True), "int4kv4": run(80.0, True, True)}
    args = argparse.Namespace(shape="opt-30b", gpu_memory_gb=16)
    s = _summary(args, runs)
    assert s["flexgen_best_policy"] == "kv4" and s["flexgen_out_tok_s_opt30b_16gb"] == 40.0
    assert s["flexgen_out_tok_s_opt30b_16gb_kv4"] == 40.0 and s["flexgen_out_tok_s_opt30b_16gb_int4"] == 80.0
    assert "flexgen_out_tok_s_opt30b_16gb_nocompress" not in s and s["flexgen_best_policy_any"] == "int4kv4"
    base = {"pinned": {**run(4.0, False, False), "policy": {"gpu_batch_size": 8}}}
    _baseline_summary(runs, base, s, {})
    assert s["flexgen_vs_rowbyrow"] == s["flexgen_vs_rowbyrow_kv4"] == 10.0 and s["flexgen_vs_rowbyrow_int4"] == 20.0
    assert "flexgen_vs_rowbyrow_nocompress" not in s
    runs["plain"] = run(12.0, False, False)
    s = _summary(args, runs)
    _baseline_summary(runs, base, s, {})
    assert s["flexgen_best_policy"] == "kv4" and s["flexgen_best_policy_nocompress"] == "plain"
    assert s["flexgen_vs_rowbyrow_nocompress"] == 3.0


def test_rowbyrow_baseline_is_uncompressed(monkeypatch):
    import argparse

    import bench.flexgen as fg
    seen = []
    monkeypatch.setattr(fg, "run_policy", lambda cfg, pol, args, **kw: seen.append(pol) or
                        {"out_tok_s": 1.0, "extrapolated": False})
    args = argparse.Namespace(shape="opt-30b", policies="int4-kv4-w0-8x8", gpu_memory_gb=16, cpu_memory_gb=None,
                              disk_gb=None, offload=None, offload_dir=None, baseline_batch=None, baseline_gen_len=3)
    template = fg.grid(args)["int4-kv4-w0-8x8"]
    assert template.compress_weights and template.compress_cache
    fg._baselines(None, args, template.to_json(), ["pinned"])
    (pol,) = seen
    assert pol.schedule == "row_by_row" and not pol.compress_weights and not pol.compress_cache


def test_host_guard_lets_the_pinned_pool_serve_the_next_tier(monkeypatch):
    """A run that left a pinned pool of 55% of the machine (peak 60%) and a policy whose host tier is 50%: the pool
    holds the tier, so it fits (the older rule, tier + what the run held beyond its 10% tier, said 100%)."""
    import argparse

    import psutil

    from bench.flexgen import host_fits
    from bench.setup import model_config
    from nfjax.offload import Policy, budget
    total_gb = psutil.virtual_memory().total / 1e9
    monkeypatch.setattr(budget, "needs", lambda *a, **k: [budget.Need("cpu", "KV cache", int(0.5 * total_gb * 1e9))])
    args = argparse.Namespace(shape="opt-smoke", layers=None, prompt_len=32, gen_len=4, dtype=None)
    run = {"host_peak_rss_gb": 0.6 * total_gb, "tier_bytes": {"cpu": 0.1 * total_gb * 1e9}}
    assert host_fits(model_config(args), Policy(), args, {"a": run}) is not None
    run["host_rss_parts_gb"] = {"RssShmem": 0.55 * total_gb, "RssAnon": 0.05 * total_gb}
    assert host_fits(model_config(args), Policy(), args, {"a": run}) is None


def test_host_guard_counts_what_earlier_runs_held_beyond_their_tier():
    """`host_fits`: a small policy fits this machine; the same policy after a run that held more than the machine
    beyond its own host tier is skipped, the reason naming both parts."""
    import argparse

    import psutil

    from bench.flexgen import host_fits
    from bench.setup import model_config
    from nfjax.offload import Policy, Split
    args = argparse.Namespace(shape="opt-smoke", layers=None, prompt_len=32, gen_len=4, dtype=None)
    cfg = model_config(args)
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(0, 100, 0), cache=Split(0, 100, 0))
    assert host_fits(cfg, pol, args, {}) is None
    total_gb = psutil.virtual_memory().total / 1e9
    runs = {"big": {"host_peak_rss_gb": 2 * total_gb, "tier_bytes": {"cpu": 1e9}}}
    why = host_fits(cfg, pol, args, runs)
    assert why and "host memory" in why and "held beyond the tier" in why
    # with RSS by kind: a large pinned pool serves the next tier (it fits), but not a large rest outside it
    pool = {"big": {"host_peak_rss_gb": 0.6 * total_gb, "tier_bytes": {"cpu": 1e9},
                    "host_rss_parts_gb": {"RssShmem": 0.55 * total_gb, "RssAnon": 0.05 * total_gb}}}
    assert host_fits(cfg, pol, args, pool) is None
    pool["big"]["host_peak_rss_gb"] = 1.6 * total_gb
    why = host_fits(cfg, pol, args, pool)
    assert why and "outside the pool" in why


def test_auto_grid_spreads_over_the_ranking_and_one_is_the_top():
    """`--grid auto --grid-size N`: N feasible policies spread over the cost model's ranking, the top predicted
    first; N = 1 is the top one alone (it divided by zero)."""
    from types import SimpleNamespace

    from bench import flexgen as fg
    from bench import flexgen_model as fm
    from nfjax.offload.cost_model import predict
    from nfjax.offload.hardware import HardwareProfile
    from nfjax.models.random_init import SHAPES
    cfg = SHAPES["opt-30b"]
    hw = HardwareProfile("t", "t", gemm_flops=7e14, hbm_bytes=2e12, h2d_bytes=8e9, h2d_pinned_bytes=5e10,
                         d2h_bytes=4e9, disk_read_bytes=1.5e9, disk_write_bytes=1e9, cpu_attn_bytes=8e9,
                         dispatch_s=1e-4)
    args = SimpleNamespace(prompt_len=512, gen_len=32, max_block=32, gpu_memory_gb=16.0, cpu_memory_gb=80.0,
                           disk_gb=None, offload_dir=None)
    limits = {"gpu": 16e9, "cpu": 80e9, "disk": None}
    wl = fm.workload(args)
    one = fm.auto_grid(cfg, args, hw, limits, 1, fg.make_policy)
    four = fm.auto_grid(cfg, args, hw, limits, 4, fg.make_policy)
    assert len(one) == 1 and len(four) == 4 and next(iter(one)) in four
    tok = {k: predict(cfg, p, wl, hw).out_tok_s for k, p in four.items()}
    top = next(iter(one))
    assert tok[top] == max(tok.values()) and len(set(tok.values())) == 4
