"""The prefix cache through the engine: multi-turn conversations give the tokens of an engine without it, with
evictions from a tiny GPU pool through a tiny host tier, preemption (swap to host), aborts and penalties; no page
leaks; each KV format."""
import numpy as np
import pytest

from nfjax.config import BatcherConfig, CacheConfig
from nfjax.engine import SamplingParams
from tests.engine.conftest import TINY, make_engine
from tests.kv.test_kv_engine import CFG as CFG64

PS = 8
ROW = TINY.num_layers * PS * TINY.num_kv_heads * TINY.head_dim * 4 * 2     # one float32 page of K and V, all layers
SCHED = BatcherConfig(token_buckets=(32,), max_seqs=8, predict_memory=False)


def _cache(**kw):
    return CacheConfig(page_size=PS, num_pages=30, max_pages_per_seq=16, **kw)


@pytest.fixture(scope="module")
def off():
    return make_engine(_cache(prefix_cache=False), SCHED)


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    # 29 GPU pages for 6 conversations of up to ~12 pages (evictions, preemptions), a host tier of 4 pages and a
    # disk tier of 16 below it
    eng = make_engine(_cache(host_cache_gb=4 * ROW / 2 ** 30, disk_cache_dir=str(tmp_path_factory.mktemp("disk")),
                             disk_cache_gb=16 * ROW / 2 ** 30), SCHED)
    yield eng
    eng.close()


def converse(engines, n=6, turns=4, seed=0, params=None):
    """Interleaved conversations: each turn's prompt is the history plus a new message; every engine gets the
    same prompts (the first engine's outputs extend the history) and must answer with the same tokens."""
    rng = np.random.default_rng(seed)
    hist = [[int(t) for t in rng.integers(0, 256, rng.integers(10, 24))] for _ in range(n)]
    for _ in range(turns):
        sps = [params or SamplingParams.greedy(max_tokens=int(m), ignore_eos=True) for m in rng.integers(4, 10, n)]
        outs = [e.generate(hist, sps) for e in engines]
        for o in outs[1:]:
            assert [x.token_ids for x in o] == [x.token_ids for x in outs[0]]
        hist = [h + o.token_ids + [int(t) for t in rng.integers(0, 256, rng.integers(4, 12))]
                for h, o in zip(hist, outs[0])]
    return hist            # the last turn's prompts: every output of the first engine is in them


def assert_no_leaks(eng):
    a = eng.batcher.allocator
    assert eng.pages_used == 0 and a.num_free == a.capacity
    assert all(a.refcount(p) == 0 for p in range(a.num_pages))
    assert len(eng.batcher.free_penalty_slots) == eng.runner.penalty_slots


def test_multi_turn_tokens_equal_without_the_cache_through_every_tier(off, tiered):
    converse([off, tiered])
    st = tiered.prefix_stats()
    assert st["hit_tokens_gpu"] > 0 and st["hit_tokens_host"] > 0 and st["hit_tokens_disk"] > 0
    assert st["bytes_to_host"] > 0 and st["bytes_to_disk"] > 0 and st["disk_errors"] == 0
    assert st["bytes_from_host"] == (st["hit_tokens_host"] + st["hit_tokens_disk"]) // PS * ROW
    assert st["bytes_from_disk"] == st["hit_tokens_disk"] // PS * ROW
    assert tiered.preemptions > 0
    assert 0 < st["hit_rate"] == st["hit_tokens"] / st["prompt_tokens"] < 1
    assert off.prefix_stats()["hit_tokens"] == 0
    summary = tiered.trace.summary()
    assert summary["prefix_reused_tokens"] > 0 and 0 < summary["prefix_hit_rate"] < 1
    assert_no_leaks(tiered)
    assert_no_leaks(off)


