"""Offloaded generation gives the paged engine's tokens (float32) under every placement, for a tiny OPT and a tiny
Llama: all on the GPU; weights half in host memory; the KV cache in host memory; weights partly on disk (with KV
and activations spread over all three tiers); weights in host numpy arrays under the row-by-row baseline. Prompts
of 4 to 24 tokens in blocks of several GPU batches (the last block padded with dummy rows)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nfjax.engine import SamplingParams
from nfjax.offload import Policy, Split
from nfjax.offload.engine import OffloadEngine
from tests.offload.common import MAX_LEN, PROMPTS, engine_tokens, model, tokenizer

POLICIES = {
    "all-gpu": Policy(gpu_batch_size=2, num_gpu_batches=2),
    "weights-half-cpu": Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(50, 50, 0)),
    "kv-cpu": Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0, 100, 0), activations=Split(0, 100, 0)),
    "weights-disk": Policy(gpu_batch_size=1, num_gpu_batches=3, weights=Split(20, 40, 40), cache=Split(30, 30, 40),
                           activations=Split(0, 0, 100)),
    "row-by-row-numpy": Policy(gpu_batch_size=4, num_gpu_batches=1, weights=Split(0, 100, 0), host_memory="numpy",
                               cache=Split(0, 100, 0), schedule="row_by_row"),
}


@pytest.mark.parametrize("name", ["opt", "llama"])
def test_tokens_equal_the_paged_engine(name, tmp_path):
    want = engine_tokens(name)
    for label, pol in POLICIES.items():
        pol = pol.replace(offload_dir=str(tmp_path))
        with OffloadEngine.from_model(model(name), tokenizer(name), pol, max_model_len=MAX_LEN) as eng:
            if pol.uses_disk():
                assert any(eng.disk.path.iterdir())
                assert eng.weights.bytes_by_tier()["disk"] > 0
            outs = eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
        got = tuple(tuple(o.token_ids) for o in outs)
        assert got == want, label
        assert all(o.finish_reason == "length" for o in outs)
        assert list(tmp_path.iterdir()) == [], f"{label}: the disk tier was not removed"


def test_seeded_sampling_and_stops_match_the_engine():
    """Temperature sampling draws with the engine's seeds and counters: the same tokens; a stop token ends one
    request early while the rest of its block runs on."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    want = engine_tokens("opt", params)
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(50, 50, 0), cache=Split(50, 50, 0))
    with OffloadEngine.from_model(model("opt"), tokenizer("opt"), pol, max_model_len=MAX_LEN) as eng:
        assert tuple(tuple(o.token_ids) for o in eng.generate(PROMPTS, params)) == want
        stop = want[1][3]
        first = want[1].index(stop)
        outs = eng.generate(PROMPTS[:2], [params, dataclasses.replace(params, stop_token_ids=(stop,))])
    assert outs[0].token_ids == list(want[0]) and outs[0].finish_reason == "length"
    assert outs[1].token_ids == list(want[1][:first + 1]) and outs[1].finish_reason == "stop"


def test_compressed_weights_stay_close(tmp_path):
    """4-bit weights off the GPU: the first tokens of most prompts agree with float32 and the stores hold the
    packed bytes (0.5625 a value against 4)."""
    pol = Policy(gpu_batch_size=2, num_gpu_batches=3, weights=Split(0, 50, 50), compress_weights=True,
                 offload_dir=str(tmp_path))
    with OffloadEngine.from_model(model("opt"), tokenizer("opt"), pol, max_model_len=MAX_LEN) as eng:
        by_tier = eng.weights.bytes_by_tier()
        outs = eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=4, ignore_eos=True))
    dense = sum(np.prod(s) for s in [(64, 64)] * 4 + [(64, 128), (128, 64)]) * 4 * 3
    assert by_tier["gpu"] < 0.01 * dense and by_tier["cpu"] + by_tier["disk"] < 0.2 * dense
    want = engine_tokens("opt")
    assert sum(o.token_ids[0] == w[0] for o, w in zip(outs, want)) >= 3


