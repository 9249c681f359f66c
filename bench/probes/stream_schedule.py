"""Where XLA schedules the stream regions of a compiled step (GPU only; bench/NOTES.md section 6).

Compiles one layer of the Llama-3-8B shape under a NanoFlow plan with streams on and prints, for each
`call-start` (a `compute_on` region), how many instructions XLA's schedule puts before its `call-done`, and
which of them are kernels or other region starts. A region whose done follows its start directly overlaps
nothing.

    python -m bench.probes.stream_schedule --plan bench/probes/plans/llama3-8b_h100_tp1_fullsm.json \
        --token-buckets 2048
"""
from __future__ import annotations

import argparse
import os
import re

from bench.setup import add_bench_args

PROBE_PLAN = "bench/probes/plans/llama3-8b_h100_tp1_fullsm.json"    # a plan with stream orders (a path)


def region_windows(hlo: str) -> list[dict]:
    """Each call-start of the entry computation with the instructions scheduled before its call-done."""
    lines = hlo.splitlines()
    entry = next(i for i, ln in enumerate(lines) if ln.startswith("ENTRY"))
    body = [ln.strip() for ln in lines[entry:]]
    out = []
    for i, ln in enumerate(body):
        m = re.match(r"%(call-start(\.\d+)?) = ", ln)
        if not m:
            continue
        name = m.group(1)
        j = next(j for j, x in enumerate(body) if "call-done(" in x and re.search(rf"%{re.escape(name)}[),]", x))
        between = [re.match(r"%?([\w.\-]+)", x).group(1) for x in body[i + 1:j]]
        out.append({"start": name, "between": len(between),
                    "kernels_or_regions": [x for x in between if x.startswith(
                        ("fusion", "custom-call", "cublas", "gemm", "call-start", "loop", "input", "wrapped"))]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--dump", default=None, help="folder for the optimized HLO text of each step program")
    args = ap.parse_args()
    from bench.setup import bench_runner
    from nfjax.experimental.streams import use_streams
    args.layers = args.layers or 1                       # one layer shows the schedule
    if not (args.plan or args.strategies):
        args.plan = PROBE_PLAN
    r = bench_runner(args, compile=False, defaults={"batcher": {"token_buckets": (2048,), "max_seqs": 64},
                                                    "cache": {"num_pages": 512, "max_model_len": 1024}})
    use_streams(r)                          # experimental: nfjax/experimental/streams.py
    r.compile_all()
    for key, exe in r._steps.items():
        text = exe.as_text()
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            label = re.sub(r"[^\w.-]", "_", str(key[1]))
            with open(os.path.join(args.dump, f"step-{key[0]}-{label}.hlo.txt"), "w") as f:
                f.write(text)
        wins = region_windows(text)
        print(key, f"{len(wins)} regions")
        for w in wins:
            print(f"  {w['start']:16s} {w['between']:4d} instructions before its done; "
                  f"kernels/regions among them: {w['kernels_or_regions'][:40]}")


if __name__ == "__main__":
    main()
