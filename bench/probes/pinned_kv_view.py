"""Can a KV block live in pinned host memory and still be written in place from numpy? A pinned_host JAX array's
buffer seen as a numpy array through `unsafe_buffer_pointer`: rows written there must reach the device on the
next put. Then the rates: a pinned block's put (a DMA) against a numpy block's (staged), and a prefill's rows
stored into the pinned block through a pinned DMA and a memcpy.

usage: python -m bench.probes.pinned_kv_view [--sequences 16]
"""
from __future__ import annotations

import argparse
import ctypes

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from bench.common import best_seconds


def view(a: jax.Array) -> np.ndarray:
    """A writable numpy view of a pinned_host array's buffer (bfloat16 as uint16)."""
    ptr = a.unsafe_buffer_pointer()
    return np.ctypeslib.as_array((ctypes.c_uint16 * a.size).from_address(ptr)).reshape(a.shape)


def main(argv=None) -> int:
    import ml_dtypes
    p = argparse.ArgumentParser()
    p.add_argument("--sequences", type=int, default=16)
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    on, pin = SingleDeviceSharding(dev), SingleDeviceSharding(dev, memory_kind="pinned_host")
    shape = (args.sequences, 544, 56, 128)
    blk = jax.device_put(np.zeros(shape, ml_dtypes.bfloat16), pin)
    v = view(blk)
    v[0, 5, 3, :] = np.full(128, 1.5, ml_dtypes.bfloat16).view(np.uint16)
    back = np.asarray(jax.device_put(blk, on))
    print("written row reached the device:", bool((back[0, 5, 3] == 1.5).all()), "others zero:",
          bool(np.count_nonzero(back.view(np.uint16)) == 128))
    v[0, 5, 3, :] = 0
    back = np.asarray(jax.device_put(blk, on))
    print("second write reached the device:", bool(np.count_nonzero(back.view(np.uint16)) == 0))
    nb = blk.nbytes
    host = np.zeros(shape, ml_dtypes.bfloat16)
    pinned_s = best_seconds(lambda: jax.device_put(blk, on).block_until_ready())
    numpy_s = best_seconds(lambda: jax.device_put(host, on).block_until_ready())
    print(f"load pinned block {nb / 1e6:.0f} MB: {nb / pinned_s / 1e9:.1f} GB/s; numpy block {nb / numpy_s / 1e9:.1f} GB/s")
    rows = jax.device_put(np.ones((args.sequences, 512, 56, 128), ml_dtypes.bfloat16), on)

    def store_pinned():
        r = jax.device_put(rows, pin)
        v[:, :512] = view(r)

    def store_numpy():
        host[:, :512] = np.asarray(rows)
    for name, fn in (("pinned DMA + memcpy", store_pinned), ("numpy (pageable)", store_numpy)):
        print(f"store rows {rows.nbytes / 1e6:.0f} MB {name}: {rows.nbytes / best_seconds(fn) / 1e9:.1f} GB/s")
    print("stored rows reached the device:", bool((np.asarray(jax.device_put(blk, on))[:, :512] == 1).all()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
