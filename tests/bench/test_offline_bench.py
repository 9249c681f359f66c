"""bench.offline: variant parsing, the summary over several engine variants and the HF peer, and one real
CPU run of the whole script (two engine variants in child processes, the HF transformers peer, the JSON)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.offline import parse_variants, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_variants():
    assert parse_variants("") == [("engine", [])]
    assert parse_variants("seq=; mact=--strategies nanoflow:x --page-size 64") == [
        ("seq", []), ("mact", ["--strategies", "nanoflow:x", "--page-size", "64"])]
    for bad in ("noequals", "=--page-size 64", "a b=--x", "a=;a=--x"):
        with pytest.raises(SystemExit):
            parse_variants(bad)


def _engine(gemm, tok):
    return {"gemm_tflops": gemm, "params": 1e9, "compile_s": 10.0,
            "results": {w: {"total_tok_s": t, "requests": 8} for w, t in tok.items()}}


def test_summarize_best_variant_peer_and_one_ceiling():
    ours = {"seq": _engine(600.0, {"1024x512": 100_000.0, "sharegpt": 50_000.0}),
            "plan": _engine(800.0, {"1024x512": 110_000.0, "sharegpt": 40_000.0})}
    peers = {"1024x512": {"total_tok_s": 1_000.0}, "sharegpt": {"partial": True, "partial_total_tok_s": 100.0}}
    s, rows, optimal = summarize(ours, peers)
    assert optimal == pytest.approx(700e12 / 2e9)           # the mean of the two measured GEMM rates
    assert s["best_variant_1024_512"] == "plan" and s["best_variant_sharegpt"] == "seq"
    assert s["total_tok_s_1024_512"] == 110_000.0
    assert s["pct_optimal_1024_512"] == pytest.approx(100 * 110_000 / optimal)
    assert s["pct_optimal_sharegpt_plan"] == pytest.approx(100 * 40_000 / optimal)
    assert s["best_vs_seq_1024_512"] == pytest.approx(1.1)
    assert s["vs_hf_transformers_ratio"] == s["vs_hf_transformers_ratio_1024_512"] == pytest.approx(110.0)
    assert "vs_hf_transformers_ratio_sharegpt" not in s        # the peer did not finish there ...
    assert s["vs_hf_transformers_ratio_sharegpt_lower_bound"] == pytest.approx(500.0)    # ... a lower bound
    assert len(rows) == 4
    one, _, _ = summarize({"engine": ours["seq"]}, {})
    assert "best_variant_1024_512" not in one and "vs_hf_transformers_ratio" not in one
    assert not [k for k in s if "_kv_" in k]                    # bfloat16 KV: no per-format keys


def test_summarize_keys_per_kv_format():
    """#21's keys: pct_optimal_<workload>_kv_<format> for each compressed format run, its best variant's."""
    ours = {"bf16": _engine(700.0, {"1024x512": 100_000.0}), "fp8": _engine(700.0, {"1024x512": 120_000.0}),
            "fp8p64": _engine(700.0, {"1024x512": 125_000.0}), "int4": _engine(700.0, {"1024x512": 90_000.0})}
    for v, kv in (("fp8", "fp8"), ("fp8p64", "fp8"), ("int4", "int4")):
        ours[v]["engine_config"] = {"cache": {"kv_dtype": kv}}
    s, _, optimal = summarize(ours, {})
    assert s["pct_optimal_1024_512_kv_fp8"] == pytest.approx(100 * 125_000 / optimal)
    assert s["pct_optimal_1024_512_kv_int4"] == pytest.approx(100 * 90_000 / optimal)
    assert "pct_optimal_1024_512_kv_bfloat16" not in s
    one, _, _ = summarize({"engine": ours["fp8"]}, {})          # one engine run with --kv-dtype fp8
    assert one["pct_optimal_1024_512_kv_fp8"] == one["pct_optimal_1024_512"]


def test_summarize_floor_keys_from_the_best_variant():
    """bench/run_floor.py's floor of the best variant's run against optimal; none where a result has no floor
    (an older file, a MoE model)."""
    ours = {"seq": _engine(700.0, {"1024x512": 100_000.0, "sharegpt": 50_000.0}),
            "plan": _engine(700.0, {"1024x512": 110_000.0, "sharegpt": 40_000.0})}
    ours["seq"]["results"]["1024x512"]["floor"] = {"floor_tok_s": 1.0, "any_schedule_tok_s": 1.0}   # not the best
    ours["plan"]["results"]["1024x512"]["floor"] = {"floor_tok_s": 200_000.0, "any_schedule_tok_s": 300_000.0}
    ours["seq"]["results"]["sharegpt"]["floor"] = None                                              # MoE
    s, _, optimal = summarize(ours, {})
    assert s["floor_pct_optimal_1024_512"] == pytest.approx(100 * 200_000 / optimal)
    assert s["any_schedule_pct_optimal_1024_512"] == pytest.approx(100 * 300_000 / optimal)
    assert s["pct_of_floor_1024_512"] == pytest.approx(100 * 110_000 / 200_000)
    assert not [k for k in s if "floor" in k and "sharegpt" in k]


