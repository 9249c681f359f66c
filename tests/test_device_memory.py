"""nfjax/device_memory.py: before JAX starts, a MoE model gets CUDA's stream-ordered allocator (the BFC pool's holes
cost Mixtral a third of its KV pages) and 0.99 of the GPU's memory, a dense model 0.92 and JAX's allocator; the KV
share of what the weights leave follows the model; a user's choice is kept; after JAX has started nothing changes
and it is said."""
from __future__ import annotations

import os

import pytest

import nfjax.compat
from nfjax import device_memory as dm
from nfjax.config import CacheConfig
from nfjax.engine.builder import engine_config, resolve
from nfjax.models.random_init import SHAPES


@pytest.fixture
def fresh(before_jax_starts):
    before_jax_starts.delenv(dm.ALLOCATOR_ENV, raising=False)
    before_jax_starts.delenv(dm.MEM_ENV, raising=False)
    return before_jax_starts


def test_a_moe_model_gets_the_stream_ordered_allocator_and_more_memory(fresh):
    assert dm.for_model(SHAPES["mixtral-smoke"]) == {dm.MEM_ENV: "0.99", dm.ALLOCATOR_ENV: "cuda_async"}
    assert os.environ[dm.ALLOCATOR_ENV] == "cuda_async" and os.environ[dm.MEM_ENV] == "0.99"


def test_a_dense_model_keeps_the_default_allocator_and_gets_the_benches_share(fresh):
    assert dm.for_model(SHAPES["smoke"]) == {dm.MEM_ENV: "0.92"}
    assert dm.ALLOCATOR_ENV not in os.environ


def test_a_users_values_are_kept(fresh):
    fresh.setenv(dm.ALLOCATOR_ENV, "bfc")
    fresh.setenv(dm.MEM_ENV, "0.5")
    assert dm.for_model(SHAPES["mixtral-smoke"]) == {dm.MEM_ENV: "0.5", dm.ALLOCATOR_ENV: "bfc"}


def test_after_jax_started_it_changes_nothing_and_says_so_on_a_gpu(fresh):
    fresh.setattr(nfjax.compat, "backends_started", lambda: True)
    said = []
    assert dm.for_model(SHAPES["mixtral-smoke"], log=said.append) == {}
    assert said == [] and dm.ALLOCATOR_ENV not in os.environ            # this CPU: nothing to say
    fresh.setattr(nfjax.compat, "on_gpu", lambda: True)
    assert dm.for_model(SHAPES["mixtral-smoke"], log=said.append) == {}
    assert dm.ALLOCATOR_ENV in said[0] and dm.MEM_ENV in said[0]
    assert dm.ALLOCATOR_ENV not in os.environ and dm.MEM_ENV not in os.environ


@pytest.mark.parametrize("shape,share", [("smoke", 0.9), ("mixtral-smoke", 0.97)])
def test_the_kv_share_follows_the_model_unless_given(shape, share):
    cfg = SHAPES[shape]
    per_page = resolve(engine_config(cfg, {"cache": {"kv_memory_fraction": 0.5}}), 10 ** 9, True).cache.num_pages
    auto = resolve(engine_config(cfg), 10 ** 9, True).cache
    assert auto.kv_memory_fraction == share
    assert auto.num_pages == pytest.approx(per_page * share / 0.5, rel=0.01)
    with pytest.raises(Exception, match="kv_memory_fraction"):
        CacheConfig(kv_memory_fraction=1.5)


def test_a_bench_child_takes_the_models_share_over_the_provisional_one(fresh):
    """A bench's child process inherits the parent's provisional 0.92 and its marker: the model's share wins; a
    value the user set (no marker) is kept."""
    import bench.setup as bs
    fresh.setenv(dm.MEM_ENV, "0.92")
    fresh.setenv(bs._PROVISIONAL, "0.92")
    bs.model_config({"shape": "mixtral-smoke"})
    assert os.environ[dm.MEM_ENV] == "0.99"
    fresh.setenv(dm.MEM_ENV, "0.6")
    bs.model_config({"shape": "mixtral-smoke"})
    assert os.environ[dm.MEM_ENV] == "0.6"


def test_a_moe_model_on_a_gpu_steps_up_to_3072_tokens_without_the_prefill_step():
    moe = resolve(engine_config(SHAPES["mixtral-smoke"]), 10 ** 9, True).batcher
    dense = resolve(engine_config(SHAPES["smoke"]), 10 ** 9, True).batcher
    assert max(moe.token_buckets) == 3072 and moe.prefill_bucket == 0
    assert max(dense.token_buckets) == 2048 and dense.prefill_bucket == 8192
    assert resolve(engine_config(SHAPES["mixtral-smoke"]), None, False).batcher.token_buckets == (1, 16, 256)
