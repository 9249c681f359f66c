"""Decode-sized GEMMs (M = 16..256 rows against Llama-3-8B's weights): their weight-read rate under XLA's
GEMM choices, beside the device's read and copy rates, and the MLP block with gate and up as one GEMM or two.

Why: at batch 1 an 8B decode step spends 5.51 of its 6.47 ms in GEMMs reading 15 GB (2.72 TB/s), the head
alone at 3.1 TB/s while gate/up/down run at 2.76 and qkv/o at 2.4-2.5 (`profile_step-ctx256-20261127.json`).
If every GEMM read at the head's rate the step would lose ~0.5 ms: the difference between TPOT 6.3 and 6.0 ms.

Each variant is a child process with its own `XLA_FLAGS` (flags are read once a process): `default`,
`exhaustive` (the Triton GEMM autotuner's exhaustive tiling search), `cublas` (no Triton GEMMs), `merger`
(XLA's dot merger joins dots of one input up to 1 GB of weights, 32 MB by default). Weights rotate
over enough copies to exceed L2; inputs are random normal bf16.

Split K (`<name>_splitk<S>` rows, for the weights with N <= 6144: qkv, o, down): the weight read as S slices
of K/S rows each (a free reshape of the (K, N) array), one batched GEMM over the slices in f32, then a sum over
them. The question (bench/NOTES.md 24.2): o's 32 output tiles of 128 columns leave most of an H100's 132 SMs idle
at decode sizes (1.8-2.0 TB/s); S slices give the GEMM S times the tiles. `splitk_of` is the product form.

Split K through our grouped GEMM (`<name>_gsplit<S>` rows, GPU only, first variant; `--gsplits`): the S K slices
as S groups of one grouped GEMM (64-row tiles), the partials summed in f32; 30.3 of bench/NOTES.md found our dense
kernel, which does not split K, at 1.4-1.7 TB/s on o and down.

Our persistent Pallas GEMM (`<name>_pgemm[<config>]` rows, GPU only, in the first variant's process: XLA's flags
do not touch it), per tile config of `--pgemm-configs`: whether the decode-sized GEMMs reach the weight-read rate
where XLA's do not (gate_up at 256 rows: 104 us against 60 at 128, bench/NOTES.md 24.2 and 29.7).

usage: python -m bench.probes.skinny_gemm [--tokens 16,64,128,256] [--variants default,exhaustive,cublas]
                                          [--pgemm-configs 128x128_s5_ws,64x256_s5_ws_n] [--gsplits 2,4]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import threading

from bench.common import module_command, print_table, write_results
from bench.step_bench import kernel_us

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate": (4096, 14336), "gate_up": (4096, 28672),
          "down": (14336, 4096), "head": (4096, 128256)}
VARIANTS = {"default": "", "exhaustive": "--xla_gpu_exhaustive_tiling_search=true",
            "cublas": "--xla_gpu_enable_triton_gemm=false", "merger": "--xla_gpu_dot_merger_threshold_mb=1024"}
TAG = "@@"


def _sets(shapes: list[tuple], seed: int, min_bytes: float = 200e6):
    """Rotated argument sets whose weights together exceed L2 (50 MB on an H100) several times."""
    import jax
    import jax.numpy as jnp
    per = sum(math.prod(s) * 2 for s in shapes)
    count = max(2, min(8, math.ceil(min_bytes / per)))
    key = jax.random.key(seed)
    out = []
    for i in range(count):
        ks = jax.random.split(jax.random.fold_in(key, i), len(shapes))
        out.append(tuple(jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(ks, shapes)))
    return out


SPLITS = (2, 4, 8)


def splitk_of(x, w, s: int):
    """x @ w with K split into `s` slices: one batched GEMM over the slices, summed in f32."""
    import jax.numpy as jnp
    m, k = x.shape
    xs = x.reshape(m, s, k // s).transpose(1, 0, 2)                        # (s, m, k/s): a small copy
    part = jnp.einsum("smk,skn->smn", xs, w.reshape(s, k // s, w.shape[1]), preferred_element_type=jnp.float32)
    return part.sum(0).astype(x.dtype)


def emit(key: str, value) -> None:
    print(TAG + json.dumps({key: value}), flush=True)


PGEMM_SHAPES = ("gate_up", "gate", "down", "qkv", "o")
PGEMM_CONFIGS = ("128x128_s5_ws", "64x256_s5_ws_n", "128x256_s4_ws")      # --pgemm-configs' default


GSPLIT_CONFIG = "64x256_s5_ws_n"        # 64-row tiles: each K slice's rows pad to 64, not 128
GSPLIT_SHAPES = ("qkv", "o", "down")      # N <= 6144: few output tiles for 132 SMs


def grouped_splitk(x, w, s: int, config: str = GSPLIT_CONFIG, interpret: bool = False):
    """x @ w with K split `s` ways as one grouped GEMM (pallas_kernels/grouped_gemm.py): group i is x's K slice i
    (its rows padded to the tile's) against w's K slice i (a free reshape), so s times the output tiles share the
    SMs; the s partials (x's dtype) are summed in f32."""
    import jax.numpy as jnp
    from pallas_kernels.grouped_gemm import group_alignment, grouped_gemm
    m, k = x.shape
    a = group_alignment(config)
    mp = -(-m // a) * a
    xs = jnp.pad(x.reshape(m, s, k // s).transpose(1, 0, 2), ((0, 0), (0, mp - m), (0, 0))).reshape(s * mp, k // s)
    y = grouped_gemm(xs, w.reshape(s, k // s, w.shape[1]), jnp.full((s,), mp, jnp.int32), config=config,
                     interpret=interpret)
    return y.reshape(s, mp, -1)[:, :m].astype(jnp.float32).sum(0).astype(x.dtype)


def our_rows(shapes: tuple[str, ...], tokens: list[int], gemms: dict, seed: int, key0: int) -> None:
    """Rows `<name>_<label>@<m>` of our kernels at the decode sizes, one per `gemms` label -> gemm(x, w): kernel time,
    read rate and error against an f32 product (`seed`: the weights', `key0`: the inputs' first key). A label that
    does not fit a shape gets a row saying so."""
    import jax
    import jax.numpy as jnp
    for name in shapes:
        k, n = SHAPES[name]
        ws = [w for (w,) in _sets([(k, n)], seed)]
        for m in tokens:
            xs = [jax.random.normal(jax.random.key(m + key0 + i), (m, k), jnp.bfloat16) for i in range(len(ws))]
            ref = jnp.dot(xs[0].astype(jnp.float32), ws[0].astype(jnp.float32))
            for label, gemm in gemms.items():
                fn = jax.jit(lambda xs, ws, gemm=gemm: [gemm(x, w) for x, w in zip(xs, ws)])
                try:
                    got = fn(xs, ws)[0].astype(jnp.float32)
                    err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                    us = kernel_us(fn, (xs, ws), len(ws))
                except Exception as e:  # noqa: BLE001 - a config or split that does not fit this shape
                    emit(f"{name}_{label}@{m}", {"error": f"{type(e).__name__}: {str(e)[:160]}"})
                    continue
                emit(f"{name}_{label}@{m}", {"us": us, "tbps": 2 * k * n / us / 1e6, "rel_err": err})
        del ws


def gsplit_rows(tokens: list[int], splits: list[int]) -> None:
    """Split K through our grouped GEMM at the decode sizes (see `grouped_splitk`): where XLA's GEMMs for o, qkv
    and down read at 1.8-2.4 TB/s past 16 rows (bench/NOTES.md 30.3)."""
    our_rows(GSPLIT_SHAPES, tokens, {f"gsplit{sp}": functools.partial(grouped_splitk, s=sp) for sp in splits}, 6, 13)


def pgemm_rows(tokens: list[int], configs: list[str]) -> None:
    """The persistent Pallas GEMM at the decode sizes, per tile config (see the module doc)."""
    from pallas_kernels.persistent_gemm import persistent_gemm
    our_rows(PGEMM_SHAPES, tokens, {f"pgemm[{c}]": functools.partial(persistent_gemm, config=c) for c in configs},
             5, 11)


def child(tokens: list[int], pgemm_configs: list[str], gsplits: list[int]) -> None:
    import jax
    import jax.numpy as jnp
    from bench.common import measure_copy_bandwidth, time_fn
    emit("copy_tbps", measure_copy_bandwidth(1 << 30)["bytes_per_s"] / 1e12)
    big = _sets([(1 << 29,)], 1, 0)            # 1 GiB of bf16, read once a call
    red = jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32))
    emit("read_tbps", 2 * (1 << 29) / time_fn(red, arg_sets=big)["median_s"] / 1e12)
    del big

    def dots(xs, ws):      # a different x for each weight: XLA's dot merger would join dots of one operand
        return [jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype) for x, w in zip(xs, ws)]

    many = jax.jit(dots)
    for name, (k, n) in SHAPES.items():
        ws = [w for (w,) in _sets([(k, n)], 2)]
        for m in tokens:
            xs = [jax.random.normal(jax.random.key(m + i), (m, k), jnp.bfloat16) for i in range(len(ws))]
            ref = jnp.dot(xs[0].astype(jnp.float32), ws[0].astype(jnp.float32))
            err = float(jnp.linalg.norm(many(xs, ws)[0].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            us = kernel_us(many, (xs, ws), len(ws))
            emit(f"{name}@{m}", {"us": us, "tbps": 2 * k * n / us / 1e6, "rel_err": err})
            if n > 6144:
                continue
            for sp in SPLITS:
                split = jax.jit(lambda xs, ws, sp=sp: [splitk_of(x, w, sp) for x, w in zip(xs, ws)])
                got = split(xs, ws)[0].astype(jnp.float32)
                err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                us = kernel_us(split, (xs, ws), len(ws))
                emit(f"{name}_splitk{sp}@{m}", {"us": us, "tbps": 2 * k * n / us / 1e6, "rel_err": err})
        del ws

    # q, k and v as the engine holds them: three weights of one input (XLA's dot merger may join them)
    qkv3 = _sets([(4096, 4096), (4096, 1024), (4096, 1024)], 4)
    three = jax.jit(lambda xs, sets: [[jnp.dot(x, w) for w in s] for x, s in zip(xs, sets)])
    for m in tokens:
        xs = [jax.random.normal(jax.random.key(m + 3 + i), (m, 4096), jnp.bfloat16) for i in range(len(qkv3))]
        us = kernel_us(three, (xs, qkv3), len(qkv3))
        emit(f"qkv_three@{m}", {"us": us, "tbps": 2 * 4096 * 6144 / us / 1e6, "rel_err": 0.0})
    del qkv3

    def norm(x, g):
        v = x.astype(jnp.float32)
        return (v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-5) * g).astype(x.dtype)

    def mlp_two(x, g, wg, wu, wd):
        h = norm(x, g)
        a = jax.nn.silu(jnp.dot(h, wg).astype(jnp.float32)).astype(x.dtype) * jnp.dot(h, wu)
        return x + jnp.dot(a, wd)

    def mlp_one(x, g, wgu, wd):
        h = norm(x, g)
        gu = jnp.dot(h, wgu)
        n = wd.shape[0]
        a = jax.nn.silu(gu[:, :n].astype(jnp.float32)).astype(x.dtype) * gu[:, n:]
        return x + jnp.dot(a, wd)

    d, f = 4096, 14336
    two = _sets([(d, f), (d, f), (f, d)], 3)
    one = [(jnp.concatenate([a, b], 1), c) for a, b, c in two]
    g = jnp.ones((d,), jnp.bfloat16)
    run_two = jax.jit(lambda xs, sets: [mlp_two(x, g, *s) for x, s in zip(xs, sets)])
    run_one = jax.jit(lambda xs, sets: [mlp_one(x, g, *s) for x, s in zip(xs, sets)])
    for m in tokens:
        xs = [jax.random.normal(jax.random.key(m + 7 + i), (m, d), jnp.bfloat16) for i in range(len(two))]
        t2 = kernel_us(run_two, (xs, two), len(two))
        t1 = kernel_us(run_one, (xs, one), len(one))
        y2 = run_two(xs, two)[0].astype(jnp.float32)
        y1 = run_one(xs, one)[0].astype(jnp.float32)
        same = float(jnp.linalg.norm(y2 - y1) / jnp.linalg.norm(y2))
        emit(f"mlp@{m}", {"two_us": t2, "one_us": t1, "bytes_tbps_one": 6 * d * f / t1 / 1e6, "rel_diff": same})
    del two, one
    if jax.default_backend() == "gpu":        # on a CPU our kernels only run interpreted
        if gsplits:
            gsplit_rows(tokens, gsplits)
        if pgemm_configs:
            pgemm_rows(tokens, pgemm_configs)


def run_variant(v: str, env: dict, tokens: str, timeout_s: float, pgemm_configs: str = "", gsplits: str = "") -> dict:
    """The child's rows, printed as they arrive; a child past `timeout_s` is killed and its rows kept."""
    proc = subprocess.Popen(module_command("bench.probes.skinny_gemm", "--child", "--tokens", tokens,
                                           "--pgemm-configs", pgemm_configs, "--gsplits", gsplits), env=env,
                            stdout=subprocess.PIPE, text=True)      # its errors reach our stderr
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    rows = {}
    for line in proc.stdout:
        if line.startswith(TAG):
            rows.update(json.loads(line[len(TAG):]))
            print(v, line[len(TAG):].strip(), flush=True)
    proc.wait()
    timer.cancel()
    if proc.returncode:
        print(f"variant {v}: child ended with rc {proc.returncode} after {len(rows)} rows", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,64,128,256")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant-timeout-s", type=float, default=150.0, help="a variant's rows so far are kept")
    p.add_argument("--pgemm-configs", default=",".join(PGEMM_CONFIGS),
                   help="persistent-GEMM tile configs to time (GPU; '' for none)")
    p.add_argument("--gsplits", default="2,4", help="K splits through our grouped GEMM to time (GPU; '' for none)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--name", default="skinny_gemm")
    a = p.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    configs = [c for c in a.pgemm_configs.split(",") if c]
    gsplits = [int(x) for x in a.gsplits.split(",") if x]
    if a.child:
        child(tokens, configs, gsplits)
        return 0
    from pallas_kernels.persistent_gemm import TILE_CONFIGS
    bad = [c for c in configs if c not in TILE_CONFIGS]
    if bad:
        p.error(f"--pgemm-configs: unknown {bad[0]!r}; one of {', '.join(TILE_CONFIGS)}")
    results = {}
    for i, v in enumerate(a.variants.split(",")):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + VARIANTS[v]).strip()
        results[v] = run_variant(v, env, a.tokens, a.variant_timeout_s, a.pgemm_configs if i == 0 else "",
                                 a.gsplits if i == 0 else "")
    table, summary = [], {}
    for v, rows in results.items():
        for key in ("copy_tbps", "read_tbps"):
            if key in rows:
                summary[f"{key}_{v}"] = round(rows[key], 3)
        for key, r in rows.items():
            if isinstance(r, dict) and "error" in r:
                table.append([v, key, None, None, r["error"]])
            elif isinstance(r, dict) and "tbps" in r:
                table.append([v, key, r["us"], r["tbps"], r["rel_err"]])
                summary[f"tbps[{v},{key}]"] = round(r["tbps"], 3)
            elif isinstance(r, dict):
                table.append([v, key, r["two_us"], r["one_us"], r["rel_diff"]])
                summary[f"mlp_us[{v},{key},two]"] = round(r["two_us"], 2)
                summary[f"mlp_us[{v},{key},one]"] = round(r["one_us"], 2)
    print_table(["variant", "case", "us (mlp: two GEMMs)", "TB/s (mlp: one GEMM us)", "rel err / diff"], table)
    for v, rows in results.items():
        print(f"{v}: copy {rows.get('copy_tbps', 0):.3f} TB/s (read+write), read {rows.get('read_tbps', 0):.3f} TB/s")
    write_results(a.name, summary, {"results": results, "variants": {v: VARIANTS[v] for v in results}})
    return 0 if any(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