def test_offline_script_runs_variants_and_peer_on_cpu(tmp_path):
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    # the product's defaults for what is not given (on a CPU: buckets 1,16,256, KV pages 512)
    cmd = [sys.executable, "-m", "bench.offline", "--shape", "smoke", "--workloads", "64x16", "--num-requests", "6",
           "--peer-requests", "2", "--peer-timeout", "200", "--name", "offline-test",
           # nbo: one token bucket (its own flag, checked below), compiled in ~half the time of the default three
           "--variants", "seq=;nbo=--strategies nanobatch:1-1 --max-seqs 6 --token-buckets 16"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (path,) = tmp_path.glob("offline-test-*.json")
    doc = json.loads(path.read_text())
    s, data = doc["summary"], doc["data"]
    assert set(data["engines"]) == {"seq", "nbo"} and data["failed_variants"] == []
    assert data["engines"]["nbo"]["engine_args"]["max_seqs"] == 6          # the variant's flags won
    assert data["engines"]["nbo"]["engine_args"]["strategies"] == "nanobatch:1-1"
    seq = data["engines"]["seq"]["engine_config"]
    assert seq["batcher"]["token_buckets"] == [1, 16, 256] and seq["cache"]["num_pages"] == 512  # the builder's
    assert seq["cache"]["max_pages_per_seq"] == 5                  # 64 + 16 tokens, the longest request
    assert data["engines"]["nbo"]["engine_config"]["batcher"]["max_seqs"] == 6
    assert data["engines"]["nbo"]["engine_config"]["batcher"]["token_buckets"] == [16]
    for eng in data["engines"].values():
        res = eng["results"]["64x16"]
        assert res["generated_tokens"] == 6 * 16 and res["prompt_tokens"] == 6 * 64
        per = res["per_step"]                      # each step in order, as the per-kind means count them
        assert len(per["kind"]) == len(per["cycle_ms"]) == len(per["decode_tokens"]) == res["trace"]["steps"]
        assert {k: per["kind"].count(k) for k in set(per["kind"])} == {
            k: v["steps"] for k, v in res["step_ms_by_kind"].items()}
        assert sum(per["decode_tokens"]) == res["trace"]["decode_tokens"] and min(per["cycle_ms"]) > 0
        assert len(per["prefill_tokens"]) == len(per["kind"])
        assert sum(per["prefill_tokens"]) == res["trace"]["prefill_tokens"]
        fl = res["floor"]                          # bench/run_floor.py on this run's steps
        assert fl["steps"] == len(per["kind"]) and fl["total_tokens"] == 6 * (64 + 16) and fl["max_out"] == 16
        assert fl["floor_s"] > 0 and fl["floor_tok_s"] > 0 and fl["any_schedule_tok_s"] > 0
        assert eng["copy_bytes_per_s"] > 0
    assert data["peers"]["64x16"]["total_tok_s"] > 0
    assert s["vs_hf_transformers_ratio"] == pytest.approx(s["total_tok_s_64_16"] / s["hf_total_tok_s_64_16"])
    assert s["best_variant_64_16"] in ("seq", "nbo") and 0 < s["pct_optimal_64_16"]
    for k in ("floor_pct_optimal_64_16", "any_schedule_pct_optimal_64_16", "pct_of_floor_64_16"):
        assert s[k] > 0, k


def test_offline_sampled_run_and_its_flag_check(tmp_path, monkeypatch):
    """`--temperature 1 --top-p 0.9 --peer none`: every request sampled (a seed each) at its exact length; with a
    peer, which runs greedy, the flag is an error naming it, and so is a top-p without a temperature."""
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, "-m", "bench.offline", "--shape", "smoke", "--workloads", "64x16", "--num-requests", "6",
            "--name", "offline-sampled", "--temperature", "1", "--top-p", "0.9"]
    # The flag checks come first in main(), before anything runs: called in this process (a SystemExit with a
    # message is what a child would print to stderr, exiting 1), not in two more Python processes.
    from bench import offline
    monkeypatch.setenv("BENCH_RESULTS_DIR", str(tmp_path))
    for argv, flag in ((base + ["--peer", "hf"], "--temperature"),
                       (base[:-4] + ["--top-p", "0.9", "--peer", "none"], "--top-p")):
        monkeypatch.setattr(sys, "argv", ["bench.offline", *argv[3:]])
        with pytest.raises(SystemExit) as bad:
            offline.main()
        assert isinstance(bad.value.code, str) and flag in bad.value.code
    assert not list(tmp_path.iterdir())
    # one token bucket: the sampled head is the same at any bucket, and one compiles in half the time of three
    p = subprocess.run(base + ["--peer", "none", "--token-buckets", "16"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (path,) = tmp_path.glob("offline-sampled-*.json")
    res = json.loads(path.read_text())["data"]["engines"]["engine"]["results"]["64x16"]
    assert res["temperature"] == 1.0 and res["top_p"] == 0.9 and res["generated_tokens"] == 6 * 16
