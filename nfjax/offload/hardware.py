"""The machine's rates, measured (short, bounded runs) and cached per machine: what the cost model
(nfjax/offload/cost_model.py) turns bytes and flops into seconds with.

  gemm_flops      the device's matmul rate (FLOP/s) on a 30B-sized layer's GEMMs: bfloat16 (or the model's dtype)
                  tokens x 7168 @ 7168 x 28672 and back (fc1 and fc2 of OPT-30B), a few thousand tokens, several
                  in one program so that its dispatch is a small part of the time (CPU device: 256 x 1024, quick)
  gemm_curve      [[tokens, FLOP/s], ...]: the same program at fewer tokens (a prefill of a small GPU batch runs
                  below the large-GEMM rate); the cost model interpolates on it (`gemm_rate`)
  hbm_bytes       the device's memory bandwidth (bytes/s read + written): a 1 GiB float32 array scaled (one pass;
                  at ~3 TB/s 0.7 ms, against tens of us of dispatch; CPU device: 32 MB)
  h2d_bytes       host numpy -> device as `KVStore.load` moves a KV block: its K and V arrays (64 MB each) put
                  together and waited for (bytes/s; pageable memory: the copy through a staging buffer)
  h2d_curve       [[pair bytes, bytes/s], ...]: the same K and V pair put at 1/8 to 4 times that size (on
                  the H200 host a pair of 31 MB moved at 8.8 GB/s, of 250 MB at 14: bench/probes/kv_store_rates.py);
                  the cost model stages a KV block at its size's rate (`stage_rate`)
  h2d_one_bytes   one 64 MB numpy array put and waited for (the rate before: the record of what a lone copy gets)
  h2d_threads_bytes, d2h_threads_bytes   recorded, not used by the cost model: 4 threads (the I/O pool's size)
                  each moving one 64 MB numpy array at once, numpy -> device and device -> numpy (do pageable
                  copies from several threads add up? the KV stores of a prefill run so)
  h2d_pinned_bytes pinned_host JAX arrays -> device, four 256 MB arrays put together and waited for, as a layer's
                  weights move (each tensor its own copy, all in flight at once; on the H100 host one 64 MB array
                  moved at 40 GB/s, four at 47, OPT-30B's six layer matrices (1.2 GB) at 51: probe
                  bench/probes/offload_io_rates.py); None where the memory kind is absent
  d2h_bytes       device -> host numpy
  d2h_pinned_bytes device -> host as `KVStore.store_rows` stores a large block of rows with pinned host memory: the
                  K and V pair (64 MB each) put into pinned_host memory (a DMA), then copied into numpy arrays;
                  None where the memory kind is absent
  disk_read_bytes, disk_write_bytes   a 64 MB file in the offload folder: written with fsync, dropped from the
                  page cache (posix_fadvise DONTNEED) and read back with np.load
  cpu_attn_bytes  KV bytes a second that decode attention on the CPU reads (nfjax/offload/cpu_attention.py, the
                  function the runtime runs, on a [8, 1024, 16, 128] block: larger than a last-level cache, as the
                  runtime's blocks are; a small block ran 2.5x faster than OPT-30B's blocks did)
  dispatch_s      the fixed cost of one layer program call: the offload layer program of a tiny OPT layer (hidden
                  64, two sequences, one token: its compute is negligible), called and waited on
  transfer_s      the fixed cost of one transfer on an I/O thread: a 1 KB device_put submitted and waited for
  cpu_attn_fixed_s the fixed cost of one `cpu_attention` call (a 16-position block)
  cpu_threads, cpu_attn_pieces   the CPU attention pool's threads and the pieces the bench block splits into (one a
                  sequence): `cpu_attention_s` takes the bench's rate as that many threads' and a smaller block as
                  running on fewer (on the H100 host one sequence's block of OPT-30B, 3 pieces, took ~8 ms a call
                  against the 2.9 of the bench's rate)
  cpu_attn_sat_bytes the same bench over 2 x cpu_threads sequences (a piece for every thread, twice): the most
                  a call gets however many pieces it has (OPT-30B blocks of 24 and 96 pieces ran at 6.4 and
                  8.7 GB/s on the H100 host, where 16 threads at the 8-piece bench's rate a thread would be 10.9)
  cpu_attn_one_bytes the same bench over one sequence (one piece, one thread): a thread's rate while few run (on
                  the H100 host 0.73 GB/s a thread with 3 pieces at once, where the 8-piece bench gave 0.42: its threads
                  already shared the memory bandwidth)
  pass_s          the host's cost of one generated token's pass outside the layer programs (embedding, head,
                  sampling, the engine's bookkeeping): an OffloadEngine on that tiny one-layer model, all on the
                  device, one sequence: (time of 9 tokens - time of 1) / 8, less one layer call

On a CPU-only machine the "device" is the CPU and every rate is measured as it exists there (a device_put to the
CPU device is a host copy); nothing is invented. The cache is a JSON file under $NFJAX_CACHE/hardware/, named by
the device kind and the host name; `measure(..., remeasure=True)` (`--remeasure-hardware`) measures again.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BUDGET_S = 0.3             # each rate is timed for about this long (after a warm-up)
PROFILE_VERSION = 7


@dataclass(frozen=True)
class HardwareProfile:
    device_kind: str
    host: str
    gemm_flops: float
    hbm_bytes: float
    h2d_bytes: float
    h2d_pinned_bytes: float | None
    d2h_bytes: float
    disk_read_bytes: float
    disk_write_bytes: float
    cpu_attn_bytes: float
    dispatch_s: float
    transfer_s: float = 0.0
    cpu_attn_fixed_s: float = 0.0
    pass_s: float = 0.0
    measured_at: str = ""
    gemm_curve: tuple = ()                 # ((tokens, FLOP/s), ...) ascending; () in profiles from before it
    h2d_one_bytes: float | None = None
    h2d_threads_bytes: float | None = None
    d2h_threads_bytes: float | None = None
    d2h_pinned_bytes: float | None = None
    h2d_curve: tuple = ()                  # ((K and V pair bytes, bytes/s), ...) ascending
    cpu_threads: int | None = None
    cpu_attn_pieces: int | None = None
    cpu_attn_sat_bytes: float | None = None
    cpu_attn_one_bytes: float | None = None
    version: int = 0                       # PROFILE_VERSION when measured; a cached profile of an older one is
    #                                        measured again (version 1: one 2048-square GEMM, a 256 MB f32 scaling,
    #                                        h2d of one array; version 2: pinned h2d of one array, CPU
    #                                        attention on a 4 MB block through one XLA program; version 3: pinned
    #                                        h2d of four 64 MB arrays, CPU attention in XLA pieces; version 4: no
    #                                        pinned device->host, no h2d_curve; version 5: no cpu_threads;
    #                                        version 6: h2d_curve from 1/2 the size only, no
    #                                        cpu_attn_one_bytes)

    def __post_init__(self):
        object.__setattr__(self, "gemm_curve", tuple(tuple(p) for p in self.gemm_curve))
        object.__setattr__(self, "h2d_curve", tuple(tuple(p) for p in self.h2d_curve))

    def gemm_rate(self, tokens: float) -> float:
        """The matmul rate at `tokens` rows: the measured curve, linear in log(tokens) between its points and flat
        beyond them (`gemm_flops` where none was measured)."""
        return _on_curve(self.gemm_curve, tokens, self.gemm_flops)

    def stage_rate(self, nbytes: float) -> float:
        """The rate a numpy K and V pair of `nbytes` in all is put at: `h2d_curve` as `gemm_rate` reads its curve
        (`h2d_bytes` where none was measured)."""
        return _on_curve(self.h2d_curve, nbytes, self.h2d_bytes)

    def link_h2d(self) -> float:
        """The host->device link's rate: a pinned buffer's DMA (every byte crosses the link, pageable or not); the
        pageable rate where pinned memory was not measured."""
        return self.h2d_pinned_bytes or self.h2d_bytes

    def kv_store_rate(self, host_memory: str, nbytes: float) -> float:
        """The rate a KV block's rows come down at: through pinned memory where the runtime takes that way
        (`KVStore.store_rows`: pinned host memory, rows of `PINNED_STORE_BYTES` or more), else numpy's."""
        from nfjax.offload.store import PINNED_STORE_BYTES
        if host_memory == "pinned" and self.d2h_pinned_bytes and nbytes >= PINNED_STORE_BYTES:
            return self.d2h_pinned_bytes
        return self.d2h_bytes

    def cpu_attention_s(self, nbytes: float, pieces: int | None) -> float:
        """Seconds `cpu_attention` takes over `nbytes` of KV split into `pieces`: min(pieces, threads) threads at
        once, each at the one-piece bench's rate (before profile v7: the 8-piece bench's over its threads), capped
        by the saturated bench (the bench's rate where the split is unknown)."""
        if not (self.cpu_threads and self.cpu_attn_pieces and pieces):
            return nbytes / self.cpu_attn_bytes
        per_thread = self.cpu_attn_one_bytes or self.cpu_attn_bytes / min(self.cpu_attn_pieces, self.cpu_threads)
        rate = per_thread * min(pieces, self.cpu_threads)
        return nbytes / min(rate, self.cpu_attn_sat_bytes or rate)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "HardwareProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def weight_h2d(self, host_memory: str) -> float:
        """The rate a host-tier weight crosses at (pinned JAX arrays, or numpy)."""
        return self.h2d_pinned_bytes if host_memory == "pinned" and self.h2d_pinned_bytes else self.h2d_bytes

    def line(self) -> str:
        g = 1e9
        curve = ", ".join(f"{t} tokens {r / 1e12:.1f}" for t, r in self.gemm_curve)
        return (f"hardware ({self.device_kind}, {self.host}): matmul {self.gemm_flops / 1e12:.2f} TFLOP/s"
                f"{f' ({curve})' if curve else ''}, memory {self.hbm_bytes / g:.1f} GB/s, host->device "
                f"{self.h2d_bytes / g:.2f} (one array {(self.h2d_one_bytes or 0) / g:.2f}, pinned "
                f"{(self.h2d_pinned_bytes or 0) / g:.2f}, 4 threads {(self.h2d_threads_bytes or 0) / g:.2f}) GB/s, "
                f"device->host {self.d2h_bytes / g:.2f} (4 threads {(self.d2h_threads_bytes or 0) / g:.2f}, pinned "
                f"{(self.d2h_pinned_bytes or 0) / g:.2f}) GB/s, disk "
                f"read {self.disk_read_bytes / g:.2f} / write {self.disk_write_bytes / g:.2f} GB/s, CPU attention "
                f"{self.cpu_attn_bytes / g:.2f} GB/s of KV (+{self.cpu_attn_fixed_s * 1e6:.0f} us a call), layer "
                f"call {self.dispatch_s * 1e6:.0f} us, transfer {self.transfer_s * 1e6:.0f} us, pass "
                f"{self.pass_s * 1e6:.0f} us")


