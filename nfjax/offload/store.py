"""The three tiers: where each layer's weights, each (layer, GPU batch) KV block and each batch's activations
live, and the transfers between a tier and the device.

  * gpu: device arrays, resident.
  * cpu: host memory. Weights as JAX arrays in the `pinned_host` memory kind (policy host_memory "pinned": a
    device_put to the device memory kind is an asynchronous DMA) or as numpy arrays ("numpy"); activations as
    numpy buffers; KV blocks as numpy buffers the rows of each step are written into in place, under "pinned"
    the buffers of `pinned_host` JAX arrays seen through numpy (`pinned_zeros`): a block's load is then a DMA
    (H100 host: 47 GB/s against 4-8 for a numpy block's staged copy, which a weight's DMA in flight slowed 3x more:
    docs/design.md section 11).
  * disk: one .npy file per tensor in the run's folder (`DiskFolder`), read by the I/O threads (np.load) and
    put on the device; KV blocks are memory-mapped .npy files whose new rows are written in place.

Weights are split per layer by FlexGen's rule: the layer's tensors in order, each in the tier where the middle of
its bytes falls on the cumulative percentages. KV blocks (layer j, batch k) are numbered j * num_gpu_batches + k
and activations by batch, each in the tier where the middle of its index falls.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from pathlib import Path

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from nfjax.interrupts import Terminated, pid_alive
from nfjax.offload.compress import Packed, compress, compressible
from nfjax.offload.policy import Policy, Split

FOLDER_RE = re.compile(r"\.nfjax-offload-(\d+)-[0-9a-f]{8}")


def tier_of(mid_fraction: float, split: Split) -> str:
    g, c, _ = split.fractions()
    return "gpu" if mid_fraction < g else "cpu" if mid_fraction < g + c else "disk"


def weight_tiers(sizes: list[int], split: Split) -> list[str]:
    """The tier of each of a layer's tensors (bytes `sizes`, in order) by the middle of its bytes."""
    total, cum, out = float(sum(sizes)) or 1.0, 0, []
    for s in sizes:
        out.append(tier_of((cum + s / 2) / total, split))
        cum += s
    return out


def index_tiers(n: int, split: Split) -> list[str]:
    return [tier_of((i + 0.5) / n, split) for i in range(n)]


def kv_tiers(num_layers: int, num_batches: int, split: Split) -> list[str]:
    """The tier of each (layer j, batch k) KV block, at index j * num_batches + k: `index_tiers`' counts, dealt
    batch by batch so that every layer holds the same mix (to within one block). The cost model is linear in the
    tiers' fractions, i.e. it prices each layer at the average mix; dealt layer by layer (the first layers all on
    the GPU, the last all off it), a pass's layers are unlike and the slow ones set the pace (the H100 grid's LP
    policy, 4 x 8 with 35% of its KV on the GPU, decoded no faster than 4 x 8 with none there)."""
    flat = index_tiers(num_layers * num_batches, split)
    return [flat[k * num_layers + j] for j in range(num_layers) for k in range(num_batches)]


# ---- the disk tier's folder ------------------------------------------------------------------------------------
def remove_stale(root: Path) -> list[Path]:
    """Remove the folders that runs killed before they could clean up (SIGKILL, power loss) left in `root`: only
    folders named as `DiskFolder` names them whose process is gone."""
    removed = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        m = FOLDER_RE.fullmatch(d.name)
        if m and d.is_dir() and not d.is_symlink() and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            print(f"nfjax offload: removed {d}, left by an interrupted run", file=sys.stderr)
    return removed


def _storage(dtype) -> np.dtype:
    """The dtype a .npy file can name: 16-bit floats numpy does not know (bfloat16) are stored as uint16."""
    dtype = np.dtype(dtype)
    return dtype if dtype.kind in "biuf" and dtype.isbuiltin else np.dtype(f"u{dtype.itemsize}")


