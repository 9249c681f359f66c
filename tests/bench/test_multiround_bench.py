"""bench.multiround on a CPU: the smoke shape through the whole script (cache off, GPU only, GPU + host + disk on
multi-round conversations; single-round with and without the tiers), writing the summary keys."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_multiround_bench_runs_on_a_cpu(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "bench.multiround", "--shape", "smoke", "--layers", "1",
                        "--conversations", "6", "--concurrency", "6", "--turns", "4,5", "--msg-len", "10",
                        "--out-len", "4", "--max-pages", "20", "--max-model-len", "256", "--token-buckets", "64",
                        "--host-cache-gb", "0.00002", "--disk-cache-dir", str(tmp_path / "disk"),
                        "--disk-cache-gb", "0.001", "--single-requests", "4", "--out-dir", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    (res,) = tmp_path.glob("multiround-*.json")
    doc = json.loads(res.read_text())
    s = doc["summary"]
    for k in ("multiround_ttft_speedup", "multiround_throughput_speedup", "prefix_hit_rate"):
        assert s[k] > 0, k
    assert "offload_overhead_pct" in s
    st = doc["data"]["prefix_stats"]
    assert st["off"]["hit_tokens"] == 0 and st["gpu"]["hit_rate"] > 0
    assert st["tiers"]["hit_tokens_host"] + st["tiers"]["hit_tokens_disk"] > 0
    assert not list((tmp_path / "disk").glob("*.kvpage"))          # the tier's files are gone at close
