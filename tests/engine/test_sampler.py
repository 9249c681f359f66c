"""On-device sampling: greedy rows, the static greedy-only path, top-k/top-p limits, per-request keys, and no
device-predicated conditional in the compiled program (XLA:GPU would make enqueueing it wait for the GPU)."""
import jax
import jax.numpy as jnp
import numpy as np

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
    for any_sampled in (False, True):
        hlo = jax.jit(lambda *a: sample(*a, any_sampled=any_sampled)).lower(*args).compile().as_text()
        assert "conditional(" not in hlo