def test_prefill_starts_at_the_first_uncached_token(tiered):
    tiered.trace.steps.clear()
    prompt = list(range(40, 40 + 3 * PS + 3))                # 3 full pages + 3 tokens
    sp = SamplingParams.greedy(max_tokens=2, ignore_eos=True)
    first = tiered.generate(prompt, sp)[0]
    again = tiered.generate(prompt, sp)[0]
    assert again.token_ids == first.token_ids
    s = tiered.trace.summary()
    assert s["prefill_tokens"] == len(prompt) + 3 and s["prefix_reused_tokens"] == 3 * PS
    # a page-aligned prompt reuses all but its last page: the last prompt token is always computed
    aligned = list(range(100, 100 + 2 * PS))
    tiered.generate(aligned, sp)
    tiered.trace.steps.clear()
    tiered.generate(aligned, sp)
    assert tiered.trace.summary()["prefill_tokens"] == PS
    assert_no_leaks(tiered)


def test_aborts_and_preemptions_leak_nothing(off, tiered):
    rng = np.random.default_rng(3)
    system = [int(t) for t in rng.integers(0, 256, 2 * PS + 5)]       # a shared prefix
    prompts = [system + [int(t) for t in rng.integers(0, 256, rng.integers(3, 30))] for _ in range(10)]
    sp = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    ids = [tiered.add_request(p, sp) for p in prompts]
    done, aborted, steps = {}, set(), 0
    while tiered.has_unfinished():
        for o in tiered.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps in (1, 4, 9, 15):       # waiting, prefilling, decoding or swapped out by then
            rid = next(i for i in ids[::-1] if i not in done and i not in aborted)
            tiered.abort(rid)
            aborted.add(rid)
    assert tiered.preemptions > 0
    assert_no_leaks(tiered)
    kept = [(p, i) for p, i in zip(prompts, ids) if i not in aborted]
    want = off.generate([p for p, _ in kept], sp)
    assert [done[i].token_ids for _, i in kept] == [w.token_ids for w in want]


def test_repetition_penalty_sees_the_reused_prompt(off, tiered):
    """The full head marks a prompt's tokens as its prefill chunks pass; a reused prefix is not prefilled, so the
    engine fills the penalty slot with the whole prompt first. The penalized token must be the cache-off one."""
    base = list(range(60, 60 + 2 * PS)) + [61, 62]
    plain = tiered.generate(base, SamplingParams.greedy(max_tokens=24, ignore_eos=True))[0].token_ids
    k = next(k for k in range(24) if plain[k] in base[:2 * PS])      # greedy repeats a token of the cached pages
    prompt = base + plain[:k]
    tiered.generate(prompt, SamplingParams.greedy(max_tokens=1))                   # cache its pages
    rep = SamplingParams.greedy(max_tokens=12, ignore_eos=True, repetition_penalty=3.0, frequency_penalty=0.5)
    before = tiered.prefix_stats()["hit_tokens"]
    got = tiered.generate(prompt, rep)[0].token_ids
    assert tiered.prefix_stats()["hit_tokens"] - before >= 2 * PS
    want = off.generate(prompt, rep)[0].token_ids
    assert got == want and got[0] != plain[k]
    assert_no_leaks(tiered)


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", "int8", "int4"])
def test_each_kv_format_with_the_cache(fmt):
    """Each format's pages (values and scales) are reused and move through the host tier as stored. The
    reference is the same engine with lookups and registration off (allocator.prefix False): no reuse at all."""
    row = 2 * PS * 2 * {"bfloat16": 64 * 2 * 2, "fp8": 64 * 2 + 16, "int8": 64 * 2 + 16, "int4": 64 + 16}[fmt]
    eng = make_engine(CacheConfig(page_size=PS, num_pages=24, max_pages_per_seq=16, kv_dtype=fmt,
                                  host_cache_gb=4 * row / 2 ** 30), SCHED, cfg=CFG64)
    assert eng.runner.tier_copies.row_bytes == row
    eng.batcher.allocator.prefix = False
    want = converse([eng], seed=1)
    assert eng.prefix_stats()["hit_tokens"] == 0
    eng.batcher.allocator.prefix = True
    assert converse([eng], seed=1) == want
    st = eng.prefix_stats()
    assert st["hit_tokens_gpu"] > 0 and st["hit_tokens_host"] > 0
    assert_no_leaks(eng)


