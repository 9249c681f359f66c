"""bench.flexgen on a CPU: the OPT smoke shape through the whole script (the grid, the row-by-row baseline, the
traced decode pass), writing the summary keys and the timeline picture."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flexgen_bench_runs_on_a_cpu(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "bench.flexgen", "--shape", "opt-smoke", "--layers", "2",
                        "--prompt-len", "16", "--gen-len", "4", "--gpu-memory-gb", "1", "--out-dir", str(tmp_path),
                        "--offload-dir", str(tmp_path / "off")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (res,) = tmp_path.glob("flexgen-*.json")
    doc = json.loads(res.read_text())
    s = doc["summary"]
    for k in ("flexgen_out_tok_s_optsmoke_1gb", "flexgen_vs_rowbyrow", "flexgen_out_tok_s_optsmoke_1gb_int4"):
        assert s[k] > 0, k
    assert s["flexgen_best_policy"] in doc["data"]["runs"]
    assert doc["data"]["rowbyrow"]["policy"]["schedule"] == "row_by_row"
    lanes = {e["lane"] for e in doc["data"]["trace"]["events"]}
    assert {"compute", "load weights", "load cache", "store cache"} <= lanes
    assert (tmp_path / res.name.replace(".json", "-timeline.png")).stat().st_size > 10_000
    assert list((tmp_path / "off").iterdir()) == []