def test_unsupported_sampling_options_name_the_field():
    from nfjax.errors import UserError
    with OffloadEngine.from_model(model("llama"), tokenizer("llama"), Policy(), max_model_len=MAX_LEN) as eng:
        for kw in (dict(presence_penalty=0.5), dict(logprobs=2), dict(min_tokens=2, max_tokens=4)):
            with pytest.raises(UserError, match=next(iter(kw))):
                eng.generate([PROMPTS[0]], SamplingParams(**kw))


def test_compressed_kv_cache_is_the_same_on_every_tier(tmp_path):
    """The KV cache in int4 (head_dim 64): the same tokens whether its blocks stay on the GPU or move through host
    memory and disk (codes and scales move as stored), and the files hold codes and scales. Its accuracy is
    measured on a real model (tests/offload/test_perplexity.py)."""
    from nfjax.models.random_init import random_model
    from tests.offload.common import OPT
    m = random_model(OPT.replace(hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64), seed=5, std=0.25,
                     host=True)
    params = SamplingParams.greedy(max_tokens=8, ignore_eos=True)
    got = []
    for cache in (Split(100, 0, 0), Split(30, 30, 40)):
        pol = Policy(gpu_batch_size=2, num_gpu_batches=3, cache=cache, compress_cache=True, offload_dir=str(tmp_path))
        with OffloadEngine.from_model(m, tokenizer("opt"), pol, max_model_len=MAX_LEN) as eng:
            got.append([o.token_ids for o in eng.generate(PROMPTS, params)])
            if cache.disk:
                names = {p.name for p in eng.disk.path.iterdir()}
                assert any(n.startswith("kv") and n.endswith("-2.npy") for n in names)   # codes K, codes V, scales
    assert got[0] == got[1]


def test_placed_weights_serve_a_policy_placing_alike():
    """`weights_from`: a policy with the same weight placement takes the placed weights (no second placement) and
    still gives the engine's tokens; a different placement places its own."""
    want = engine_tokens("opt")
    first = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Split(50, 50, 0))
    a = OffloadEngine.from_model(model("opt"), tokenizer("opt"), first, max_model_len=MAX_LEN)
    a.close()
    same = Policy(gpu_batch_size=1, num_gpu_batches=3, weights=Split(50, 50, 0), cache=Split(0, 100, 0))
    with OffloadEngine.from_model(model("opt"), tokenizer("opt"), same, max_model_len=MAX_LEN, weights_from=a) as b:
        assert b.weights.layers is a.weights.layers and b.weights.tiers is b.tiers
        outs = b.generate(PROMPTS, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
    assert tuple(tuple(o.token_ids) for o in outs) == want
    other = same.replace(weights=Split(0, 100, 0))
    with OffloadEngine.from_model(model("opt"), tokenizer("opt"), other, max_model_len=MAX_LEN, weights_from=a) as c:
        assert c.weights.layers is not a.weights.layers and c.weights.bytes_by_tier()["gpu"] == 0


def test_stores_through_pinned_memory_keep_the_tokens(monkeypatch, tmp_path):
    """Every KV store through pinned host memory (the runtime's way for a prefill's rows; here the threshold is 0 so
    decode rows go that way too), host- and disk-held blocks: the paged engine's tokens."""
    from nfjax.offload import schedule
    calls = []
    real = schedule.jax.device_put

    def spy(x, sharding=None, *a, **kw):
        if getattr(sharding, "memory_kind", None) == "pinned_host" and isinstance(x, tuple):
            calls.append(len(x))
        return real(x, sharding, *a, **kw)
    monkeypatch.setattr(schedule, "PINNED_STORE_BYTES", 0)
    monkeypatch.setattr(schedule.jax, "device_put", spy)
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0, 50, 50), offload_dir=str(tmp_path))
    with OffloadEngine.from_model(model("opt"), tokenizer("opt"), pol, max_model_len=MAX_LEN) as eng:
        outs = eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
    assert calls, "no store went through pinned memory"
    assert tuple(tuple(o.token_ids) for o in outs) == engine_tokens("opt")


