"""Accuracy of Top-K sparse attention (FlexGen section 5; policy `attention_topk`) on a real model: held-out
perplexity and teacher-forced top-1 agreement with dense attention, per K.

    python -m bench.sparse_attention                         # SmolLM2-135M-Instruct, K = 50, 20, 10, 5 %
    python -m bench.sparse_attention --topk 30,10 --window 256 --windows 2

The model runs through the offload engine's own layer programs (`OffloadEngine.token_logprobs`: one prefill pass,
every query keeping the ceil(K x (p + 1)) largest of its p + 1 causal scores), in float32, all on the device. The
text is bench/data/kv_heldout.txt (written for the compressed-KV bench, Nov 2026: no model can have trained on
it), cut into `--windows` windows of `--window` tokens. Top-1 agreement: the share of positions whose most likely
next token equals dense attention's. Every position counts; `_late` counts only the second half of each window
(queries with at least window/2 earlier positions, as a decode step after a prompt has: at small p, K% of p + 1
scores is a handful). Summary keys: sparse_ppl_dense, sparse_ppl_k<K>, sparse_ppl_delta_pct_k<K>, sparse_top1_k<K>,
sparse_ppl_late_delta_pct_k<K>, sparse_top1_late_k<K>.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "kv_heldout.txt")


def measure(model: str, topks: list[float], window: int, windows: int) -> dict:
    from jax.sharding import SingleDeviceSharding
    import jax

    from nfjax.checkpoint.models import resolve
    from nfjax.checkpoint.orbax_io import load_model
    from nfjax.offload import Policy
    from nfjax.offload.engine import OffloadEngine
    from nfjax.tokenizer import load_tokenizer
    path = resolve(model)
    tok = load_tokenizer(path)
    ids = tok.encode(open(TEXT, encoding="utf-8").read(), add_special_tokens=False)
    n = min(windows, len(ids) // window)
    seqs = [ids[i * window:(i + 1) * window] for i in range(n)]
    host = SingleDeviceSharding(jax.devices("cpu")[0])
    m = load_model(path, dtype="float32", sharding_fn=lambda k, x: host)
    rows, dense_top = {}, None
    for k in [100.0] + [x for x in topks if x != 100.0]:
        t0 = time.perf_counter()
        pol = Policy(gpu_batch_size=n, attention_topk=k)
        with OffloadEngine.from_model(m, tok, pol, max_model_len=window) as eng:
            res = eng.token_logprobs(seqs, argmax=True)
        lp = np.stack([a for a, _ in res])                    # [windows, window - 1]
        top = np.stack([b for _, b in res])
        if dense_top is None:
            dense_top = top
        late = slice(window // 2, None)           # queries with >= window / 2 positions: a decode after a prompt
        rows[k] = {"ppl": float(np.exp(-lp.mean())), "top1_agreement": float((top == dense_top).mean()),
                   "ppl_late": float(np.exp(-lp[:, late].mean())),
                   "top1_agreement_late": float((top[:, late] == dense_top[:, late]).mean()),
                   "tokens": int(lp.size), "seconds": time.perf_counter() - t0}
        print(f"[K={k:g}%: perplexity {rows[k]['ppl']:.3f}, top-1 agreement {rows[k]['top1_agreement']:.4f}]",
              flush=True)
    return rows


def main(argv=None) -> int:
    from bench.common import print_table, write_results
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--topk", default="50,20,10,5", help="percentages of scores kept, comma-separated")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--name", default="sparse_attention")
    args = p.parse_args(argv)
    topks = [float(x) for x in args.topk.split(",") if x.strip()]
    bad = [k for k in topks if not 0 < k <= 100]
    if bad:
        raise SystemExit(f"--topk: percentages in (0, 100], got {bad[0]:g}")
    rows = measure(args.model, topks, args.window, args.windows)
    dense = rows[100.0]["ppl"]
    summary = {"sparse_ppl_dense": dense}
    for k, r in rows.items():
        if k != 100.0:
            tag = f"{k:g}".replace(".", "p")
            r["ppl_delta_pct"] = 100 * (r["ppl"] / dense - 1)
            r["ppl_late_delta_pct"] = 100 * (r["ppl_late"] / rows[100.0]["ppl_late"] - 1)
            summary.update({f"sparse_ppl_k{tag}": r["ppl"], f"sparse_ppl_delta_pct_k{tag}": r["ppl_delta_pct"],
                            f"sparse_top1_k{tag}": r["top1_agreement"],
                            f"sparse_ppl_late_delta_pct_k{tag}": r["ppl_late_delta_pct"],
                            f"sparse_top1_late_k{tag}": r["top1_agreement_late"]})
    print_table(["K %", "perplexity", "delta %", "top-1 agreement", "late: perplexity", "delta %", "top-1"],
                [[k, r["ppl"], r.get("ppl_delta_pct", 0.0), r["top1_agreement"], r["ppl_late"],
                  r.get("ppl_late_delta_pct", 0.0), r["top1_agreement_late"]] for k, r in rows.items()])
    write_results(args.name, summary, {"model": args.model, "window": args.window, "rows": rows}, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