def _on_curve(curve: tuple, x: float, default: float) -> float:
    """The curve's value at x: linear in log(x) between its points, flat beyond them; `default` without points."""
    pts = [(t, r) for t, r in curve if t > 0 and r > 0]
    if not pts:
        return default
    if x <= pts[0][0]:
        return pts[0][1]
    for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
        if x <= t1:
            a = math.log(x / t0) / math.log(t1 / t0)
            return r0 + a * (r1 - r0)
    return pts[-1][1]


def _rate(work: float, fn, budget: float = BUDGET_S, max_reps: int = 50) -> float:
    """work / the median seconds of `fn()` (run once to warm up, then until `budget` seconds or `max_reps`)."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + budget
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return work / float(np.median(times))


GEMM_SHAPES = {"gpu": (7168, 28672, (256, 1024, 4096), 4), "cpu": (256, 1024, (16, 256), 2)}   # K, N, tokens, reps
HBM_BYTES = {"gpu": 2 ** 30, "cpu": 32 * 2 ** 20}


def matmul_rate(device, dtype, tokens: int, k: int, n: int, reps: int = 2, budget: float = BUDGET_S) -> float:
    """FLOP/s of `reps` pairs of dependent GEMMs [tokens, k] @ [k, n] -> [tokens, n] @ [n, k] in one program (a
    fori_loop: the pairs run one after another and XLA cannot merge them), the operands in `dtype`."""
    import jax
    import jax.numpy as jnp
    dtype = jnp.dtype(dtype)
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(ks[0], (tokens, k), jnp.float32).astype(dtype), device)
    w1 = jax.device_put((jax.random.normal(ks[1], (k, n), jnp.float32) * k ** -0.5).astype(dtype), device)
    w2 = jax.device_put((jax.random.normal(ks[2], (n, k), jnp.float32) * n ** -0.5).astype(dtype), device)

    @jax.jit
    def f(x, w1, w2):
        return jax.lax.fori_loop(0, reps, lambda i, h: ((h @ w1) @ w2).astype(dtype), x)
    return _rate(4 * reps * tokens * k * n, lambda: f(x, w1, w2).block_until_ready(), budget=budget, max_reps=20)


def _gemm(device, dtype) -> tuple[float, tuple]:
    """(the rate at the most tokens, the curve over the token counts)."""
    k, n, tokens, reps = GEMM_SHAPES["cpu" if device.platform == "cpu" else "gpu"]
    curve = tuple((t, matmul_rate(device, dtype, t, k, n, reps, budget=BUDGET_S / 2)) for t in tokens)
    return max(r for _, r in curve), curve


def _hbm(device) -> float:
    """Bytes/s read and written by one scaling of a large array (one elementwise pass: a loop of several could be
    unrolled and fused into one, and a small array measures the dispatch)."""
    import jax
    import jax.numpy as jnp
    n = HBM_BYTES["cpu" if device.platform == "cpu" else "gpu"] // 4
    a = jax.device_put(jnp.ones((n,), jnp.float32), device)          # (a CPU computes bfloat16 slower than it copies)
    f = jax.jit(lambda x: x * 0.5)
    return _rate(2 * 4 * n, lambda: f(a).block_until_ready())


def _transfers(device, nbytes: int) -> tuple[float, float, float | None, float, float | None]:
    """(numpy -> device as a KV block's K and V pair, numpy -> device of one array, pinned -> device, device ->
    numpy, device -> pinned -> numpy as a K and V pair), bytes/s."""
    import jax
    from jax.sharding import SingleDeviceSharding
    host = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    host2 = host[::-1].copy()
    on = SingleDeviceSharding(device)
    one = _rate(nbytes, lambda: jax.device_put(host, on).block_until_ready(), max_reps=20)
    pair = _rate(2 * nbytes, lambda: jax.block_until_ready((jax.device_put(host, on), jax.device_put(host2, on))),
                 max_reps=20)
    pinned = None
    try:
        big = np.tile(host, 1 if device.platform == "cpu" else 4)          # 256 MB a tensor on a GPU
        ps = [jax.device_put(np.roll(big, i), SingleDeviceSharding(device, memory_kind="pinned_host"))
              for i in range(4)]
        pinned = _rate(4 * big.nbytes, lambda: jax.block_until_ready([jax.device_put(p, on) for p in ps]),
                       max_reps=10)
    except Exception:          # noqa: BLE001 - a backend without the pinned_host memory kind: not measured
        pinned = None
    d = jax.device_put(host, on)
    # np.array copies: on a CPU device np.asarray may alias the buffer and time nothing
    d2h = _rate(nbytes, lambda: np.array(d), max_reps=20)
    d2h_pinned = None
    if pinned is not None:
        pair_d, outs = (d, jax.device_put(host2, on)), (np.empty_like(host), np.empty_like(host2))
        pin = SingleDeviceSharding(device, memory_kind="pinned_host")

        def store():
            for o, h in zip(outs, jax.device_put(pair_d, pin)):
                o[:] = np.asarray(h)
        d2h_pinned = _rate(2 * nbytes, store, max_reps=20)
    return pair, one, pinned, d2h, d2h_pinned


def _stage_curve(device, nbytes: int) -> tuple:
    """((pair bytes, bytes/s), ...): a numpy K and V pair put and waited for at 1/8 to 4 x `nbytes` each (a
    one-sequence OPT-30B block is a pair of 16 MB)."""
    import jax
    from jax.sharding import SingleDeviceSharding
    on = SingleDeviceSharding(device)
    out = []
    for scale in (0.125, 0.25, 0.5, 1, 2, 4):
        n = int(nbytes * scale)
        pair = (np.full(n, 1, np.uint8), np.full(n, 2, np.uint8))
        out.append((2 * n, _rate(2 * n, lambda: jax.block_until_ready([jax.device_put(a, on) for a in pair]),
                                 max_reps=10)))
        del pair
    return tuple(out)


def _threaded(device, nbytes: int, threads: int = 4) -> tuple[float, float]:
    """(numpy -> device, device -> numpy) bytes/s with `threads` threads each moving its own array at once."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    from jax.sharding import SingleDeviceSharding
    on = SingleDeviceSharding(device)
    hosts = [np.full(nbytes, i, np.uint8) for i in range(threads)]
    devs = [jax.device_put(h, on) for h in hosts]
    with ThreadPoolExecutor(threads) as pool:
        def each(fn, xs):
            return lambda: list(pool.map(fn, xs))
        up = _rate(threads * nbytes, each(lambda h: jax.device_put(h, on).block_until_ready(), hosts), max_reps=10)
        down = _rate(threads * nbytes, each(np.array, devs), max_reps=10)
    return up, down