def test_host_kv_blocks_are_pinned_arrays_loaded_from_their_numpy_views(monkeypatch, tmp_path):
    """Under host memory "pinned" every host-held KV block is a pinned_host array whose buffer the rows are written
    into through numpy, and its loads put that array (a DMA on a GPU), not a numpy copy: the paged engine's
    tokens. Under "numpy" the blocks stay numpy arrays."""
    from nfjax.offload import schedule
    seen = {}
    real = schedule.KVStore.load

    def spy(self, j, k):
        if self.tier(j, k) == "cpu":
            seen.setdefault(self.tiers.pinned, set()).add((j, k) in self.pinned)
            if (j, k) in self.pinned:
                for a, view in zip(self.pinned[(j, k)], self.blocks[(j, k)]):
                    assert a.sharding.memory_kind == "pinned_host"
                    assert view.ctypes.data == a.unsafe_buffer_pointer()
        return real(self, j, k)
    monkeypatch.setattr(schedule.KVStore, "load", spy)
    for mem in ("pinned", "numpy"):
        pol = Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0, 100, 0), host_memory=mem)
        with OffloadEngine.from_model(model("opt"), tokenizer("opt"), pol, max_model_len=MAX_LEN) as eng:
            outs = eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
        assert tuple(tuple(o.token_ids) for o in outs) == engine_tokens("opt"), mem
    assert seen == {True: {True}, False: {False}}


def test_a_pinned_view_writes_reach_the_next_put_and_keep_the_array_alive():
    import gc

    import jax
    from jax.sharding import SingleDeviceSharding

    from nfjax.offload.store import pinned_zeros
    dev = jax.devices()[0]
    on = SingleDeviceSharding(dev)
    arr, view = pinned_zeros((3, 4), np.float32, SingleDeviceSharding(dev, memory_kind="pinned_host"))
    view[1, 2] = 7.0
    assert float(np.asarray(jax.device_put(arr, on))[1, 2]) == 7.0
    view[1, 2] = 9.0                                     # a second write: not a cached copy
    assert float(np.asarray(jax.device_put(arr, on))[1, 2]) == 9.0
    ptr = arr.unsafe_buffer_pointer()
    del arr
    gc.collect()
    assert view.ctypes.data == ptr and float(view[1, 2]) == 9.0      # the view holds the array


def test_pinned_kv_blocks_are_reused_by_the_next_call_of_the_same_shape():
    """A second generate of the same shapes takes the first call's pinned blocks back (no new pinning), and its
    tokens are the paged engine's although the blocks hold the first call's rows; a new shape frees them."""
    from nfjax.offload import schedule
    made, alive = [], []
    real = schedule.KVStore.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        made.append({id(x) for arrays in self.pinned.values() for x in arrays})
        alive.extend(x for arrays in self.pinned.values() for x in arrays)     # ids stay unique while held
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2, cache=Split(0, 100, 0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schedule.KVStore, "__init__", spy)
        with OffloadEngine.from_model(model("opt"), tokenizer("opt"), pol, max_model_len=MAX_LEN) as eng:
            calls = []
            for _ in range(2):
                outs = eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
                assert tuple(tuple(o.token_ids) for o in outs) == engine_tokens("opt")
                calls.append(set().union(*made))
                made.clear()
            eng.generate([PROMPTS[0][:2]], SamplingParams.greedy(max_tokens=1, ignore_eos=True))
            calls.append(set().union(*made))
            pooled = {id(a) for arrays in eng.tiers._free.values() for a, _ in arrays}
    assert calls[0] and calls[1] == calls[0]
    assert pooled and pooled <= calls[2] and not pooled & calls[0]     # the earlier shapes' blocks were let go
