"""bench/nanoflow.py on the CPU: a decode-only dense batch (every row a decode, no prefill chunk) through the
decode-only horizontal-kernel plan of bench/probes/plans, its sampled tokens against Sequential's."""
import json
import subprocess

from bench.common import module_command
from bench.step_bench import mixed_batch

PLAN = "bench/probes/plans/llama3-8b_h200_tp1_decode_beside.json"


def test_a_batch_of_decodes_alone_has_no_prefill_chunks():
    bucket, seqs, nd = mixed_batch(64, 40, 16, num_decode=64)
    assert (bucket, nd, len(seqs)) == (64, 64, 64) and all(n == 1 for _, _, n in seqs)
    assert len(mixed_batch(64, 40, 16, num_decode=32)[1]) == 34           # 32 decodes + 2 prefill chunks


def test_decode_only_plan_runs_and_samples_sequentials_tokens(tmp_path):
    cmd = module_command("bench.nanoflow", "--shape", "smoke", "--token-buckets", "512", "--ctx", "40", "--decode",
                         "512", "--plan", PLAN, "--only-plans", "--no-trace", "--out", str(tmp_path))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    (f,) = tmp_path.glob("nanoflow-*.json")
    d = json.loads(f.read_text())["data"]
    res = d["buckets"]["512"]["strategies"]
    label = "nanoflow:llama3-8b_h200_tp1_decode_beside"
    assert set(res) == {"sequential", label}, d.get("skipped")
    assert res[label]["tokens_as_sequential"] == 1.0
    assert d["buckets"]["512"]["decode"] == 512
