"""The engine end to end with each KV format on the device's kernels (the shipped tiny model; issue #21): the start
line, greedy tokens against the bfloat16 cache's, and each format's path (kernels or reference) as traced.

usage: python -m bench.probes.kv_engine_smoke [--formats bfloat16,fp8,int4] [--model DIR]
"""
from __future__ import annotations

import argparse
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bfloat16,fp8,int4")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    from nfjax.engine import SamplingParams
    from nfjax.engine.builder import build_engine
    prompts = ["Once upon a time", "The list type", "def main():\n    ", "import numpy as np\n"] * 4
    base = None
    for fmt in args.formats.split(","):
        t0 = time.perf_counter()
        eng = build_engine(args.model, {"cache": {"kv_dtype": fmt, "num_pages": 512},
                                        "batcher": {"token_buckets": [16, 64]}}, dtype="bfloat16")
        t1 = time.perf_counter()
        outs = eng.generate(prompts, SamplingParams.greedy(max_tokens=args.max_tokens, ignore_eos=True))
        toks = [o.token_ids for o in outs]
        same = None if base is None else sum(a == b for x, y in zip(toks, base) for a, b in zip(x, y)) / sum(
            map(len, base))
        base = base or toks
        print(f"{fmt}: [{eng.capacity_line()}] start {t1 - t0:.1f}s, generate {time.perf_counter() - t1:.2f}s, "
              f"tokens equal to bfloat16's at {same}; {outs[0].text[:60]!r}", flush=True)


if __name__ == "__main__":
    main()
