"""Does decode attention on the CPU run slower over a KV block in pinned host memory (a numpy view of a
`pinned_host` array, as `KVStore` now keeps host blocks) than over a numpy block, and slower while the weights'
DMA crosses the link? In the #25 grid (session 21) CPU-attended policies with 2+ batches a block decoded 1.3-2.5x
slower than the profile's CPU attention rate.

usage: python -m bench.probes.cpu_attention_pinned [--sequences 2,8] [--name cpu_attention_pinned]
Blocks are OPT-30B's (544 positions, 56 heads of 128); the DMA load is four 256 MB pinned arrays put in a loop.
"""
from __future__ import annotations

import argparse
import threading

import jax
import ml_dtypes
import numpy as np
from jax.sharding import SingleDeviceSharding

from bench.common import best_seconds, print_table, write_results
from nfjax.offload.cpu_attention import cpu_attention
from nfjax.offload.store import pinned_zeros


class LinkBusy:
    """Puts pinned arrays on the device in a loop on a thread, as a layer's weights cross the link."""

    def __init__(self, dev):
        pin = SingleDeviceSharding(dev, memory_kind="pinned_host")
        self.on = SingleDeviceSharding(dev)
        self.src = [jax.device_put(np.full(2 ** 28, i, np.uint8), pin) for i in range(4)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            jax.block_until_ready([jax.device_put(a, self.on) for a in self.src])

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", default="1,2,8")
    p.add_argument("--name", default="cpu_attention_pinned")
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    pin = SingleDeviceSharding(dev, memory_kind="pinned_host")
    rows, summary = [], {}
    for b in (int(x) for x in args.sequences.split(",")):
        shape = (b, 544, 56, 128)
        rng = np.random.default_rng(0)
        data = rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
        blocks = {"numpy": (data, data.copy())}
        pinned = [pinned_zeros(shape, ml_dtypes.bfloat16, pin) for _ in range(2)]
        for _, v in pinned:
            v[...] = data
        blocks["pinned view"] = tuple(v for _, v in pinned)
        q = rng.standard_normal((b, 56, 128), np.float32).astype(ml_dtypes.bfloat16)
        pos = np.full((b, 1), 543, np.int32)
        nbytes = 2 * data.nbytes
        for kind, kv in blocks.items():
            for busy in (False, True):
                def run():
                    return cpu_attention(q, kv, pos, 128 ** -0.5)
                if busy:
                    with LinkBusy(dev):
                        s = best_seconds(run)
                else:
                    s = best_seconds(run)
                rows.append([b, kind, busy, nbytes / 1e6, s * 1e3, nbytes / s / 1e9])
                summary[f"b{b}_{kind.replace(' ', '_')}_{'busy' if busy else 'idle'}_gb_s"] = nbytes / s / 1e9
    heads = ["sequences", "block", "link busy", "MB", "ms", "GB/s"]
    print_table(heads, rows)
    print(write_results(args.name, summary, {"rows": [dict(zip(heads, r)) for r in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
