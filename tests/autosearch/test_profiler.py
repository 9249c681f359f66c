"""The profiler's measurements: copies of an op in one program stay separate computations (XLA merges identical
ones: the first device runs timed 8 GEMM copies as one), and an op that writes the cache chains its own copy."""
import jax
import pytest

from nfjax.autosearch.profiler import compile_jobs, op_job, time_job
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
    assert j.compiled.as_text().count(" dot(") == 2 * copies          # gate and up, once per copy
    assert time_job(j, 2, 1.0) > 0


def test_a_cache_writer_chains_its_own_cache(subject):
    case = subject.token_case(16)
    j = op_job(subject, "k", "rope_append", case, copies=2)
    compile_jobs([j], log=lambda m: None)
    assert j.error is None
    time_job(j, 2, 1.0)
    time_job(j, 2, 1.0)                       # a second timing: the subject's cache was not donated away
    assert not case.env["kv"].k.is_deleted()
    jax.block_until_ready(case.env["kv"].k)