def test_metrics_report_hit_rate_tiers_and_bytes(tiered):
    from prometheus_client.parser import text_string_to_metric_families
    from nfjax.server.metrics import ServerMetrics
    prompt = list(range(30, 30 + 2 * PS + 1))
    tiered.generate([prompt, prompt[:-1] + [5]], SamplingParams.greedy(max_tokens=1))
    tiered.generate(prompt, SamplingParams.greedy(max_tokens=1))
    m = ServerMetrics()
    m.bind_prefix(tiered.prefix_stats)
    st = tiered.prefix_stats()
    assert st["hit_rate"] > 0
    got = {(s.name, tuple(s.labels.values())): s.value
           for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert got[("nfjax_prefix_cache_hit_rate", ())] == pytest.approx(st["hit_rate"])
    for tier in ("gpu", "host", "disk"):
        assert got[("nfjax_prefix_cache_hit_tokens", (tier,))] == st[f"hit_tokens_{tier}"]
    for d in ("to_host", "from_host", "to_disk", "from_disk"):
        assert got[("nfjax_prefix_cache_bytes", (d,))] == st[f"bytes_{d}"]


def test_corrupt_disk_files_are_recomputed_not_loaded(off, tiered):
    """A prompt's pages pushed down to the disk tier by other prompts, its second page's file damaged: the first
    page loads from disk, the damaged one fails its checksum (a warning) and it and the rest are recomputed; the
    tokens are the cache-off engine's."""
    from nfjax.kv.prefix_cache import ROOT, chain_hash
    disk = tiered.batcher.tiers.disk
    prompt = list(range(7, 7 + 3 * PS + 2))
    hashes, prev = [], ROOT
    for i in range(3):
        prev = chain_hash(prev, prompt[i * PS:(i + 1) * PS])
        hashes.append(prev)
    sp = SamplingParams.greedy(max_tokens=4, ignore_eos=True)
    want = off.generate(prompt, sp)[0].token_ids
    assert tiered.generate(prompt, sp)[0].token_ids == want
    rng = np.random.default_rng(9)
    for _ in range(40):                     # other prompts' pages push it out of the GPU and the host tier
        if all(h in disk for h in hashes):
            break
        tiered.generate([[int(t) for t in rng.integers(0, 256, PS + 1)] for _ in range(4)],
                        SamplingParams.greedy(max_tokens=1))
    assert all(h in disk for h in hashes)
    disk.flush()                            # the engine's disk tier writes in the background
    f = disk.path(hashes[1])
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    before = tiered.prefix_stats()
    with pytest.warns(RuntimeWarning, match="checksum mismatch; recomputing"):
        got = tiered.generate(prompt, sp)[0].token_ids
    after = tiered.prefix_stats()
    assert got == want
    assert after["disk_errors"] == before["disk_errors"] + 1
    assert after["hit_tokens_disk"] == before["hit_tokens_disk"] + PS
    assert_no_leaks(tiered)


def test_flags_and_config():
    import argparse
    from nfjax.config import ConfigError
    from nfjax.engine.builder import add_engine_args, engine_config, overrides_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert overrides_from_args(p.parse_args(["--no-prefix-cache"]))["cache"] == {"prefix_cache": False}
    got = overrides_from_args(p.parse_args(["--host-cache-gb", "2.5", "--disk-cache-dir", "/d", "--disk-cache-gb", "8"]))
    assert got["cache"] == {"host_cache_gb": 2.5, "disk_cache_dir": "/d", "disk_cache_gb": 8.0}
    c = engine_config(TINY).cache
    assert c.prefix_cache and c.host_cache_gb == 0 and c.disk_cache_dir is None      # on by default, no tiers
    with pytest.raises(ConfigError, match="need the prefix cache"):
        CacheConfig(prefix_cache=False, host_cache_gb=1)
    with pytest.raises(ConfigError, match="go together"):
        CacheConfig(disk_cache_dir="/d")
    with pytest.raises(ConfigError, match="host_cache_gb must be >= 0"):
        CacheConfig(host_cache_gb=-1)
