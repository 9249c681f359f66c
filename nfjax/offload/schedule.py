"""The zig-zag block schedule (FlexGen Alg. 1) and the row-by-row baseline, over the per-layer programs.

One pass runs every decoder layer over every GPU batch of a block for one step (the prefill, or one generated
token). Zig-zag: for each layer j, for each GPU batch k:
    load layer j+1's weights (once per layer, at k = 0) and batch k+1's KV cache and activations,
    compute (j, k), store batch k's KV rows and activations (they finish while k+1 computes), synchronize.
Loads and stores run on a pool of I/O threads (disk reads, host<->device copies); compute is dispatched
asynchronously to the device, so each transfer overlaps the computations around it. The synchronization waits
for (j, k-1)'s computation, so the host runs at most one computation ahead and at most three layers of
weights are on the device at once. The last layer's computations also cover the load of layer 0's weights for
the next pass (weights do not change between passes). A load of a KV block or of activations first waits for the store that
wrote it.

Row-by-row (the baseline of Accelerate / DeepSpeed offloading): for each GPU batch, for each layer: load the
layer's weights, then its KV, compute, store, each waiting for the one before; nothing overlaps.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from nfjax.offload.cpu_attention import cpu_attention

from nfjax.offload.policy import Policy
from nfjax.offload.store import PINNED_STORE_BYTES, Tiers, WeightStore, check_interrupt, index_tiers, kv_tiers
from pallas_kernels import kv_quant


def _done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def kv_arrays(policy: Policy, shape: tuple, dtype) -> list[tuple[tuple, object]]:
    """(shape, dtype) of each array of one KV block [B, S, KH, D]: K and V, or under `compress_cache` the int4
    codes of K and V and their scale/center rows (pallas_kernels/kv_quant.py)."""
    if not policy.compress_cache:
        return [(shape, dtype)] * 2
    *lead, d = shape
    return [((*lead, d // 2), np.uint8)] * 2 + [((*lead, kv_quant.aux_width("int4", d)), kv_quant.AUX_DTYPE)]


class KVStore:
    """The KV cache of a block: (layer j, batch k) -> its arrays (`kv_arrays`), in the tier the policy puts it."""

    def __init__(self, policy: Policy, tiers: Tiers, num_layers: int, shape: tuple, dtype):
        nb = policy.num_gpu_batches
        self.nb, self.tiers = nb, tiers
        self.where = kv_tiers(num_layers, nb, policy.cache)
        self.blocks: dict[tuple[int, int], tuple] = {}     # numpy (views of pinned arrays), device or memmap
        self.pinned: dict[tuple[int, int], tuple] = {}     # host blocks' pinned JAX arrays, loaded by DMA
        self.pending: dict = {}            # (j, k) -> the store of its newest rows (an I/O thread's future)
        specs = kv_arrays(policy, shape, dtype)
        for j in range(num_layers):
            for k in range(nb):
                t = self.tier(j, k)
                if t == "gpu":
                    self.blocks[(j, k)] = tuple(jax.device_put(np.zeros(s, d), tiers.on_device) for s, d in specs)
                elif t == "cpu":
                    pinned, self.blocks[(j, k)] = zip(*(tiers.host_block(s, d) for s, d in specs))
                    if pinned[0] is not None:
                        self.pinned[(j, k)] = pinned
                else:
                    self.blocks[(j, k)] = tuple(tiers.disk.memmap(f"kv{j}-{k}-{n}", s, d)
                                                for n, (s, d) in enumerate(specs))

    def tier(self, j: int, k: int) -> str:
        return self.where[j * self.nb + k]

    def load(self, j: int, k: int) -> tuple:
        arrays = self.blocks[(j, k)]
        if self.tier(j, k) == "gpu":
            return arrays
        if self.tier(j, k) == "disk":         # read the file now, here (a device array must not alias the map)
            arrays = tuple(np.array(a) for a in arrays)
        arrays = self.pinned.get((j, k), arrays)
        out = tuple(self.tiers.to_device(a) for a in arrays)
        jax.block_until_ready(out)
        return out

    def host(self, j: int, k: int) -> tuple:
        """The block's host arrays (numpy, or memory-mapped for the disk tier), for attention on the CPU."""
        return self.blocks[(j, k)]

    def keep(self, j: int, k: int, arrays) -> None:
        self.blocks[(j, k)] = tuple(arrays)

    def store_rows(self, j: int, k: int, rows, positions: np.ndarray) -> None:
        """The rows a computation wrote (at `positions` [B, T]) into the host or disk copy."""
        idx = (np.arange(positions.shape[0])[:, None], positions)
        if self.tiers.pinned and sum(r.nbytes for r in rows) >= PINNED_STORE_BYTES:
            rows = jax.device_put(tuple(rows), self.tiers.host_sharding)
        for buf, r in zip(self.blocks[(j, k)], rows):
            buf[idx] = np.asarray(r)

    def close(self) -> None:
        for key, arrays in self.pinned.items():
            self.tiers.give_back(zip(arrays, self.blocks[key]))
        self.blocks.clear()
        self.pinned.clear()


