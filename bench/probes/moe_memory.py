"""#26 device probe: where the Mixtral-8x7B engine's device memory goes, step by step, and which allocation fails.

Run from the repository root (H200), same flags as bench.offline:
  python -m bench.probes.moe_memory --shape mixtral-8x7b                      # the default 0.9 that ran OOM
  python -m bench.probes.moe_memory --shape mixtral-8x7b --kv-memory-fraction 0.6
Prints the BFC pool (in use, largest free block) before/after the layer unstacking and the KV creation (each KV
array is waited on, so a failed allocation shows where it happens), every compiled program's scratch and unaliased
output (the largest), then runs the warm-up step by step, each program waited on, naming the one that fails.
CPU check: python -m bench.probes.moe_memory --shape mixtral-smoke
"""
import argparse
import time

import bench.setup as bs          # XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 before JAX starts, as bench.offline
import jax

GiB = 2 ** 30


def stats(tag):
    s = jax.devices()[0].memory_stats() or {}
    print(f"[{tag}] in use {s.get('bytes_in_use', 0) / GiB:.2f} GiB of {s.get('bytes_limit', 0) / GiB:.2f}; "
          f"largest free block {s.get('largest_free_block_bytes', 0) / GiB:.2f}; peak "
          f"{s.get('peak_bytes_in_use', 0) / GiB:.2f}; allocations {s.get('num_allocs', 0)}", flush=True)


def create(*a, **k):
    """KVCache.create with the pool's state around it, each array waited on (a failed allocation shows)."""
    stats("before KV create")
    kv = create.original(*a, **k)
    for name, arr in (("K", kv.k), ("V", kv.v)):
        try:
            arr.block_until_ready()
            print(f"KV {name}: {arr.nbytes / GiB:.2f} GiB allocated", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"KV {name}: {arr.nbytes / GiB:.2f} GiB FAILED: {str(e)[:400]}", flush=True)
    stats("after KV create")
    return kv


def unstack(*a, **k):
    """runner.unstack_layers with the pool's state around it."""
    stats("before unstacking the layer weights")
    out = unstack.original(*a, **k)
    jax.block_until_ready(out)
    stats("after unstacking")
    return out


class Waited:
    """A compiled program that is waited on after each call; a failure is printed with its name."""

    def __init__(self, name, prog):
        self.name, self.prog = name, prog

    def __call__(self, *a):
        try:
            out = self.prog(*a)
            jax.block_until_ready(out)
            return out
        except Exception as e:  # noqa: BLE001
            print(f"FAILED in {self.name}: {str(e)[:600]}", flush=True)
            stats(f"after the failure in {self.name}")
            raise

    def memory_analysis(self):
        return self.prog.memory_analysis()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bs.add_bench_args(p, shape="mixtral-8x7b")
    args = p.parse_args()
    import nfjax.engine.runner as rn
    from bench.setup import bench_engine
    from nfjax.engine import SamplingParams
    from nfjax.kv.cache import KVCache
    create.original, KVCache.create = KVCache.create, staticmethod(create)
    unstack.original, rn.unstack_layers = rn.unstack_layers, unstack

    t = time.perf_counter()
    engine = bench_engine(args, context=1536)
    r = engine.runner
    print(f"engine ready in {time.perf_counter() - t:.1f} s: {r.cache_cfg.num_pages} pages, one K array "
          f"{r.kv.k.nbytes / GiB:.2f} GiB, buckets {r.sched.token_buckets}, {r.max_seqs} sequences", flush=True)
    stats("after compile")
    tables = {"embed": r._embed, "head": r._head, "full_head": r._full_head, "layers": r._steps,
              "decode_layers": r._decode_steps, "stage": r._stage, "unpack": r._unpack}
    rows = []
    for tn, table in tables.items():
        for key in list(table):
            m = table[key].memory_analysis()
            rows.append((m.temp_size_in_bytes, m.output_size_in_bytes - m.alias_size_in_bytes, f"{tn}{key}"))
            table[key] = Waited(f"{tn}{key}", table[key])
    for temp, unaliased, name in sorted(rows, reverse=True)[:8]:
        print(f"  {name}: scratch {temp / GiB:.3f} GiB, unaliased output {unaliased / GiB:.3f} GiB", flush=True)
    print(f"  largest unaliased output: {max(rows, key=lambda x: x[1])[2]} {max(x[1] for x in rows) / GiB:.3f} GiB",
          flush=True)
    vocab = r.cfg.vocab_size
    n = min(1024, engine.max_model_len - 8)          # the smoke shape's context is 1024
    prompts = [[(7 * i + j) % (vocab - 3) + 3 for j in range(n)] for i in range(8)]
    t = time.perf_counter()
    try:
        engine.generate(prompts, SamplingParams.greedy(max_tokens=4, ignore_eos=True))
        print(f"warm-up of 8 x {n} prompts, 4 tokens each: ok in {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        stats("end")


if __name__ == "__main__":
    main()
