"""A KV block's two host transfers at the sizes the offload grid moves, each way written several ways:

  store (device -> host numpy block, the rows a prefill wrote, as `KVStore.store_rows` stores them):
    serial     np.asarray(K), write it, then V (the runtime's way)
    async      both copies started (`copy_to_host_async`) before either is read
    pinned     both put into pinned host memory first (a DMA), then read into the block
    split4     each split in 4 along the batch on the device, the 8 pieces' copies started at once
  load (host numpy block -> device, as `KVStore.load` stages one): the K and V pair put at once

Why: traced on the H200 host (bench/results/offload_pass_trace-20261127.json) a prefill pass's KV stores ran at
1.3-1.45 GB/s, against the profile's 3.13 GB/s for one 64 MB array, and filled the whole pass (271 ms a layer
against the cost model's 113); decode-pass loads of 125-250 MB blocks ran at 9-16 GB/s against the profile's 8.1
for a pair of 64 MB.

usage: python -m bench.probes.kv_store_rates [--sizes-mb 31,125,250] [--name kv_store_rates]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from bench.common import best_seconds, print_table, write_results

HEADS, HEAD_DIM, POSITIONS = 56, 128, 544            # OPT-30B's KV heads; a block of 512 + 32 positions


def store_ways(dev, rows: tuple, bufs: tuple) -> dict:
    """Seconds to store the (K, V) rows into the host blocks `bufs` (positions 0..T-1 of every sequence), by way."""
    t = rows[0].shape[1]
    pin = SingleDeviceSharding(dev, memory_kind="pinned_host")
    split = jax.jit(lambda a: tuple(jnp.split(a, 4, axis=0)))

    def serial():
        for buf, r in zip(bufs, rows):
            buf[:, :t] = np.asarray(r)

    def started():
        for r in rows:
            r.copy_to_host_async()
        for buf, r in zip(bufs, rows):
            buf[:, :t] = np.asarray(r)

    def pinned():
        hs = jax.device_put(rows, pin)
        for buf, h in zip(bufs, hs):
            buf[:, :t] = np.asarray(h)

    def split4():
        parts = [split(r) for r in rows]
        for ps in parts:
            for p in ps:
                p.copy_to_host_async()
        for buf, ps in zip(bufs, parts):
            n = ps[0].shape[0]
            for i, p in enumerate(ps):
                buf[i * n:(i + 1) * n, :t] = np.asarray(p)

    out = {}
    for name, fn in (("serial", serial), ("async", started), ("pinned", pinned), ("split4", split4)):
        try:
            out[name] = best_seconds(fn)
        except Exception as e:  # noqa: BLE001 - a way the backend lacks (no pinned_host on CPU): reported, not timed
            print(f"[{name}: {e!r}]")
    return out


def main(argv=None) -> int:
    import ml_dtypes
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="31,125,250", help="K's bytes of a block (V the same), MB")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--name", default="kv_store_rates")
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    on = SingleDeviceSharding(dev)
    per_seq = POSITIONS * HEADS * HEAD_DIM * 2
    rows_out, data = [], {}
    for mb in (int(x) for x in args.sizes_mb.split(",")):
        bs = max(1, round(mb * 1e6 / per_seq))
        bufs = tuple(np.zeros((bs, POSITIONS, HEADS, HEAD_DIM), ml_dtypes.bfloat16) for _ in range(2))
        rng = np.random.default_rng(0)
        rows_np = tuple(rng.integers(0, 1000, (bs, args.prompt_len, HEADS, HEAD_DIM)).astype(ml_dtypes.bfloat16)
                        for _ in range(2))
        rows = jax.block_until_ready(tuple(jax.device_put(r, on) for r in rows_np))
        store = store_ways(dev, rows, bufs)
        assert all(np.array_equal(b[:, :args.prompt_len], r) for b, r in zip(bufs, rows_np)), "a store lost rows"
        load = best_seconds(lambda: jax.block_until_ready(tuple(jax.device_put(b, on) for b in bufs)))
        nbytes_store, nbytes_load = sum(r.nbytes for r in rows_np), sum(b.nbytes for b in bufs)
        row = {"sequences": bs, "block MB (K+V)": nbytes_load / 1e6,
               **{f"store {k} GB/s": nbytes_store / v / 1e9 for k, v in store.items()},
               "load pair GB/s": nbytes_load / load / 1e9}
        rows_out.append(row)
        data[str(mb)] = {"sequences": bs, "store_s": store, "load_s": load, "store_bytes": nbytes_store,
                         "load_bytes": nbytes_load}
        del rows, bufs, rows_np
    heads = list(dict.fromkeys(k for r in rows_out for k in r))
    print_table(heads, [[r.get(h, "") for h in heads] for r in rows_out])
    summary = {f"{k.split()[0]}_{k.split()[1]}_{r['sequences']}seq_gb_s".replace(" ", "_"): v
               for r in rows_out for k, v in r.items() if k.endswith("GB/s")}
    print(write_results(args.name, summary, {"device": str(dev), "runs": data}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