class ActStore:
    """Each GPU batch's activations (the residual stream between layers) in the tier the policy puts it."""

    def __init__(self, policy: Policy, tiers: Tiers):
        self.tiers = tiers
        self.where = index_tiers(policy.num_gpu_batches, policy.activations)
        self.vals: dict[int, object] = {}

    def store(self, k: int, x) -> None:
        t = self.where[k]
        if t == "gpu":
            self.vals[k] = x
        elif t == "cpu":
            self.vals[k] = np.asarray(x)
        else:
            self.vals[k] = self.tiers.disk.save(f"act{k}", np.asarray(x))

    def load(self, k: int):
        v = self.vals[k]
        if self.where[k] == "gpu":
            return v
        out = self.tiers.to_device(v.read() if self.where[k] == "disk" else v)
        return out.block_until_ready()


class Executor:
    """Runs passes of the layers over a block under the policy's schedule."""

    def __init__(self, policy: Policy, programs, weights: WeightStore, trace=None):
        self.policy, self.programs, self.weights, self.trace = policy, programs, weights, trace
        self.pool = ThreadPoolExecutor(policy.io_threads, thread_name_prefix="nfjax-offload-io")
        # attention on the CPU: one thread, so a block's row writes and reads keep their order
        self.cpu = ThreadPoolExecutor(1, thread_name_prefix="nfjax-offload-cpu")
        self.num_layers = len(weights.layers)
        self._next_w0: Future | None = None
        self._inflight: set[Future] = set()
        self._zero_rows: dict = {}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.cpu.shutdown(wait=True, cancel_futures=True)

    def drain(self) -> None:
        """Wait for every transfer in flight (their errors are not raised here): a block's end, or an interrupted
        pass, leaves no thread writing into buffers about to be freed or reading files about to be removed."""
        for f in list(self._inflight):
            try:
                f.result()
            except BaseException:        # noqa: BLE001 - the pass that needed it has raised already
                pass

    # ---- task helpers -----------------------------------------------------------------------------------------
    def _io(self, lane: str, label: str, fn, *args) -> Future:
        if self.trace is None:
            f = self.pool.submit(fn, *args)
        else:
            f = self.pool.submit(self.trace.timed, lane, label, fn, *args)
        self._inflight.add(f)
        f.add_done_callback(self._inflight.discard)
        return f

    def _after(self, dep: Future | None, lane: str, label: str, fn, *args) -> Future:
        """`fn(*args)` on an I/O thread once `dep` has finished (a store must land before its data is read)."""
        def run():
            if dep is not None:
                dep.result()
            return fn(*args)
        return self._io(lane, label, run)

    def _compute(self, j: int, k: int, w, x, kv_tier: str, kvs, positions):
        out = self.programs.layer[kv_tier != "gpu"](w, x, tuple(kvs), positions)
        if self.trace is not None:
            self.trace.computed(f"L{j} B{k}", out)
        return out

    def _delegated(self, xs: list) -> bool:
        """Attention of CPU-held blocks on the CPU: a decode pass (one token a sequence) under cpu_attention."""
        return self.policy.cpu_attention and xs[0].shape[1] == 1

    def _cpu_attention_start(self, j: int, k: int, w, x, kv, positions, pos_np) -> tuple:
        """(j, k)'s first program, and its attention started on the CPU thread (nfjax/offload/cpu_attention.py):
        q and the new K/V rows come down, the rows go into the host block, the CPU attends over it, the output goes
        up. Returns (what the second program needs, the output's future)."""
        b, t = pos_np.shape
        block = kv.host(j, k)
        if (b, t) not in self._zero_rows:
            self._zero_rows[(b, t)] = tuple(jax.device_put(np.zeros((b, t, *a.shape[2:]), a.dtype),
                                                           self.weights.tiers.on_device) for a in block)
        q, rows, carry = self.programs.pre_attention(w, x, self._zero_rows[(b, t)], positions)
        if self.trace is not None:
            self.trace.computed(f"L{j} B{k} pre", q)
        cfg = self.programs.cfg

        def attend():
            kv.store_rows(j, k, rows, pos_np)
            attn = cpu_attention(q, block, pos_np, cfg.head_dim ** -0.5, self.programs.topk)
            return self.weights.tiers.to_device(attn.reshape(b, t, -1))
        f = self.cpu.submit(attend if self.trace is None else
                            lambda: self.trace.timed("cpu attention", f"L{j} B{k}", attend))
        self._inflight.add(f)
        f.add_done_callback(self._inflight.discard)
        return carry, f

    def _cpu_attention_finish(self, j: int, k: int, w, carry, attn: Future):
        """(j, k)'s second program, on the attention output: the layer's out. The host block is up to date."""
        out = self.programs.post_attention(w, carry, attn.result())
        if self.trace is not None:
            self.trace.computed(f"L{j} B{k} post", out)
        return out

    def _compute_cpu_attention(self, j: int, k: int, w, x, kv, positions, pos_np):
        """(j, k) with its attention on the CPU, in series: the layer's out."""
        return self._cpu_attention_finish(j, k, w, *self._cpu_attention_start(j, k, w, x, kv, positions, pos_np))

    # ---- passes -----------------------------------------------------------------------------------------------
    def run(self, xs: list, positions: list, pos_np: list, kv: KVStore) -> list:
        """One pass over all layers for every GPU batch: `xs[k]` [B, T, D] in, the last layer's out (device)."""
        if self.policy.schedule == "row_by_row":
            return self._row_by_row(xs, positions, pos_np, kv)
        return self._zigzag(xs, positions, pos_np, kv)

    def _zigzag(self, xs, positions, pos_np, kv: KVStore) -> list:
        L, nb = self.num_layers, len(xs)
        delegate = self._delegated(xs)
        acts = ActStore(self.policy, self.weights.tiers)
        act_stored = {k: self._io("store act", f"B{k}", acts.store, k, xs[k]) if acts.where[k] != "gpu"
                      else _done(acts.store(k, xs[k])) for k in range(nb)}
        kv_stored = kv.pending                 # (j, k) -> the previous pass's store of its rows, still landing
        order = [(j, k) for j in range(L) for k in range(nb)]

        def load_w(j):
            return _done(self.weights.fetch(j)) if self.weights.resident(j) else \
                self._io("load weights", f"L{j}", self.weights.fetch, j)

        def load_kv(j, k):
            if kv.tier(j, k) == "gpu":
                return _done(kv.load(j, k))
            if delegate:                                 # nothing moves; the previous pass's rows must have landed
                return self._after(kv_stored.pop((j, k), None), "load cache", f"L{j} B{k} (host)", kv.host, j, k)
            return self._after(kv_stored.pop((j, k), None), "load cache", f"L{j} B{k}", kv.load, j, k)

        def load_act(j, k):          # after the store of (j-1, k)'s output
            return None if acts.where[k] == "gpu" else \
                self._after(act_stored[k], "load act", f"L{j} B{k}", acts.load, k)

        # layer 0's weights were loaded during the previous pass's last layer (they never change between passes)
        wf = {0: self._next_w0 or load_w(0)}
        self._next_w0 = None
        kv_next, act_next = {order[0]: load_kv(*order[0])}, {order[0]: load_act(*order[0])}
        final: list = [None] * nb
        prev_out = None
        # with 2+ batches a CPU-attended (j, k) finishes during the next step: the device runs that step's first
        # program while the CPU attends (k's activations are next read nb steps on); one batch: in series
        lag = delegate and nb > 1
        pending = None

        def finish(j, k, out):
            nonlocal prev_out
            if j == L - 1:
                final[k] = out
            elif acts.where[k] == "gpu":
                acts.store(k, out)
            else:
                act_stored[k] = self._io("store act", f"L{j} B{k}", acts.store, k, out)
            if prev_out is not None:
                jax.block_until_ready(prev_out)              # synchronize: the step before has finished
            prev_out = out

        for idx, (j, k) in enumerate(order):
            if k == 0:                                       # layer j+1's weights while layer j computes
                if j + 1 < L:
                    wf[j + 1] = load_w(j + 1)
                elif not self.weights.resident(0):
                    self._next_w0 = load_w(0)                # the next pass's first layer
            nxt = order[idx + 1] if idx + 1 < len(order) else None
            if nxt is not None:
                kv_next[nxt] = load_kv(*nxt)                 # batch k+1's KV while (j, k) computes
            check_interrupt()
            if k == 0:
                w = wf[j].result()
                if self.weights.any_packed:               # once for the layer's batches
                    w = self.programs.decompress(w)
                    if self.trace is not None:
                        self.trace.computed(f"L{j} unpack", w)
            af = act_next.pop((j, k))
            x = acts.vals[k] if af is None else af.result()
            kvs = kv_next.pop((j, k)).result()
            started = None
            if delegate and kv.tier(j, k) != "gpu":       # its rows go into the host block on the CPU thread
                started = (j, k, w, *self._cpu_attention_start(j, k, w, x, kv, positions[k], pos_np[k]))
            else:
                out, cache = self._compute(j, k, w, x, kv.tier(j, k), kvs, positions[k])
                if kv.tier(j, k) == "gpu":
                    kv.keep(j, k, cache)
                else:
                    kv_stored[(j, k)] = self._io("store cache", f"L{j} B{k}", kv.store_rows, j, k, cache,
                                                 pos_np[k])
            if pending is not None:                          # the step before, attended on the CPU meanwhile
                finish(pending[0], pending[1], self._cpu_attention_finish(*pending))
                pending = None
            if started is None:
                finish(j, k, out)
            elif lag:
                pending = started
            else:
                finish(j, k, self._cpu_attention_finish(*started))
            if nxt is not None:
                act_next[nxt] = load_act(*nxt)               # batch k+1's activations (stored earlier)
            if k == nb - 1:
                wf.pop(j, None)
        if pending is not None:
            finish(pending[0], pending[1], self._cpu_attention_finish(*pending))
        return final

    def _row_by_row(self, xs, positions, pos_np, kv: KVStore) -> list:
        outs = []
        delegate = self._delegated(xs)
        for k, x in enumerate(xs):
            for j in range(self.num_layers):
                check_interrupt()
                w = self.weights.fetch(j) if self.trace is None else \
                    self.trace.timed("load weights", f"L{j}", self.weights.fetch, j)
                if delegate and kv.tier(j, k) != "gpu":
                    x = self._compute_cpu_attention(j, k, w, x, kv, positions[k], pos_np[k])
                    jax.block_until_ready(x)
                    continue
                kvs = kv.load(j, k) if self.trace is None else \
                    self.trace.timed("load cache", f"L{j} B{k}", kv.load, j, k)
                x, cache = self._compute(j, k, w, x, kv.tier(j, k), kvs, positions[k])
                jax.block_until_ready(x)
                if kv.tier(j, k) == "gpu":
                    kv.keep(j, k, cache)
                elif self.trace is None:
                    kv.store_rows(j, k, cache, pos_np[k])
                else:
                    self.trace.timed("store cache", f"L{j} B{k}", kv.store_rows, j, k, cache, pos_np[k])
            outs.append(x)
        return outs
