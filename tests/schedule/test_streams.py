"""EXPERIMENTAL stream regions (nfjax/experimental/streams.py), kept for the benchmarks that measure them:
regions hold primitives only (XLA 0.11.2 rejects a nested call inside one) and compute what the plain function
computes; an engine whose stream-naming variants run in regions gives the tokens of `sequential`, and the
annotations reach the HLO."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.config import EngineConfig, ExecutionConfig, ParallelConfig, StrategyConfig
from nfjax.engine import Engine
from nfjax.engine.runner import Runner
from nfjax.experimental.streams import inline_calls, on_stream, use_streams
from nfjax.models.random_init import random_model
from nfjax.tokenizer.byte import ByteTokenizer
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.persistent_gemm import persistent_gemm
from sched_common import CACHE, CFG, SCHED, TINY_PLAN, run

CALLS = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat"}


def messy(x, y):
    """Nested calls of every kind jnp code produces: jit(_pad), a user jit, custom_jvp (relu), checkpoint."""
    z = jnp.pad(x, ((0, 1), (0, 0)))
    z = jax.jit(lambda a: jax.nn.relu(a) + jax.nn.silu(a))(z)
    z = jax.checkpoint(lambda a: jnp.einsum("ij,jk->ik", a, y))(z)
    return z, jnp.clip(x, -1.0, 1.0).sum()


def test_inline_calls_leaves_primitives_and_same_values():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 4)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((4, 3)), jnp.float32)
    nested = {e.primitive.name for e in jax.make_jaxpr(messy)(x, y).jaxpr.eqns}
    assert nested & CALLS                                   # the test function really nests calls
    flat = jax.make_jaxpr(inline_calls(messy))(x, y).jaxpr
    assert not {e.primitive.name for e in flat.eqns} & CALLS
    for got, want in zip(jax.jit(inline_calls(messy))(x, y), messy(x, y)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_on_stream_region_keeps_closures_and_values():
    x = jnp.arange(20.0).reshape(5, 4)
    y = jnp.ones((4, 3))
    f = jax.jit(lambda x: on_stream(lambda a: messy(a, y), 1)(x))       # y is closed over
    region = [e for e in jax.make_jaxpr(f)(x).jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "compute_on"]
    assert len(region) == 1
    assert not {e.primitive.name for e in region[0].params["jaxpr"].eqns} & CALLS
    for got, want in zip(f(x), messy(x, y)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_kernels_on_two_streams_lower_for_cuda_without_nested_calls():
    """The R -> P pair (persistent GEMM on stream 1, decode attention on stream 2), cross-lowered for CUDA:
    the only annotated calls are the two regions (before inlining, each region also held an annotated
    `call @_pad`, which XLA rejects)."""
    sds = jax.ShapeDtypeStruct
    b, ps, kvh, d, h, pages = 8, 16, 2, 128, 8, 4        # group 4 is padded to 8 rows: a jnp.pad inside
    args = (sds((100, 256), jnp.bfloat16), sds((256, 384), jnp.bfloat16), sds((b, h, d), jnp.bfloat16),
            sds((1, b * pages + 1, ps, kvh, d), jnp.bfloat16), sds((b, pages), jnp.int32), sds((b,), jnp.int32))

    def pair(x, w, q, kc, pt, lens):
        gemm = on_stream(lambda x: persistent_gemm(x, w, num_ctas=88), 1)
        attn = on_stream(lambda q: paged_decode_attention(q, kc, kc, jnp.int32(0), pt, lens, scale=0.1,
                                                          num_ctas=44), 2)
        return gemm(x), attn(q)

    text = jax.jit(pair).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    annotated = re.findall(r'(?<!custom_)call @(\S+)\(.*_xla_stream_annotation = "(\d)"', text)
    assert sorted(s for _, s in annotated) == ["1", "2"], annotated
    assert text.count("@mosaic_gpu_v2(") == 2


STREAMED = (StrategyConfig("dual_batch"), StrategyConfig("nanoflow", plan=TINY_PLAN))    # both name stream 1


@pytest.fixture(scope="module")
def stream_engine():
    """TP=2 (regions inside the shard_map), the stream-naming variants compiled with regions."""
    compile_all = Runner.compile_all

    def with_streams(self, *a, **kw):
        assert use_streams(self) == sorted(s.label for s in STREAMED)
        return compile_all(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Runner, "compile_all", with_streams)
        return Engine(random_model(CFG, seed=1, std=0.2), ByteTokenizer(),
                      EngineConfig(CFG, CACHE, SCHED, parallel=ParallelConfig(2), execution=ExecutionConfig(STREAMED)))


def test_stream_regions_give_the_tokens_of_sequential(stream_engine):
    ref, _, _ = run(stream_engine, "sequential")
    for sc in STREAMED:
        got, steps, counts = run(stream_engine, sc.label)
        assert counts == {sc.label: len(steps)}
        assert got == ref, f"{sc.label} on streams differs from sequential"


def test_stream_regions_reach_the_hlo_without_command_buffers(stream_engine):
    """Ops recorded on stream k >= 1 carry XLA's stream annotation k; those variants compile without command
    buffers; cache writers and collectives (never recorded on a stream) and the plain variant stay unannotated."""
    r = stream_engine.runner
    hlo = r._steps[(64, "dual_batch:1-1")].as_text()
    assert re.search(r'_xla_stream_annotation="1"', hlo) and not re.search(r'_xla_stream_annotation="2"', hlo)
    assert "_xla_stream_annotation" not in r._steps[(64, "sequential")].as_text()
    v = r.variants.by_bucket[64]
    assert v["dual_batch:1-1"].compiler_options() == {"xla_gpu_dot_merger_threshold_mb": 0,
                                                     "xla_gpu_enable_command_buffer": ""}
    assert v["sequential"].compiler_options() == {}