def drop_cached(path: Path) -> None:
    """Drop a file's pages from the page cache, so that its next read is the disk's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _disk(folder: Path, nbytes: int) -> tuple[float, float]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".nfjax-hw-{os.getpid()}.npy"
    x = np.random.default_rng(1).integers(0, 255, nbytes, np.uint8)
    try:
        def write():
            with open(path, "wb") as f:
                np.save(f, x)
                f.flush()
                os.fsync(f.fileno())

        def read():
            drop_cached(path)
            np.load(path)
        w = _rate(nbytes, write, max_reps=5)          # (also leaves the file the reads read)
        return _rate(nbytes, read, max_reps=5), w
    finally:
        path.unlink(missing_ok=True)


def _cpu_attention(dtype) -> float:
    from nfjax.offload.cpu_attention import cpu_attention_bench
    return cpu_attention_bench(_rate, dtype)


def _cpu_split() -> dict:
    from nfjax.offload.cpu_attention import BENCH_BLOCK, THREADS, piece_count
    b, s, kh, d = BENCH_BLOCK
    return dict(cpu_threads=THREADS, cpu_attn_pieces=piece_count(b, s, kh * d * 2))


def _cpu_attention_saturated(dtype) -> float:
    from nfjax.offload.cpu_attention import THREADS, cpu_attention_bench
    return cpu_attention_bench(_rate, dtype, sequences=2 * THREADS)


def _cpu_attention_one(dtype) -> float:
    from nfjax.offload.cpu_attention import cpu_attention_bench
    return cpu_attention_bench(_rate, dtype, sequences=1)


def _tiny_model():
    from nfjax.config import ModelConfig
    from nfjax.models.random_init import random_model
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
                      qkv_bias=True, model_type="opt")
    return random_model(cfg, host=True)


def _dispatch(device) -> float:
    """Seconds of one call of the offload layer program on a tiny OPT layer (compute negligible)."""
    import jax
    import jax.numpy as jnp

    from nfjax.engine.step_programs import split_layers
    from nfjax.offload.compute import Programs
    m = _tiny_model()
    cfg = m.cfg
    rest_gd, _, layer_gd, stacked = split_layers(m)
    w = jax.device_put(jax.tree.map(lambda a: a[0], stacked), device)
    prog = Programs(cfg, rest_gd, layer_gd).layer[True]
    x = jax.device_put(jnp.zeros((2, 1, 64), jnp.float32), device)
    kv = jax.device_put((jnp.zeros((2, 32, 4, 16), jnp.float32),) * 2, device)
    pos = jax.device_put(jnp.zeros((2, 1), jnp.int32), device)
    return 1.0 / _rate(1.0, lambda: jax.block_until_ready(prog(w, x, kv, pos)), max_reps=100)


def _pass(dispatch_s: float) -> float:
    """Seconds of one decode pass's host work outside the layer programs (see the module's docstring)."""
    from nfjax.engine.sampling_params import SamplingParams
    from nfjax.offload.engine import OffloadEngine
    from nfjax.offload.policy import Policy
    from nfjax.tokenizer.silent import SilentTokenizer
    m = _tiny_model()
    with OffloadEngine.from_model(m, SilentTokenizer(m.cfg.vocab_size), Policy(), max_model_len=32) as eng:
        def run(n):
            return lambda: eng.generate([[1, 2, 3]], SamplingParams.greedy(max_tokens=n, ignore_eos=True))
        one, many = 1.0 / _rate(1.0, run(1), max_reps=5), 1.0 / _rate(1.0, run(9), max_reps=5)
    return max(0.0, (many - one) / 8 - dispatch_s)


def _transfer(device) -> float:
    """Seconds of one small transfer run on an I/O thread and waited for (the schedule's per-transfer cost)."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    from jax.sharding import SingleDeviceSharding
    on = SingleDeviceSharding(device)
    x = np.ones(256, np.float32)
    with ThreadPoolExecutor(1) as pool:
        return 1.0 / _rate(1.0, lambda: pool.submit(lambda: jax.device_put(x, on).block_until_ready()).result(),
                           max_reps=200)


def _cpu_attention_fixed() -> float:
    from nfjax.offload.cpu_attention import cpu_attention
    k = np.zeros((1, 16, 1, 16), np.float32)
    q = np.zeros((1, 1, 16), np.float32)
    pos = np.zeros((1, 1), np.int32)
    return 1.0 / _rate(1.0, lambda: cpu_attention(q, (k, k), pos, 0.25), max_reps=100)


def cache_path(device_kind: str, host: str | None = None) -> Path:
    from nfjax.checkpoint.models import cache_dir
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{device_kind}-{host or socket.gethostname()}")
    return cache_dir() / "hardware" / f"{key}.json"


def measure_now(device=None, dtype: str = "bfloat16", disk_dir: Path | None = None) -> HardwareProfile:
    """Measure every rate of this machine (a few seconds)."""
    import jax
    import jax.numpy as jnp
    device = device or jax.devices()[0]
    small = device.platform == "cpu"
    nbytes = (16 if small else 64) * 2 ** 20
    h2d, h2d_one, pinned, d2h, d2h_pinned = _transfers(device, nbytes)
    h2d_curve = _stage_curve(device, nbytes)
    h2d_par, d2h_par = _threaded(device, nbytes)
    from nfjax.offload.engine import default_offload_dir
    rd, wr = _disk(Path(disk_dir) if disk_dir else default_offload_dir(), nbytes)
    dispatch = _dispatch(device)
    gemm, curve = _gemm(device, jnp.dtype(dtype))
    return HardwareProfile(
        device_kind=str(device.device_kind), host=socket.gethostname(), gemm_flops=gemm, gemm_curve=curve,
        hbm_bytes=_hbm(device), h2d_bytes=h2d, h2d_one_bytes=h2d_one, h2d_pinned_bytes=pinned, d2h_bytes=d2h,
        h2d_threads_bytes=h2d_par, d2h_threads_bytes=d2h_par, d2h_pinned_bytes=d2h_pinned, h2d_curve=h2d_curve,
        disk_read_bytes=rd,
        disk_write_bytes=wr, cpu_attn_bytes=_cpu_attention(dtype), dispatch_s=dispatch, **_cpu_split(),
        cpu_attn_sat_bytes=_cpu_attention_saturated(dtype), cpu_attn_one_bytes=_cpu_attention_one(dtype),
        transfer_s=_transfer(device), cpu_attn_fixed_s=_cpu_attention_fixed(), pass_s=_pass(dispatch),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), version=PROFILE_VERSION)


def measure(device=None, dtype: str = "bfloat16", disk_dir: Path | None = None, remeasure: bool = False,
            log=None) -> HardwareProfile:
    """This machine's profile: the cached one (per device kind and host), else measured now and cached."""
    import jax
    device = device or jax.devices()[0]
    path = cache_path(str(device.device_kind))
    if not remeasure and path.is_file():
        try:
            prof = HardwareProfile.from_json(json.loads(path.read_text()))
            if prof.version >= PROFILE_VERSION:
                if log:
                    log(f"{prof.line()} [cached: {path}]")
                return prof
        except (json.JSONDecodeError, TypeError):
            pass                                    # a damaged cache (or an older version's): measure again
    prof = measure_now(device, dtype, disk_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(prof.to_json(), indent=2))
    tmp.replace(path)
    if log:
        log(f"{prof.line()} [measured; cached in {path}]")
    return prof
