"""On-device sampling: greedy rows, the static greedy-only path, top-k/top-p limits, per-request keys, the plain
(sort-free) draw against the limits path and against the softmax, and no device-predicated conditional in the
compiled program (XLA:GPU would make enqueueing it wait for the GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.engine.sampler import sample

S, V = 6, 50


def inputs(temps, top_k=0, top_p=1.0, seed=0):
    logits = jnp.asarray(np.random.default_rng(seed).standard_normal((S, V)) * 3, jnp.float32)
    t = jnp.asarray(temps, jnp.float32)
    return (logits, t, jnp.full((S,), top_k, jnp.int32), jnp.full((S,), top_p, jnp.float32),
            jnp.arange(S, dtype=jnp.uint32) + 7, jnp.zeros((S,), jnp.int32))


def test_greedy_rows_take_the_argmax_on_both_paths():
    args = inputs([0.0] * S)
    want = np.argmax(np.asarray(args[0]), axis=-1)
    np.testing.assert_array_equal(sample(*args, any_sampled=False), want)
    np.testing.assert_array_equal(sample(*args, any_sampled=True), want)
    mixed = inputs([0.0, 1.0, 0.0, 2.0, 0.0, 1.0])
    got = np.asarray(sample(*mixed))
    np.testing.assert_array_equal(got[[0, 2, 4]], want[[0, 2, 4]])


def test_top_k_one_and_tiny_top_p_are_greedy_and_keys_are_per_request():
    want = np.argmax(np.asarray(inputs([1.0] * S)[0]), axis=-1)
    np.testing.assert_array_equal(sample(*inputs([1.0] * S, top_k=1)), want)
    np.testing.assert_array_equal(sample(*inputs([1.0] * S, top_p=1e-6)), want)
    hot = inputs([5.0] * S)
    a, b = np.asarray(sample(*hot)), np.asarray(sample(*hot))
    np.testing.assert_array_equal(a, b)                                   # same seeds and counters: same draw
    draws = {tuple(np.asarray(sample(*hot[:5], jnp.full((S,), c, jnp.int32)))) for c in range(8)}
    assert len(draws) > 1                                                 # the counter moves the key


def test_compiled_sampler_has_no_conditional():
    args = inputs([1.0] * S)
    for any_sampled, limits in ((False, True), (True, True), (True, False)):
        hlo = jax.jit(lambda *a: sample(*a, any_sampled=any_sampled, limits=limits)).lower(*args).compile().as_text()
        assert "conditional(" not in hlo


def test_plain_draw_is_the_limits_paths_draw_for_rows_without_limits():
    """A row without top-k / top-p draws the same token on both paths (the engine runs them in different heads,
    so a seeded request's tokens must not depend on whether a neighbour has a top-p), over many keys."""
    rng = np.random.default_rng(5)
    rows, vocab = 300, 97
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    temp = rng.choice([0.0, 0.5, 1.0, 3.0], rows).astype(np.float32)
    args = (logits, temp, np.zeros(rows, np.int32), np.ones(rows, np.float32),
            rng.integers(0, 2**31, rows).astype(np.uint32), rng.integers(0, 1000, rows).astype(np.int32))
    plain = np.asarray(jax.jit(lambda *a: sample(*a, limits=False))(*args))
    limited = np.asarray(jax.jit(sample)(*args))
    np.testing.assert_array_equal(plain, limited)
    assert len(set(plain[temp > 0].tolist())) > 20                       # draws, not a constant


def test_plain_draws_follow_the_softmax():
    """8,000 draws of one 6-token row (counters 0..7,999): each token's frequency within 0.02 of softmax(l / T)."""
    n, logits = 8000, np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    for t in (1.0, 0.5):
        args = (np.tile(logits, (n, 1)), np.full(n, t, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32),
                np.full(n, 11, np.uint32), np.arange(n, dtype=np.int32))
        got = np.bincount(np.asarray(jax.jit(lambda *a: sample(*a, limits=False))(*args)), minlength=6) / n
        want = np.exp(logits / t) / np.exp(logits / t).sum()
        assert np.abs(got - want).max() < 0.02, (t, got, want)


def _spec(rows: int, vocab: int):
    return (jax.ShapeDtypeStruct((rows, vocab), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.uint32), jax.ShapeDtypeStruct((rows,), jnp.int32))


def test_rows_in_chunks_draw_as_each_row_alone_within_its_limits():
    """Over SAMPLE_CHUNK rows the sampler runs in chunks (a remainder too): every row draws what it draws alone,
    and inside its top-k and top-p set."""
    from nfjax.engine.sampler import SAMPLE_CHUNK
    rows, vocab = 2 * SAMPLE_CHUNK + 37, 64
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    temp = rng.choice([0.0, 0.7, 1.5], rows).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 20], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.3], rows).astype(np.float32)
    seeds = rng.integers(0, 2**31, rows).astype(np.uint32)
    counters = rng.integers(0, 50, rows).astype(np.int32)
    got = np.asarray(jax.jit(sample)(logits, temp, top_k, top_p, seeds, counters))
    one = jax.jit(sample)
    for i in range(0, rows, 7):
        alone = one(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], seeds[i:i + 1], counters[i:i + 1])
        assert int(alone[0]) == got[i], i
    for i in range(rows):
        order = np.argsort(-logits[i], kind="stable")
        if temp[i] == 0:
            assert got[i] == order[0]
            continue
        p = np.exp((logits[i][order] - logits[i].max()) / temp[i])
        k = top_k[i] or vocab
        p = p[:k] / p[:k].sum()
        nucleus = int(np.searchsorted(np.cumsum(p) - p, top_p[i], side="left"))   # ranks with mass before < p
        assert got[i] in set(order[:max(1, nucleus)].tolist()), i


@pytest.mark.parametrize("limits", [True, False])
def test_sampled_scratch_is_bounded_by_the_chunk(limits):
    """1,024 rows of a 32k vocab: the compiled sampler's scratch stays under two vocab-sized f32 arrays of all rows
    (the whole-batch sort held ~9: 4.65 GiB at 1,024 x 128k on the H100; the plain draw unchunked 4), and its one
    loop has a known trip count (XLA:GPU does not read its predicate back to the host)."""
    import re
    rows, vocab = 1024, 32768
    c = jax.jit(lambda *a: sample(*a, any_sampled=True, limits=limits)).lower(*_spec(rows, vocab)).compile()
    assert c.memory_analysis().temp_size_in_bytes < 2 * rows * vocab * 4
    hlo = c.as_text()
    assert len(re.findall(r"\bwhile\(", hlo)) == len(re.findall(r"known_trip_count", hlo)) > 0
    assert ("sort(" in hlo) == limits                                      # the plain draw sorts nothing