class DiskArray:
    """One array in a .npy file, read back in its own dtype."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype = path, np.dtype(dtype)

    def read(self) -> np.ndarray:
        return np.load(self.path).view(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size


_INTERRUPTED: list[int] = []             # signals received while a disk tier existed, not yet acted on


def check_interrupt() -> None:
    """Raise KeyboardInterrupt for a SIGINT / SIGTERM that arrived while a disk tier existed. The handler only
    records the signal: raised at an arbitrary bytecode it could land inside JAX's own Python code (its
    garbage-collection callback swallowed one; an interrupted one left the process to crash at exit), so the
    schedule and the engine call this at safe points, between computations. A second signal raises at once."""
    if _INTERRUPTED:
        sig = _INTERRUPTED.pop()
        _INTERRUPTED.clear()
        raise Terminated() if sig == signal.SIGTERM else KeyboardInterrupt()


class DiskFolder:
    """The run's disk-tier folder `ROOT/.nfjax-offload-PID-XXXXXXXX`. Removed by `close()`, at interpreter exit,
    and on SIGINT / SIGTERM (while it exists, both raise KeyboardInterrupt in the main thread at the schedule's
    next safe point, `check_interrupt`, so every `finally` runs); a later run removes what a SIGKILLed one left
    (`remove_stale`)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale(self.root)
        self.path = self.root / f".nfjax-offload-{os.getpid()}-{secrets.token_hex(4)}"
        self.path.mkdir()
        self._lock = threading.Lock()
        self._old: dict = {}
        if threading.current_thread() is threading.main_thread():
            _INTERRUPTED.clear()
            self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        atexit.register(self.close)

    @staticmethod
    def _on_signal(signum, frame):
        if _INTERRUPTED:                      # a second signal: stop now
            _INTERRUPTED.clear()
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        _INTERRUPTED.append(signum)

    def file(self, name: str) -> Path:
        return self.path / f"{name}.npy"

    def save(self, name: str, x: np.ndarray) -> DiskArray:
        p = self.file(name)
        np.save(p, x.view(_storage(x.dtype)))
        return DiskArray(p, x.dtype)

    def memmap(self, name: str, shape, dtype) -> np.ndarray:
        """A writable array backed by a .npy file (rows written in place)."""
        m = np.lib.format.open_memmap(self.file(name), mode="w+", dtype=_storage(dtype), shape=tuple(shape))
        return m.view(np.dtype(dtype))

    def close(self) -> None:
        with self._lock:
            if self.path.exists():
                shutil.rmtree(self.path, ignore_errors=True)
            if self._old and threading.current_thread() is threading.main_thread():
                for sig, h in self._old.items():
                    signal.signal(sig, h)
                self._old = {}
        atexit.unregister(self.close)


# ---- transfers --------------------------------------------------------------------------------------------------
# Rows at least this large come down through pinned memory (a DMA) before going into their numpy block: a pageable
# device -> host copy this size stalls the device's other copies and programs (traced on the H200 host, a prefill
# pass over 32 sequences of OPT-30B: 296 ms a layer with pageable stores, 70 through pinned memory).
PINNED_STORE_BYTES = 1 << 20


def pinned_zeros(shape: tuple, dtype, sharding) -> tuple[jax.Array, np.ndarray]:
    """A zeroed `pinned_host` array and a writable numpy view of its buffer (the view keeps the array alive).
    Writes through the view reach the device on the array's next device_put. Never read the array through
    np.asarray: JAX caches that copy, and it would not see later writes."""
    arr = jax.device_put(np.zeros(shape, dtype), sharding)
    arr.block_until_ready()
    buf = (ctypes.c_uint8 * arr.nbytes).from_address(arr.unsafe_buffer_pointer())
    buf._owner = arr
    return arr, np.ctypeslib.as_array(buf).view(np.dtype(dtype)).reshape(shape)


