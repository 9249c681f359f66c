"""The vLLM peer's plumbing without vLLM: the workload files and model config the nfjax side hands over, the
child-process runner, the summaries of bench/offline.py and bench/latency.py fed recorded vLLM results, and
both scripts end to end on CPU (where the vLLM child stops at `import vllm`, after reporting what it would
send)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from bench.latency import summarize as latency_summary
from bench.offline import summarize as offline_summary
from bench.peers import run_json_child
from bench.peers.workload_io import (digest, hf_config, read_workload, requests_work, stats, vllm_requests,
                                     write_workload)
from bench.workloads import parse
from nfjax.config import ModelConfig
from nfjax.models.random_init import SHAPES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize("spec", ["64x16", "sharegpt"])
def test_workload_round_trip_reaches_vllm_requests_unchanged(tmp_path, spec):
    work = parse(spec, 7, 128256, seed=1)
    path = str(tmp_path / "w.json")
    write_workload(path, work)
    back = read_workload(path)
    assert back == work
    reqs = vllm_requests(back)
    assert [p["prompt_token_ids"] for p, _ in reqs] == [ids for ids, _ in work]
    assert [n for _, n in reqs] == [n for _, n in work]
    assert digest(requests_work(reqs)) == digest(work)
    assert stats(work)["prompt_tokens"] == sum(len(ids) for ids, _ in work)
    assert digest(work[:-1] + [(work[-1][0], work[-1][1] + 1)]) != digest(work)    # a length counts


def test_read_workload_rejects_malformed(tmp_path):
    for bad in ([[[], 4]], [[[1, 2], 0]], [[[1, 2]]], [[1, 2, 3]]):
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            read_workload(str(p))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_hf_config_gives_the_same_model_config_back(shape):
    cfg = SHAPES[shape]
    hf = hf_config(json.loads(json.dumps(cfg.to_json())))      # as the peer reads it from a file
    assert ModelConfig.from_hf(hf) == cfg
    want = {"opt": "OPTForCausalLM", "mixtral": "MixtralForCausalLM"}.get(cfg.model_type, "LlamaForCausalLM")
    assert hf["architectures"] == [want] and hf["num_hidden_layers"] == cfg.num_layers


def test_run_json_child_keeps_partial_result_and_kills_the_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    child = textwrap.dedent(f"""
        import json, subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(g.pid))
        print("log line")
        print(json.dumps({{"results": {{"a": 1}}}}), flush=True)
        time.sleep(60)
    """)
    res = run_json_child([sys.executable, "-c", child], timeout=3, label="t")
    assert res["error"].startswith("t timed out") and res["partial_result"] == {"results": {"a": 1}}
    gpid = int(pid_file.read_text())
    for _ in range(50):                     # the grandchild, in the same group, was killed with it
        try:
            os.kill(gpid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"grandchild {gpid} still alive")
    ok = run_json_child([sys.executable, "-c", "print('x'); print('{\"a\": 2}'); print('tail')"], timeout=30)
    assert ok == {"a": 2}
    assert "no JSON line" in run_json_child([sys.executable, "-c", "print('x')"], timeout=30)["error"]


def _engine(tok, digests):
    return {"gemm_tflops": 700.0, "params": 8e9, "compile_s": 10.0,
            "results": {w: {"total_tok_s": t, "requests": 512} for w, t in tok.items()},
            "workloads": {w: {"digest": d} for w, d in digests.items()}}


# bench/peers/vllm.py's offline JSON with the figures of issue 20 (one H100, 2026-11-24)
VLLM_OFFLINE = {"peer": "vllm", "mode": "offline", "complete": True, "vllm": "0.26.0",
                "engine": {"max_num_seqs": 256}, "workloads": {"1024x512": {"digest": "d1"}, "sharegpt": {"digest": "d2"}},
                "results": {"1024x512": {"total_tok_s": 16851.0, "output_tok_s": 5617.0},
                            "sharegpt": {"total_tok_s": 11129.0, "output_tok_s": 6300.0}}}


def test_offline_summary_ratios_against_vllm():
    ours = {"seq": _engine({"1024x512": 10100.0, "sharegpt": 7909.0}, {"1024x512": "d1", "sharegpt": "d2"}),
            "ms256": _engine({"1024x512": 17195.0, "sharegpt": 7553.0}, {"1024x512": "d1", "sharegpt": "d2"})}
    s, rows, _ = offline_summary(ours, {}, VLLM_OFFLINE)
    assert s["vllm_total_tok_s_1024_512"] == 16851.0 and s["vllm_total_tok_s_sharegpt"] == 11129.0
    assert s["nfjax_vs_vllm_1024_512"] == pytest.approx(17195 / 16851)        # the best variant
    assert s["nfjax_vs_vllm_sharegpt"] == pytest.approx(7909 / 11129)
    assert s["nfjax_vs_vllm"] == s["nfjax_vs_vllm_1024_512"] and s["vllm_same_requests"] is True
    assert s["vllm_output_tok_s_sharegpt"] == 6300.0 and "vllm_error" not in s
    assert [r[-2:] for r in rows if r[1] == "ms256"] == [["16,851", "1.02x"], ["11,129", "0.68x"]]
    other = {"seq": _engine({"1024x512": 1.0, "sharegpt": 1.0}, {"1024x512": "d1", "sharegpt": "other"})}
    assert offline_summary(other, {}, VLLM_OFFLINE)[0]["vllm_same_requests"] is False


def test_offline_summary_keeps_a_timed_out_vllm_runs_finished_workloads():
    cut = {"error": "vllm timed out after 480s", "partial_result": {**VLLM_OFFLINE, "complete": False,
           "results": {"1024x512": VLLM_OFFLINE["results"]["1024x512"]}}}
    ours = {"seq": _engine({"1024x512": 10100.0, "sharegpt": 7909.0}, {"1024x512": "d1", "sharegpt": "d2"})}
    s, _, _ = offline_summary(ours, {}, cut)
    assert s["nfjax_vs_vllm_1024_512"] == pytest.approx(10100 / 16851)
    assert "nfjax_vs_vllm_sharegpt" not in s and s["vllm_error"].startswith("vllm timed out")
    s, _, _ = offline_summary(ours, {}, {"error": "ModuleNotFoundError: No module named 'vllm'"})
    assert not any(k.startswith(("vllm_total", "nfjax_vs")) for k in s) and "vllm" in s["vllm_error"]


def test_latency_summary_ratios_against_vllm():
    ours = {"compile_s": 1.0, "results": {"1": {"tpot_ms": 9.2, "ttft_ms": 30.0}, "64": {"tpot_ms": 12.1,
                                                                                          "ttft_ms": 90.0}},
            "stream": {"itl_ms_p50": 9.0, "itl_ms_p99": 13.5, "ttft_ms": 31.0}}
    vllm = {"mode": "latency", "results": {"1": {"tpot_ms": 6.6, "ttft_ms": 20.0}, "64": {"tpot_ms": 8.9,
                                                                                        "ttft_ms": None}}}
    s, rows = latency_summary(ours, vllm)
    assert s["tpot_ms_bs1"] == 9.2 and s["vllm_tpot_ms_bs1"] == 6.6 and s["vllm_tpot_ms_bs64"] == 8.9
    assert s["nfjax_vs_vllm_tpot_bs1"] == pytest.approx(6.6 / 9.2)        # < 1: nfjax slower per token
    assert s["itl_p99_over_p50_bs1"] == pytest.approx(1.5) and "vllm_ttft_ms_bs64" not in s
    assert len(rows) == 2 and "vllm_tpot_ms_bs1" not in latency_summary(ours, None)[0]


def _run(cmd, tmp_path):
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    return json.loads(path.read_text())


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM installed: the peer would run for real")
def test_offline_script_hands_vllm_the_requests_the_engine_ran(tmp_path):
    doc = _run([sys.executable, "-m", "bench.offline", "--shape", "smoke", "--workloads", "64x16,sharegpt",
                "--num-requests", "5", "--peer", "vllm", "--peer-timeout", "120", "--token-buckets", "32,64",
                "--max-seqs", "8", "--num-pages", "256", "--name", "offline-vllm-test"], tmp_path)
    s, data = doc["summary"], doc["data"]
    sent = data["vllm"]["workloads"]               # what the vLLM process read and would send
    for w in ("64x16", "sharegpt"):
        assert sent[w]["digest"] == digest(parse(w, 5, SHAPES["smoke"].vocab_size, seed=1))
        assert data["engines"]["engine"]["results"][w]["prompt_tokens"] == sent[w]["prompt_tokens"]
    assert s["vllm_same_requests"] is True and "No module named 'vllm'" in s["vllm_error"]


def test_latency_script_on_cpu(tmp_path):
    peer = [] if HAVE_VLLM else ["--peer", "vllm", "--peer-timeout", "120"]
    doc = _run([sys.executable, "-m", "bench.latency", "--shape", "smoke", "--batch-sizes", "1,3", "--prompt-len", "16",
                "--output-len", "6", "--token-buckets", "32,64", "--max-seqs", "8", "--name", "latency-test", *peer],
               tmp_path)
    s, ours = doc["summary"], doc["data"]["nfjax"]
    for bs in (1, 3):
        r = ours["results"][str(bs)]
        assert r["output_tokens"] == bs * 6
        assert 0 < s[f"ttft_ms_bs{bs}"] and 0 < s[f"tpot_ms_bs{bs}"] < r["e2e_ms"]
        assert len(r["tpot_ms_repeats"]) == 3 and s[f"tpot_ms_bs{bs}"] == sorted(r["tpot_ms_repeats"])[1]  # median
    st = ours["stream"]
    assert len(st["streams"]) == 5 == s["itl_streams"]           # the default
    assert all(r["tokens"] == 6 and len(r["itl_ms"]) == r["yields"] - 1 for r in st["streams"])
    assert st["itl_ms"] == [g for r in st["streams"] for g in r["itl_ms"]]
    assert all(len(r["worst_gaps"]) == 3 and r["worst_gaps"][0]["ms"] == max(r["itl_ms"]) for r in st["streams"])
    assert s["itl_p99_over_p50_bs1"] >= 1.0 and s["itl_p99_over_p50_bs1_worst_stream"] >= 1.0
    assert "latency-test" in doc["name"] and doc["command"]
    assert list(tmp_path.glob("latency-test-*.png"))
    if peer:
        assert doc["data"]["vllm"]["mode"] == "latency" and "vllm" in s["vllm_error"]
