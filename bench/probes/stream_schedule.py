"""Where XLA schedules the stream regions of a compiled step (GPU only; bench/NOTES.md section 6).

Compiles one layer of the Llama-3-8B shape under a NanoFlow plan with streams on and prints, for each
`call-start` (a `compute_on` region), how many instructions XLA's schedule puts before its `call-done`, and
which of them are kernels or other region starts. A region whose done follows its start directly overlaps
nothing.

    python3 bench/stream_schedule.py --plan bench/probes/plans/llama3-8b_h100_tp1_fullsm.json --bucket 2048
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--bucket", type=int, default=2048)
    ap.add_argument("--plan", default="bench/probes/plans/llama3-8b_h100_tp1_fullsm.json",
                    help="a plan with stream orders (path; run from the repository root)")
    ap.add_argument("--dump", default=None, help="folder for the optimized HLO text of each step program")
    args = ap.parse_args()
    from nfjax.config import CacheConfig, ExecutionConfig, BatcherConfig, StrategyConfig
    from nfjax.engine.runner import Runner
    from nfjax.experimental.streams import use_streams
    from nfjax.models.random_init import SHAPES, random_model
    from nfjax.parallel import make_mesh, shard_model

    cfg = SHAPES[args.shape].replace(num_layers=1)
    mesh = make_mesh(1)
    model = random_model(cfg)
    shard_model(model, mesh)
    sc = ExecutionConfig(strategies=(StrategyConfig("nanoflow", plan=args.plan),))
    r = Runner(model, CacheConfig(16, 512, 64), BatcherConfig((args.bucket,), max_seqs=64), mesh, sc)
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
