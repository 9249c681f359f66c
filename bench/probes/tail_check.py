"""Probe (#21, fp8r): the GPU's reading of fp8r's K tail rows (nfjax/kv/tail_attention.py) against the reference,
compiled for the device (tests/kv/test_tail_attention.py checks the same in interpret mode on the CPU): a mixed
step of a chunk ending two positions into a group, a decode one position past a group and a chunk inside the first
group, at head_dim 64 and 128.

usage: python -m bench.probes.tail_check [--out DIR]
CPU:   python -m bench.probes.tail_check --interpret
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_info, write_results
from nfjax.config import CacheConfig, ModelConfig
from nfjax.kv.attention import paged_attention
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import build_metadata

PLANS = [[70, 60], [64, 1], [5, 58]]


def check(head_dim: int, seed: int = 0, interpret: bool = False) -> dict:
    cfg = ModelConfig(vocab_size=258, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=head_dim, max_position_embeddings=512, eos_token_ids=(257,),
                      bos_token_id=256, dtype="bfloat16")
    t, s, p = 160, 4, 4
    pages = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    kv = KVCache.create(cfg, CacheConfig(page_size=64, num_pages=13, max_pages_per_seq=p, kv_dtype="fp8r"),
                        tail_rows=4)
    rng = np.random.default_rng(seed)
    pos, meta = [0, 0, 0], None
    write = jax.jit(lambda kv, k, v, m: kv.write(jnp.int32(1), m.slot_mapping, k, v, m))
    for st in range(2):
        live = sorted((PLANS[i][st] != 1, i) for i in range(3))
        seqs = [(pages[i], pos[i], PLANS[i][st]) for _, i in live]
        meta = build_metadata(seqs, t, s, p, 64, num_decode=sum(1 for x in seqs if x[2] == 1),
                              kv_tails=[i + 1 for _, i in live]).to_device()
        k = jnp.asarray(rng.standard_normal((t, 2, head_dim)) * 2, jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((t, 2, head_dim)), jnp.bfloat16)
        kv = write(kv, k, v, meta)
        for _, i in live:
            pos[i] += PLANS[i][st]
    q = jnp.asarray(rng.standard_normal((t, 8, head_dim)), jnp.bfloat16)
    scale = head_dim ** -0.5
    ref = np.asarray(jax.jit(lambda kv: paged_attention(q, kv, jnp.int32(1), meta, scale, use_kernels=False))(kv),
                     np.float64)
    out = np.asarray(jax.jit(lambda kv: paged_attention(q, kv, jnp.int32(1), meta, scale, use_kernels=True,
                                                        copy_pages=8, interpret=interpret, num_ctas=3 if interpret
                                                        else None))(kv), np.float64)
    live_rows = int(np.asarray(meta.query_start)[-1])
    err = float(np.linalg.norm(out[:live_rows] - ref[:live_rows]) / np.linalg.norm(ref[:live_rows]))
    return {"head_dim": head_dim, "rel_err": err, "finite": bool(np.isfinite(out).all()), "ok": err < 1e-2}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="the kernels in interpret mode (CPU)")
    args = ap.parse_args(argv)
    rows = [check(d, interpret=args.interpret) for d in (64, 128)]
    for r in rows:
        print(r, flush=True)
    write_results("tail_check", {f"rel_err_d{r['head_dim']}": r["rel_err"] for r in rows},
                  {"rows": rows, "device": device_info()}, out_dir=args.out)
    if not all(r["ok"] and r["finite"] for r in rows):
        raise SystemExit("fp8r's kernel path differs from the reference")


if __name__ == "__main__":
    main()
