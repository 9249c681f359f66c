"""Which `compute_on("gpu_stream:k")` regions XLA accepts, and whether they overlap (GPU only).

Each variant is one jitted program holding two pieces of work. It is compiled on its own: a variant that
XLA rejects records the error and the rest still run. For a variant that compiles, the table gives its
time next to the same two pieces run back to back in one program without streams. Overlap shows as
`seq / par` > 1. The variants differ in what the stream regions hold: a bare Pallas kernel, an XLA fusion,
our Mosaic GPU GEMM and decode attention (with their jnp wrappers), cuBLAS, a nested jit, and XLA command
buffers on or off.

    python -m bench.probes.stream_probe [--out DIR]
"""
from __future__ import annotations

import argparse
import time


def spin(x):
    """~3 ms of ALU work on x.shape[0] // 8 programs (a bare `pallas_call`)."""
    import jax
    from jax.experimental import pallas as pl
    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, 300_000, lambda i, v: v * 1.0001 + 0.5, x_ref[...])
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
                          in_specs=[spec], out_specs=spec)(x)


def build(args):
    """name -> (f(a, b) -> (ya, yb) with a on stream 1 and b on stream 2 when `streams`, args, options)."""
    import jax
    import jax.numpy as jnp
    from bench.step_bench import gemm_beside_attention
    from nfjax.compat import NO_COMMAND_BUFFERS, num_sms
    from pallas_kernels.persistent_gemm import persistent_gemm

    sms = num_sms()
    x, w, q, paged_attn = gemm_beside_attention(args.gemm, args.decode, args.ctx)
    pg = round(args.share * sms)
    pa = sms - pg
    small = jnp.ones((128, 128), jnp.float32)
    big = jax.random.normal(jax.random.key(6), (8192, 8192), jnp.float32)

    gemm = lambda x: persistent_gemm(x, w, num_ctas=pg)                      # noqa: E731
    attn = lambda q: paged_attn(q, pa)                                            # noqa: E731
    cublas = lambda x: jnp.dot(x, w)                                              # noqa: E731
    fusion = lambda a: jnp.sin(a) * 2.0 + 1.0                                    # noqa: E731
    nested = lambda x: jax.jit(lambda v: persistent_gemm(v, w, num_ctas=pg))(x)  # noqa: E731
    cb_off = dict(NO_COMMAND_BUFFERS)
    return {                                            # most telling first; command buffers off last
        "spin|spin": (spin, spin, (small, small), {}),
        "gemm|attn": (gemm, attn, (x, q), {}),
        "spin|attn": (spin, attn, (small, q), {}),
        "cublas|attn": (cublas, attn, (x, q), {}),
        "nested_gemm|attn": (nested, attn, (x, q), {}),
        "fusion|fusion": (fusion, fusion, (big, big), {}),
        "gemm|attn cb_off": (gemm, attn, (x, q), cb_off),
    }


def probe(fa, fb, a, b, options, streams: bool, iters: int):
    import jax
    from bench.common import time_fn
    from nfjax.experimental.streams import on_stream
    if streams:
        f = lambda a, b: (on_stream(fa, 1)(a), on_stream(fb, 2)(b))   # noqa: E731
    else:
        f = lambda a, b: (fa(a), fb(b))                                 # noqa: E731
    try:
        exe = jax.jit(f).lower(a, b).compile(options or None)
    except Exception as e:  # noqa: BLE001 - the point is to record which variants XLA rejects
        return {"ok": False, "error": str(e).splitlines()[0][:600]}
    text = exe.as_text() or ""
    t = time_fn(exe, a, b, iters=iters, reps=5)["median_s"] * 1e3
    return {"ok": True, "ms": t, "call_starts": text.count("call-start("),
            "annotated": text.count("_xla_stream_annotation")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", default="1024,4096,14336")
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=1280)
    ap.add_argument("--share", type=float, default=0.75, help="GEMM's share of the SMs")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.gemm = tuple(int(v) for v in args.gemm.split(","))
    from bench.common import print_table, write_results
    variants = build(args)
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
    rows, data = [], {}
    t0 = time.perf_counter()
    for name, (fa, fb, (a, b), opts) in variants.items():
        seq = probe(fa, fb, a, b, opts, False, args.iters)
        par = probe(fa, fb, a, b, opts, True, args.iters)
        data[name] = {"sequential": seq, "streams": par}
        gain = seq["ms"] / par["ms"] if seq.get("ok") and par.get("ok") else None
        data[name]["seq_over_par"] = gain
        rows.append([name, seq.get("ms"), par.get("ms") if par["ok"] else "REJECTED", gain,
                     par.get("call_starts"), (par.get("error") or "")[:90]])
        print(f"{time.perf_counter() - t0:6.1f}s", name, data[name], flush=True)
    print_table(["variant", "one stream ms", "two streams ms", "seq/par", "call-starts", "error"], rows)
    summary = {f"accepted[{k}]": v["streams"]["ok"] for k, v in data.items()}
    summary.update({f"seq_over_par[{k}]": v["seq_over_par"] for k, v in data.items() if v["seq_over_par"]})
    write_results("stream_probe", summary, {"args": vars(args), "variants": data}, out_dir=args.out)


if __name__ == "__main__":
    main()
