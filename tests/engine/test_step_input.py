"""Step inputs cross to the device as one packed int32 vector and land bit for bit in the staged buffers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nfjax.engine.step_input import StepInput, pack, stage, unpack_into
from nfjax.kv.metadata import build_metadata


def _random_input(rng, t=32, s=4, p=8, ps=8) -> StepInput:
    seqs = [(list(rng.integers(1, 60, 3)), int(rng.integers(0, 8)), 1) for _ in range(3)] + [([5, 6], 0, 9)]
    meta = build_metadata(seqs, t, s, p, ps, num_decode=3)
    f = lambda: rng.standard_normal(s).astype(np.float32)                           # noqa: E731
    return StepInput(rng.integers(0, 258, t).astype(np.int32), rng.integers(-1, s, t).astype(np.int32), meta,
                     np.abs(f()), rng.integers(0, 50, s).astype(np.int32), f(),
                     rng.integers(0, 2**32, s, dtype=np.uint64).astype(np.uint32),
                     rng.integers(0, 100, s).astype(np.int32))


def test_pack_unpack_is_bit_exact_and_writes_in_place():
    rng = np.random.default_rng(0)
    first, second = _random_input(rng), _random_input(rng)
    second.temperature[0] = np.nan                                # any bits survive, NaN included
    unpack = jax.jit(unpack_into, donate_argnums=0)
    # (the CPU client may share a fresh device_put's memory with numpy, and then copies instead of donating: the
    # buffers are the program's own from the first call on)
    staged = jax.device_put(jax.tree.map(np.zeros_like, first))
    ptrs = None
    for host in (first, second, first):
        staged = unpack(staged, jnp.asarray(pack(host)))
        now = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(staged)]
        assert ptrs in (None, now)                                 # written in place: the same buffers
        ptrs = now
        for got, want in zip(jax.tree.leaves(staged), jax.tree.leaves(host)):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))
    moved = jax.jit(stage, donate_argnums=0)(staged, jax.device_put(first))
    for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(first)):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_pack_rejects_other_widths_and_unpack_checks_the_length():
    inp = _random_input(np.random.default_rng(1))
    bad = StepInput(inp.tokens.astype(np.int64), *jax.tree.leaves(inp, is_leaf=lambda x: x is inp.meta)[1:])
    with pytest.raises(TypeError, match="int64"):
        pack(bad)
    with pytest.raises(ValueError, match="words"):
        unpack_into(jax.device_put(inp), jnp.asarray(np.concatenate([pack(inp), [0]])))
