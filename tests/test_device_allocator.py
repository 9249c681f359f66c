"""nfjax/device_allocator.py: a MoE model gets CUDA's stream-ordered allocator before JAX starts (the BFC pool's
holes cost Mixtral a third of its KV pages); dense models keep JAX's default; a user's choice is kept; after JAX
has started nothing changes and it is said."""
from __future__ import annotations

import os

import pytest

import nfjax.compat
from nfjax import device_allocator
from nfjax.models.random_init import SHAPES


@pytest.fixture
def fresh(before_jax_starts):
    before_jax_starts.delenv(device_allocator.ENV, raising=False)
    return before_jax_starts


def test_a_moe_model_gets_the_stream_ordered_allocator(fresh):
    assert device_allocator.for_model(SHAPES["mixtral-smoke"]) == "cuda_async"
    assert os.environ[device_allocator.ENV] == "cuda_async"


def test_a_dense_model_keeps_the_default(fresh):
    assert device_allocator.for_model(SHAPES["smoke"]) is None
    assert device_allocator.ENV not in os.environ


def test_a_users_value_is_kept(fresh):
    fresh.setenv(device_allocator.ENV, "bfc")
    assert device_allocator.for_model(SHAPES["mixtral-smoke"]) == "bfc"


def test_after_jax_started_it_changes_nothing_and_says_so_on_a_gpu(fresh):
    fresh.setattr(nfjax.compat, "backends_started", lambda: True)
    said = []
    assert device_allocator.for_model(SHAPES["mixtral-smoke"], log=said.append) is None
    assert said == [] and device_allocator.ENV not in os.environ            # this CPU: nothing to say
    fresh.setattr(nfjax.compat, "on_gpu", lambda: True)
    assert device_allocator.for_model(SHAPES["mixtral-smoke"], log=said.append) is None
    assert device_allocator.ENV in said[0] and device_allocator.ENV not in os.environ
