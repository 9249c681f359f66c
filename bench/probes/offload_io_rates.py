"""The offload runtime's transfers as it makes them, against the hardware profile's rates: pinned host -> device
for one 64 MB array, four at once (the profile's way) and one OPT-30B layer's six weight matrices (1.2 GB, as
`WeightStore.fetch` moves a layer); and a disk-tier KV block (a memory-mapped file, written row by row as decode
passes write it) loaded as `KVStore.load` loads it (np.array of the map, then a pageable put), from one thread and
from the I/O pool's four, with the file's pages cached and dropped.

Why: on the H100 host the weight stream ran at ~53 GB/s (59.2 GB in a 1.11 s decode pass) against 44 in the
profile, and the LP's policy with 12% of its KV on disk decoded 1.5x slower than the cost model predicted
(bench/results/flexgen-grid-20261127.json).

usage: python -m bench.probes.offload_io_rates [--blocks 8] [--name offload_io_rates]
"""
from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from bench.common import print_table, write_results
from nfjax.offload.hardware import _rate, drop_cached

LAYER = [(7168, 7168)] * 4 + [(7168, 28672), (28672, 7168)]      # OPT-30B: q, k, v, out, fc1, fc2
KV_BLOCK = (4, 544, 56, 128)                                       # OPT-30B, 4 sequences of 512 + 32 positions


def pinned_rates(dev) -> dict:
    import ml_dtypes
    on, pin = SingleDeviceSharding(dev), SingleDeviceSharding(dev, memory_kind="pinned_host")
    out = {}
    one = jax.device_put(np.ones(64 * 2 ** 20, np.uint8), pin)
    out["pinned 1 x 64 MB"] = _rate(one.nbytes, lambda: jax.device_put(one, on).block_until_ready(), max_reps=20)
    four = [jax.device_put(np.full(64 * 2 ** 20, i, np.uint8), pin) for i in range(4)]
    out["pinned 4 x 64 MB"] = _rate(4 * 64 * 2 ** 20, lambda: jax.block_until_ready([jax.device_put(a, on)
                                                                                    for a in four]), max_reps=10)
    layer = [jax.device_put(np.ones(s, ml_dtypes.bfloat16), pin) for s in LAYER]
    n = sum(a.nbytes for a in layer)
    out["pinned OPT-30B layer (1.2 GB)"] = _rate(n, lambda: jax.block_until_ready([jax.device_put(a, on)
                                                                                  for a in layer]), max_reps=10)
    return out


def disk_rates(dev, folder: Path, blocks: int) -> dict:
    import ml_dtypes
    on = SingleDeviceSharding(dev)
    maps = []
    for i in range(blocks):
        m = np.lib.format.open_memmap(folder / f"kv{i}.npy", mode="w+", dtype=ml_dtypes.bfloat16, shape=KV_BLOCK)
        row = np.ones((KV_BLOCK[0], 1, *KV_BLOCK[2:]), ml_dtypes.bfloat16)
        for p in range(KV_BLOCK[1]):                    # written a position at a time, as passes write them
            m[:, p:p + 1] = row
        m.flush()
        maps.append(m)
    nbytes = sum(m.nbytes for m in maps)

    def load(m):
        return jax.device_put(np.array(m), on).block_until_ready()

    def drop():
        for i in range(blocks):
            drop_cached(folder / f"kv{i}.npy")

    out = {}
    with ThreadPoolExecutor(4) as pool:
        for threads in (1, 4):
            def run():
                return list(map(load, maps)) if threads == 1 else list(pool.map(load, maps))
            out[f"disk KV load, cached, {threads} thread(s)"] = _rate(nbytes, run, max_reps=5)

            def cold():
                drop()
                return run()
            out[f"disk KV load, dropped, {threads} thread(s)"] = _rate(nbytes, cold, max_reps=3)
        host = [np.array(m) for m in maps]
        out["pageable KV put (numpy), 4 threads"] = _rate(nbytes, lambda: list(pool.map(
            lambda a: jax.device_put(a, on).block_until_ready(), host)), max_reps=5)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--dir", default=None, help="folder for the disk blocks (default: the offload folder)")
    p.add_argument("--name", default="offload_io_rates")
    a = p.parse_args(argv)
    dev = jax.devices()[0]
    from nfjax.offload.engine import default_offload_dir
    base = Path(a.dir) if a.dir else default_offload_dir()
    base.mkdir(parents=True, exist_ok=True)
    rates = {}
    if dev.platform != "cpu":
        rates.update(pinned_rates(dev))
    with tempfile.TemporaryDirectory(dir=base) as folder:
        rates.update(disk_rates(dev, Path(folder), a.blocks))
    print_table(["transfer", "GB/s"], [[k, v / 1e9] for k, v in rates.items()])
    write_results(a.name, {k.replace(" ", "_"): round(v / 1e9, 3) for k, v in rates.items()},
                  {"kv_block": KV_BLOCK, "blocks": a.blocks, "layer": LAYER})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
