"""The profiler's measurements: copies of an op in one program stay separate computations (XLA merges identical
ones: a device run timed 8 GEMM copies as one), an op that writes the cache chains its own copy, and one that only
reads it does not return it (a device run copied the whole cache in every attention measurement)."""
import jax
import pytest

from nfjax.autosearch.profiler import compile_jobs, floor_job, op_job, time_job
from nfjax.autosearch.subjects import LlamaSubject
from nfjax.checkpoint.orbax_io import load_config
from nfjax.engine.engine import TINY_MODEL


@pytest.fixture(scope="module")
def subject():
    return LlamaSubject(load_config(TINY_MODEL), page_size=16, max_seqs=16, max_pages=32)


@pytest.mark.parametrize("copies", [1, 3])
def test_copies_are_separate_gemms(subject, copies):
    j = op_job(subject, "k", "up_gate", subject.token_case(32), copies=copies)
    compile_jobs([j], log=lambda m: None)
    assert j.error is None
    assert j.compiled.as_text().count(" dot(") == copies              # joined gate/up, once per copy
    assert time_job(j, 2, 1.0) > 0


def test_the_subject_times_the_projections_as_the_engine_serves_them(subject):
    """Joined by default (one GEMM for q/k/v, one for gate/up), as the Runner joins them; run 7's profile timed
    three and two GEMMs while its steps ran one each. `join=False` keeps the separate weights."""
    assert subject.projections == "joined"
    assert hasattr(subject.layer, "qkv_proj") and hasattr(subject.layer, "gate_up_proj")
    sep = LlamaSubject(load_config(TINY_MODEL), page_size=16, max_seqs=16, max_pages=32, join=False)
    assert sep.projections == "separate" and hasattr(sep.layer, "q_proj")
    for s, n in ((subject, 1), (sep, 3)):
        j = op_job(s, "k", "kqv", s.token_case(32))
        compile_jobs([j], log=lambda m: None)
        assert j.error is None and j.compiled.as_text().count(" dot(") == n


def test_the_floor_program_takes_the_ops_arguments_and_computes_nothing(subject):
    j = op_job(subject, "k", "up_gate", subject.token_case(32), copies=2)
    fl = floor_job("floor", j)
    compile_jobs([j, fl], log=lambda m: None)
    assert j.error is None and fl.error is None
    assert j.compiled.as_text().count(" dot(") == 2
    hlo = fl.compiled.as_text()
    assert " dot(" not in hlo and " fusion(" not in hlo
    # every argument of the op is a parameter of the floor too (keep_unused): the same transfer and dispatch
    n_args = len(jax.tree.leaves(j.args()))
    assert n_args == len(jax.tree.leaves(fl.args())) and hlo.count(" parameter(") >= n_args
    assert time_job(fl, 2, 1.0) > 0


def test_a_cache_writer_chains_its_own_cache(subject):
    case = subject.token_case(16)
    j = op_job(subject, "k", "rope_append", case, copies=2)
    compile_jobs([j], log=lambda m: None)
    assert j.error is None
    time_job(j, 2, 1.0)
    time_job(j, 2, 1.0)                       # a second timing: the subject's cache was not donated away
    assert not case.env["kv"].k.is_deleted()
    jax.block_until_ready(case.env["kv"].k)


def test_a_cache_reader_does_not_return_the_cache(subject):
    case = subject.decode_case(4, 24, 8)
    for op in ("attn_decode", "attn_prefill"):
        j = op_job(subject, "k", op, case, copies=2)
        outs, glob = jax.eval_shape(j.fn, *j.args())
        assert glob == () and len(outs) == 2
        leaves = [x.shape for x in jax.tree.leaves(outs)]
        assert case.env["kv"].k.shape not in leaves


def test_the_layer_job_is_the_sequential_layer(subject):
    """The whole-layer measurement (the search's Sequential baseline) runs every op once on a mixed step (decodes,
    then two prefill chunks) and gives the layer's output, its cache chained through as the step's is."""
    import numpy as np
    from nfjax.autosearch.profiler import layer_job
    from nfjax.models.ops import run_ops
    case = subject.mixed_case(32, 4, 24)
    meta = case.ctx_args
    assert int(meta.num_decode) == 4
    assert np.asarray(meta.positions).tolist() == [24] * 4 + list(range(14)) * 2   # decodes, then 2 chunks of 14
    j = layer_job(subject, "layer", case)
    compile_jobs([j], log=lambda m: None)
    assert j.error is None
    want = run_ops([n.spec for n in subject.graph], subject.layer, subject.make_ctx(meta, None),
                   {"x": case.env["x"], "kv": case.env["kv"], "positions": case.env["positions"],
                    "slots": case.env["slots"]})["out"]
    outs, _ = j.compiled(*j.args())
    np.testing.assert_allclose(np.asarray(outs[0], np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    assert time_job(j, 2, 1.0) > 0


def test_ops_compile_without_the_dot_merger_and_the_layer_with_it(subject):
    """Copies of an op share its weights: with XLA's dot merger on, a GPU merged their GEMMs into one (run 4); the
    split variants compile with it off too. The whole Sequential layer keeps it, as the Sequential step does."""
    from nfjax.autosearch.profiler import compiler_options, layer_job
    from nfjax.compat import NO_DOT_MERGER
    seen = {}

    class Lowered:
        def __init__(self, key):
            self.key = key

        def compile(self, compiler_options=None):
            seen[self.key] = compiler_options
            return "compiled"

    jobs = [op_job(subject, "up_gate", "up_gate", subject.token_case(16), copies=2),
            op_job(subject, "attn_decode", "attn_decode", subject.decode_case(4, 24, 8), copies=2),
            layer_job(subject, "layer", subject.mixed_case(32, 4, 24))]
    for j in jobs:
        j.lower = lambda key=j.key: Lowered(key)
    compile_jobs(jobs, log=lambda m: None)
    assert seen == {"up_gate": NO_DOT_MERGER, "attn_decode": NO_DOT_MERGER, "layer": None}
    assert all(j.compiled == "compiled" for j in jobs) and compiler_options(jobs[2]) is None


def test_device_timing_needs_a_device_trace(subject):
    """On a CPU no trace holds GPU events: a device-timed job raises (never a time made up from nothing), and a
    profile takes the wall clock for every job (`traces_device` is False), not a mix of the two clocks."""
    from nfjax.autosearch.profiler import device_time_job, traces_device
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU's traces hold its kernels")
    assert traces_device() is False
    j = op_job(subject, "k", "attn_norm", subject.token_case(16))
    compile_jobs([j], log=lambda m: None)
    with pytest.raises(RuntimeError):
        device_time_job(j, 2)


def test_an_unknown_timing_is_refused(subject):
    from nfjax.autosearch.profiler import CPU_GRID, profile
    with pytest.raises(ValueError, match="timing"):
        profile(subject, CPU_GRID, device="cpu", device_name="cpu", num_sms=0, timing="cycles")


def test_the_subject_context_carries_its_options(subject):
    """`make_ctx` names its fields: passed by position, the forward options once landed in `step_tokens`."""
    ctx = subject.make_ctx(subject._meta([(0, 16)], 16, 0), 7)
    assert ctx.opts is subject.opts and ctx.step_tokens is None and ctx.num_ctas == 7
