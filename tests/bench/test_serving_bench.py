"""bench.serving's bookkeeping (no server, no JAX): flags to the server process, per-rate statistics,
extrapolation of requests cut off by a rate's deadline, the headline bound."""
from __future__ import annotations

import pytest

from bench.serving import SLO_S, make_workload, meets_slo, parse_args, summarize, ttft_growth
from bench.setup import add_bench_args, engine_argv, engine_flags


def _done(t_arrival, ttft, e2e, n):
    return {"ok": True, "t_arrival": t_arrival, "chunks": n, "ttft_s": ttft, "e2e_s": e2e, "output_tokens": n,
            "normalized_s": e2e / n, "tpot_s": (e2e - ttft) / (n - 1), "finished_at": t_arrival + e2e,
            "prompt_tokens": 4, "max_tokens": n}


def test_engine_flags_round_trip():
    import argparse
    args = parse_args(["--shape", "smoke", "--token-buckets", "32,128", "--max-seqs", "8", "--num-pages", "64",
                       "--no-command-buffers", "--plan", "p.json", "--layers", "2"])
    assert args.server_process is True                       # the default with --shape
    ap = argparse.ArgumentParser()
    add_bench_args(ap, shape=None)
    again = ap.parse_args(engine_argv(args))
    assert engine_flags(again) == engine_flags(args) == {
        "shape": "smoke", "layers": 2, "token_buckets": (32, 128), "max_seqs": 8, "num_pages": 64,
        "command_buffers": False, "plan": "p.json"}
    assert parse_args([]).server_process is False              # a checkpoint: in-process by default
    assert parse_args(["--shape", "smoke", "--in-process"]).server_process is False
    assert parse_args(["--out", "/tmp/x"]).out_dir == "/tmp/x"


def test_make_workload_clips():
    work = make_workload("sharegpt", 50, 1000, 300, seed=0, max_output=64)
    assert all(len(ids) + lout <= 300 and 1 <= lout <= 64 for ids, lout in work)


def test_summarize_completed_and_extrapolated():
    recs = [_done(0.0, 0.05, 1.05, 101)]                      # 10 ms / token, 10.4 ms normalized
    # cut off after 21 chunks over 0.2 s since its first: 10 ms a token, 80 tokens left at 0.3 s elapsed
    recs.append({"ok": False, "t_arrival": 0.0, "chunks": 21, "ttft_s": 0.1, "last_chunk_s": 0.3,
                 "timed_out": True, "elapsed_s": 0.31, "max_tokens": 101, "prompt_tokens": 4})
    res = summarize(recs, 2.0, 0.0)
    assert (res["completed"], res["timed_out"], res["extrapolated"], res["errors"]) == (1, 1, 1, 0)
    est_e2e = 0.31 + 80 * 0.01
    assert res["e2e_s"]["p99"] == pytest.approx(est_e2e)
    assert res["normalized_latency_s"]["mean"] == pytest.approx((1.05 / 101 + est_e2e / 101) / 2)
    assert res["normalized_latency_completed_only_s"]["mean"] == pytest.approx(1.05 / 101)
    assert meets_slo(res)


def test_unstarted_or_failed_requests_fail_the_bound():
    ok = _done(0.0, 0.05, 1.05, 101)
    queued = {"ok": False, "t_arrival": 0.0, "chunks": 0, "timed_out": True, "elapsed_s": 5.0, "max_tokens": 100,
              "prompt_tokens": 4}
    res = summarize([ok, queued], 2.0, 0.0)
    assert res["timed_out_before_first_token"] == 1 and not meets_slo(res)
    assert res["unstarted_normalized_lower_bound_s"]["mean"] == pytest.approx(0.05)
    failed = {"ok": False, "t_arrival": 0.0, "chunks": 0, "error": "HTTP 500", "max_tokens": 10, "prompt_tokens": 4}
    assert not meets_slo(summarize([ok, failed], 2.0, 0.0))
    assert not meets_slo(summarize([ok], 2.0, 0.0, not_sent=3))
    slow = _done(0.0, 0.05, 0.05 + 100 * (SLO_S + 0.01), 101)
    assert not meets_slo(summarize([slow], 2.0, 0.0))


def test_ttft_growth_counts_the_unstarted_wait():
    flat = [_done(0.1 * i, 0.05, 1.05, 101) for i in range(9)]
    assert ttft_growth(flat) == pytest.approx(1.0)
    assert ttft_growth(flat[:5]) is None                           # under two requests a third
    queued = {"ok": False, "t_arrival": 2.0, "chunks": 0, "timed_out": True, "elapsed_s": 1.55, "max_tokens": 101,
              "prompt_tokens": 4}
    failed = {"ok": False, "t_arrival": 3.0, "chunks": 0, "error": "HTTP 500", "max_tokens": 101, "prompt_tokens": 4}
    # last third: two started at 0.05 s and the one never started (1.55 s) -> 0.55 s against 0.05
    assert ttft_growth(flat[:8] + [queued, failed]) == pytest.approx(0.55 / 0.05)


def test_report_names_the_first_rate_past_saturation(tmp_path):
    """A rate whose late arrivals wait for a first token much longer than its early ones is flagged, whatever
    its latency; a rate asking more output than any rate delivered is named apart."""
    import argparse
    import json
    from bench.serving import report
    light = summarize([_done(0.1 * i, 0.05, 1.05, 101) for i in range(6)], 2.0, 0.0)
    mid = summarize([_done(0.01 * i, 0.05, 1.05, 101) for i in range(6)], 100.0, 0.0)
    heavy = summarize([_done(0.001 * i, 0.05 + 0.1 * i, 1.05 + 0.1 * i, 101) for i in range(6)], 1000.0, 0.0)
    assert light["offered_output_tok_s"] == pytest.approx(2.0 * 101)
    assert heavy["ttft_growth"] == pytest.approx((0.45 + 0.55) / (0.05 + 0.15))
    args = argparse.Namespace(name="serving-test", workload="8x101", out_dir=str(tmp_path))
    report(args, [light, mid, heavy], "tiny", {}, [], False, None, 1.0)
    summary = json.loads(next(tmp_path.glob("serving-test-*.json")).read_text())["summary"]
    assert summary["max_rate_under_200ms_normalized_latency"] == 100.0      # steady state: below the grown queue
    assert summary["max_rate_under_200ms_including_saturated"] == 1000.0
    assert summary["first_rate_past_saturation"] == 1000.0
    assert summary["first_rate_asking_more_than_delivered"] == 100.0
    assert summary["max_achieved_req_s"] == pytest.approx(max(r["achieved_req_s"] for r in (light, mid, heavy)))