class Tiers:
    """The device, the host memory kind, the disk folder, and moving arrays between them."""

    def __init__(self, policy: Policy, device, disk: DiskFolder | None):
        self.device = device
        self.on_device = SingleDeviceSharding(device)
        self.pinned = policy.host_memory == "pinned"
        self.host_sharding = SingleDeviceSharding(device, memory_kind="pinned_host") if self.pinned else None
        self.disk = disk
        self._free: dict[tuple, list] = {}       # (shape, dtype) -> pinned KV arrays a closed KVStore gave back

    def to_device(self, x) -> jax.Array:
        return jax.device_put(x, self.on_device)

    def host_block(self, shape: tuple, dtype) -> tuple[jax.Array | None, np.ndarray]:
        """A KV array in host memory: (its pinned JAX array, a numpy view of it) under host_memory "pinned", else
        (None, a zeroed numpy array). A pinned one is a block given back by the last call of this shape where there
        is one (pinning and zeroing a 24 GB cache took seconds a call): its rows beyond those this call writes
        hold an earlier call's values, finite and masked by position as zeros are. A new shape frees the blocks
        kept for others."""
        if not self.pinned:
            return None, np.zeros(shape, dtype)
        key = (tuple(shape), np.dtype(dtype))
        if self._free.get(key):
            return self._free[key].pop()
        self._free = {k: v for k, v in self._free.items() if k == key}
        return pinned_zeros(shape, dtype, self.host_sharding)

    def drop_kept(self) -> None:
        """Free the blocks kept for a next call (the engine's close: the pinned pool then reuses their memory)."""
        self._free = {}

    def give_back(self, blocks) -> None:
        """(pinned array, view) pairs of a closed KV cache, for the next call's `host_block`."""
        for arr, view in blocks:
            self._free.setdefault((view.shape, view.dtype), []).append((arr, view))

    def to_host_weight(self, x):
        """A weight into host memory: pinned JAX array or numpy."""
        if self.pinned:
            return jax.device_put(x, self.host_sharding)
        return np.asarray(jax.device_get(x))


class WeightStore:
    """Every decoder layer's weights in their tiers. `fetch(j)` (an I/O thread) returns layer j's weights as a
    pytree of device arrays, `Packed` where compressed (decompressed inside the layer program)."""

    def __init__(self, policy: Policy, tiers: Tiers, treedef, shapes: list[tuple], itemsize: int):
        self.tiers, self.treedef = tiers, treedef
        sizes = [int(np.prod(s)) * itemsize for s in shapes]
        self.where = weight_tiers(sizes, policy.weights)
        self.packed = [policy.compress_weights and t != "gpu" and compressible(s) for t, s in zip(self.where, shapes)]
        self.any_packed = any(self.packed)
        self.layers: list[list] = []          # per layer, per leaf: device/host array, Packed, or disk path(s)

    def put(self, j: int, leaves: list) -> None:
        """Layer j's weights (arrays anywhere) into their tiers, compressed where the policy says."""
        assert j == len(self.layers)
        out = []
        for i, (x, tier, pk) in enumerate(zip(leaves, self.where, self.packed)):
            if pk:
                x = compress(self.tiers.to_device(x))
            if tier == "gpu":
                out.append(self.tiers.to_device(x))
            elif tier == "cpu":
                out.append(jax.tree.map(self.tiers.to_host_weight, x))
            else:
                parts = x if isinstance(x, Packed) else None
                if parts is None:
                    out.append(self.tiers.disk.save(f"w{j}-{i}", np.asarray(jax.device_get(x))))
                else:
                    out.append(Packed(*(self.tiers.disk.save(f"w{j}-{i}-{n}", np.asarray(jax.device_get(a)))
                                        for n, a in zip(("c", "s", "m"), (parts.codes, parts.scale, parts.center)))))
        self.layers.append(out)

    def resident(self, j: int) -> bool:
        return all(t == "gpu" for t in self.where)

    def fetch(self, j: int):
        """Layer j on the device (waits until every transfer has landed)."""
        def load(x):
            if isinstance(x, DiskArray):
                x = x.read()
            return x if isinstance(x, jax.Array) and x.sharding == self.tiers.on_device else self.tiers.to_device(x)
        leaves = [jax.tree.map(load, x, is_leaf=lambda v: isinstance(v, DiskArray)) for x in self.layers[j]]
        jax.block_until_ready(leaves)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def bytes_by_tier(self) -> dict[str, int]:
        out = {"gpu": 0, "cpu": 0, "disk": 0}
        for layer in self.layers:
            for x, t in zip(layer, self.where):
                for a in jax.tree.leaves(x, is_leaf=lambda v: isinstance(v, DiskArray)):
                    out[t] += a.nbytes
        return out
