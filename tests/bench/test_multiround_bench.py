"""bench.multiround on a CPU: the smoke shape through the whole script (cache off, GPU only, GPU + host + disk on
multi-round conversations; single-round with and without the tiers), writing the summary keys."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "bench.multiround", "--shape", "smoke", "--layers", "1",
                           "--conversations", "6", "--concurrency", "6", "--turns", "4,5", "--msg-len", "10",
                           "--out-len", "4", "--max-pages", "20", "--max-model-len", "256", "--token-buckets", "64",
                           "--host-cache-gb", "0.00002", "--disk-cache-dir", str(tmp_path / "disk"),
                           "--disk-cache-gb", "0.001", "--single-requests", "4", "--out-dir", str(tmp_path), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_multiround_bench_runs_on_a_cpu_in_two_parts(tmp_path):
    """The engines split over two invocations (as over two device commands): the first writes no summary, the
    second merges the first's results and writes all keys."""
    p = _run(tmp_path, "--configs", "off,gpu", "--name", "part1")
    assert p.returncode == 0, p.stderr[-3000:]
    (part,) = tmp_path.glob("part1-*.json")
    first = json.loads(part.read_text())
    assert first["summary"] == {} and set(first["data"]["results"]) == {"off", "gpu"}
    assert "[gpu] " in p.stdout and "turns in" in p.stdout
    p = _run(tmp_path, "--configs", "tiers", "--merge", str(part), "--progress-s", "0.01", "--single-repeats", "3")
    assert p.returncode == 0, p.stderr[-3000:]
    # the tier rule at start, and progress lines with the tiers' counters (a run killed by a timeout shows them)
    assert "[tiers] prefix tiers: a page" in p.stdout and "recomputes in" in p.stdout
    progress = [ln for ln in p.stdout.splitlines() if ln.startswith("[tiers] ") and "blocked in loads" in ln]
    assert progress and "rows to/from host" in progress[-1] and "tok/s, hit rate" in progress[-1]
    (res,) = tmp_path.glob("multiround-*.json")
    doc = json.loads(res.read_text())
    s = doc["summary"]
    for k in ("multiround_ttft_speedup", "multiround_throughput_speedup", "prefix_hit_rate"):
        assert s[k] > 0, k
    assert "offload_overhead_pct" in s
    single = doc["data"]["results"]["tiers"]["single"]
    assert len(single["runs_tok_s"]) == 3 and single["total_tok_s"] == sorted(single["runs_tok_s"])[1]
    st = doc["data"]["prefix_stats"]
    assert st["off"]["hit_tokens"] == 0 and st["gpu"]["hit_rate"] > 0
    assert st["tiers"]["hit_tokens_host"] + st["tiers"]["hit_tokens_disk"] > 0
    assert not list((tmp_path / "disk").glob("*.kvpage"))          # the tier's files are gone at close


def test_progress_line_reports_the_tier_counters():
    from bench.multiround import progress_line
    st = {"hit_rate": 0.5, "hit_tokens_gpu": 10, "hit_tokens_host": 20, "hit_tokens_disk": 30, "rows_to_host": 7,
          "rows_from_host": 3, "evictions_dropped": 1, "skipped_pages_host": 2, "skipped_pages_disk": 4,
          "bytes_to_disk": 2 ** 21, "bytes_from_disk": 2 ** 20, "disk_write_backlog": 5, "disk_writes_dropped": 6,
          "tier_load_s": 1.25,
          "evict_s": 0.5, "evict_launch_s": 0.25, "tier_step_waits": 0}
    line = progress_line("tiers", 12, 10.0, 5000, st)
    assert line.startswith("[tiers] 12 turns, 10 s, 500 tok/s, hit rate 0.500 (gpu 10 host 20 disk 30 tokens)")
    assert ("rows to/from host 7/3, dropped 1, skipped host/disk 2/4, disk MiB w/r 2/1 (backlog 5, dropped 6), blocked in "
            "loads 1.25 s, evictions 0.50 s (launches 0.25 s), step waits 0") in line
    assert "rows to/from" not in progress_line("gpu", 1, 1.0, 1, {"hit_rate": 0.0})


def test_multiround_bench_bad_flags_are_one_line_errors(tmp_path, capsys):
    # a bad --configs is argparse's error, before anything runs: main() in this process (argparse prints the
    # message to stderr and exits 2, as a child would), not in one more Python process
    from bench.multiround import main
    with pytest.raises(SystemExit) as bad:
        main(["--shape", "smoke", "--configs", "gpu,nope", "--disk-cache-dir", str(tmp_path / "disk"),
              "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert bad.value.code != 0 and "--configs gpu,nope" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
    # an engine setting the builder rejects: a UserError turned into one line by the script's __main__ (a real child)
    p = _run(tmp_path, "--configs", "tiers", "--disk-cache-gb", "1e9")
    assert p.returncode != 0 and "disk_cache_gb" in p.stderr and "Traceback" not in p.stderr
