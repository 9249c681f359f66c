"""Probe: does Mosaic GPU lower kivi64's per-column dequantization (docs/design.md section 14.1, the risk its
kernel plan names)? One kernel: a group's [64, W] aux tile (row r: channel 64 g + r's scale and center) becomes
two [D] f32 column vectors through SMEM (per-row vectors by masked row sums, stored as [64] slices; loaded back in
the WGMMA column layout, `Layout.WGMMA.reduce(0)`), then one FMA a value of a [64, D] code tile.

    python -m bench.probes.kivi64_columns interpret     # CPU: against numpy
    python -m bench.probes.kivi64_columns lower         # cross-lowered for CUDA (no GPU needed)

CPU, 2026-11-25 (jax 0.10.2): interpret max error 0.0625 on values up to 18.9 (the bf16 output's half ulp);
CUDA lowering ok, and the same kernel with the row layout in place of the column one fails to lower (so the
lowering checks the layouts). Not run on a GPU: the numbers there are the next check.
"""
import functools
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from pallas_kernels._compat import mosaic_gpu_interpret_params
from pallas_kernels._mgpu import compiler_params

D, W = 128, 8
G = D // 64


def kernel(aux_hbm, codes_hbm, out_hbm, aux_s, codes_s, out_s, sc_s, ce_s, bar, *, interpret):
    plgpu.copy_gmem_to_smem(aux_hbm, aux_s, bar.at[0])
    plgpu.copy_gmem_to_smem(codes_hbm, codes_s, bar.at[1])
    plgpu.barrier_wait(bar.at[0])
    if interpret:
        a = aux_s[...].astype(jnp.float32)
        for g in range(G):
            sc_s[pl.ds(g * 64, 64)] = a[:, 2 * g]
            ce_s[pl.ds(g * 64, 64)] = a[:, 2 * g + 1]
    else:
        a = plgpu.load(aux_s, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        col = plgpu.broadcasted_iota(jnp.int32, a.shape, 1, layout=plgpu.Layout.WGMMA)
        for g in range(G):          # per-row vectors (row r = channel g*64 + r) stored as a [D] slice
            sc_s[pl.ds(g * 64, 64)] = jnp.where(col == 2 * g, a, 0.0).sum(axis=1)
            ce_s[pl.ds(g * 64, 64)] = jnp.where(col == 2 * g + 1, a, 0.0).sum(axis=1)
        plgpu.commit_smem()
    plgpu.barrier_wait(bar.at[1])
    if interpret:
        sc, ce, c = sc_s[...], ce_s[...], codes_s[...].astype(jnp.float32)
    else:
        col_l = plgpu.Layout.WGMMA.reduce(0)
        sc = plgpu.load(sc_s, (), layout=col_l)
        ce = plgpu.load(ce_s, (), layout=col_l)
        c = plgpu.load(codes_s, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    zp = ce - 7.5 * sc
    x = c * lax.broadcast_in_dim(sc, c.shape, [1]) + lax.broadcast_in_dim(zp, c.shape, [1])
    out_s[...] = x.astype(out_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_hbm)
    plgpu.wait_smem_to_gmem(0)


def run(aux, codes, interpret):
    tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    return plgpu.kernel(
        functools.partial(kernel, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((64, D), jnp.bfloat16),
        scratch_types=[plgpu.SMEM((64, W), jnp.bfloat16), plgpu.SMEM((64, D), jnp.bfloat16, transforms=tf),
                       plgpu.SMEM((64, D), jnp.bfloat16, transforms=tf), plgpu.SMEM((D,), jnp.float32),
                       plgpu.SMEM((D,), jnp.float32), plgpu.Barrier(num_barriers=2)],
        grid=(1,), grid_names=("p",), num_threads=1, thread_name="wg", compiler_params=compiler_params(),
        interpret=mosaic_gpu_interpret_params() if interpret else None)(aux, codes)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    aux = jnp.asarray(rng.standard_normal((64, W)), jnp.bfloat16)
    codes = jnp.asarray(rng.integers(0, 16, (64, D)), jnp.bfloat16)
    a = np.asarray(aux, np.float32)
    sc = np.concatenate([a[:, 2 * g] for g in range(G)])
    ce = np.concatenate([a[:, 2 * g + 1] for g in range(G)])
    ref = (np.asarray(codes, np.float32) - 7.5) * sc[None] + ce[None]
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="interpret", choices=("interpret", "lower"))
    mode = ap.parse_args().mode
    if mode == "interpret":
        out = np.asarray(run(aux, codes, True), np.float32)
        print("interpret max err", np.abs(out - ref).max(), "of", np.abs(ref).max())
    else:
        sds = jax.ShapeDtypeStruct
        jax.jit(functools.partial(run, interpret=False)).trace(sds((64, W), jnp.bfloat16), sds((64, D), jnp.bfloat16)
                                                               ).lower(lowering_platforms=("cuda",))
        print("cuda lowering: ok")
