"""The engine with each KV format on the CPU (reference attention path): `--kv-dtype`, the pool sized by the
compressed bytes, the start line, errors naming the flag, batch invariance under forced preemption (swapping
moves compressed pages and their scales as they are), and logits close to the unquantized cache's."""
import argparse

import numpy as np
import pytest

from flax import nnx

from nfjax.config import BatcherConfig, CacheConfig, ConfigError, EngineConfig, ModelConfig
from nfjax.engine import SamplingParams
from nfjax.engine.builder import add_engine_args, engine_config, overrides_from_args, resolve
from nfjax.engine.runner import Runner
from nfjax.kv.cache import bytes_per_token
from nfjax.kv.metadata import build_metadata
from nfjax.models.llama import LlamaModel
from nfjax.parallel import make_mesh, shard_model
from tests.engine.conftest import make_engine

# head_dim 64: int4's and int8's groups are 64 wide
CFG = ModelConfig(vocab_size=258, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=256, eos_token_ids=(257,), bos_token_id=256, dtype="bfloat16")


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_flag_and_config_field(capsys):
    assert overrides_from_args(_parse("--kv-dtype", "int4"))["cache"]["kv_dtype"] == "int4"
    assert engine_config(CFG, overrides_from_args(_parse("--kv-dtype", "fp8"))).cache.kv_dtype == "fp8"
    assert engine_config(CFG, overrides_from_args(_parse("--kv-dtype", "int8"))).cache.kv_dtype == "int8"
    assert engine_config(CFG).cache.kv_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        _parse("--kv-dtype", "int2")
    err = capsys.readouterr().err
    assert "--kv-dtype" in err and "'bfloat16', 'fp8', 'int8', 'int4'" in err
    with pytest.raises(ConfigError, match=r"cache.kv_dtype \(--kv-dtype\) 'int2'.*choices: bfloat16, fp8, int8, int4"):
        engine_config(CFG, {"cache": {"kv_dtype": "int2"}})


def test_pool_is_sized_by_compressed_bytes():
    free = 1 << 30
    pages = {f: resolve(engine_config(CFG, {"cache": {"kv_dtype": f}}), free_bytes=free, on_gpu=False).cache.num_pages
             for f in ("bfloat16", "fp8", "int8", "int4")}
    for f, n in pages.items():     # the pool takes the KV share (less the sampler's penalty slots) in whole pages
        assert 0.95 * free * 0.9 < n * bytes_per_token(CFG, kv_dtype=f) * 16 <= free * 0.9
    assert pages["fp8"] / pages["bfloat16"] == pytest.approx(256 / 144, rel=1e-3)     # 64 values: 128 B -> 64 + 8
    assert pages["int8"] == pages["fp8"]                                                # the same bytes
    assert pages["int4"] / pages["bfloat16"] == pytest.approx(256 / 80, rel=1e-3)     # 64 values: 128 B -> 32 + 8


def test_formats_the_device_cannot_serve_fail_at_start():
    small = CFG.replace(head_dim=32)
    with pytest.raises(ConfigError, match=r"--kv-dtype int4 needs head_dim a multiple of 64.*choices"):
        resolve(engine_config(small, {"cache": {"kv_dtype": "int4"}}), free_bytes=None, on_gpu=False)
    with pytest.raises(ConfigError, match=r"--kv-dtype / cache.kv_dtype 'fp8_page' cannot be served on this GPU"):
        resolve(engine_config(CFG, {"cache": {"kv_dtype": "fp8_page"}}), free_bytes=1 << 30, on_gpu=True)
    with pytest.raises(ConfigError, match=r"'fp8' cannot be served on this GPU.*float32.*choices here: bfloat16 \("):
        resolve(engine_config(CFG.replace(dtype="float32"), {"cache": {"kv_dtype": "fp8"}}), free_bytes=1 << 30,
                on_gpu=True)
    for f in ("int4", "int8"):
        with pytest.raises(ConfigError, match=rf"'{f}' cannot be served.*head_dim 64 or 128.*choices here: bfloat16, "
                                              r"fp8, fp8r \(all: bfloat16, fp8, int8, int4, kivi64, fp8r\)"):
            resolve(engine_config(CFG.replace(head_dim=256), {"cache": {"kv_dtype": f}}), free_bytes=1 << 30,
                    on_gpu=True)
    with pytest.raises(ConfigError, match=r"'kivi64' cannot be served on this GPU: no attention kernel reads it yet"):
        resolve(engine_config(CFG, {"cache": {"kv_dtype": "kivi64", "page_size": 64}}), free_bytes=1 << 30,
                on_gpu=True)
    with pytest.raises(ConfigError, match=r"kivi64 needs pages of 64.*--page-size\) is 16"):
        engine_config(CFG, {"cache": {"kv_dtype": "kivi64", "page_size": 16}})
    for f in ("kivi64", "fp8r"):                # pages of 64 where the page size is not given
        assert engine_config(CFG, {"cache": {"kv_dtype": f}}).cache.page_size == 64
        assert engine_config(CFG, {"cache": {"kv_dtype": f, "page_size": None}}).cache.page_size == 64
    assert engine_config(CFG, {"cache": {"kv_dtype": "fp8"}}).cache.page_size == 16
    with pytest.raises(ConfigError, match=r"kivi64 needs a token budget \(the largest of --token-buckets.*got 48"):
        resolve(engine_config(CFG, {"cache": {"kv_dtype": "kivi64", "page_size": 64},
                                    "batcher": {"token_buckets": [16, 48]}}), free_bytes=None, on_gpu=False)
    for f in ("fp8", "int8", "int4"):          # the kernels serve them on a GPU
        resolve(engine_config(CFG, {"cache": {"kv_dtype": f}}), free_bytes=1 << 30, on_gpu=True)
    resolve(engine_config(CFG, {"cache": {"kv_dtype": "fp8r"}}), free_bytes=1 << 30, on_gpu=True)


def _engine(fmt, tight):
    cache = CacheConfig(page_size=8, num_pages=25 if tight else 64, max_pages_per_seq=12, kv_dtype=fmt)
    return make_engine(cache, BatcherConfig(token_buckets=(32,), max_seqs=12, predict_memory=not tight), cfg=CFG)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_batch_invariance_with_swapping(fmt):
    tight, roomy = _engine(fmt, tight=True), _engine(fmt, tight=False)
    assert f"KV cache ({fmt}): 24 pages" in tight.capacity_line()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, rng.integers(3, 30))] for _ in range(12)]
    params = [SamplingParams.greedy(max_tokens=int(n), ignore_eos=True) for n in rng.integers(20, 50, 12)]
    outs = tight.generate(prompts, params)
    assert tight.preemptions > 0 and tight.pages_used == 0
    for p, sp, o in zip(prompts, params, outs):
        assert o.token_ids == roomy.generate([p], sp)[0].token_ids


def test_logits_close_to_the_unquantized_cache():
    """Unscaled random weights (the engine tests' x10 weights make attention nearly one-hot, which amplifies any
    change of K): every sequence's last logits through the engine's layer programs."""
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 256, n).tolist() for n in (90, 40, 7)]
    off, meta_seqs = 1, []
    for s in seqs:
        n = -(-len(s) // 8)
        meta_seqs.append((list(range(off, off + n)), 0, len(s)))
        off += n
    meta = build_metadata(meta_seqs, 160, 3, 12, 8)
    tokens = np.zeros(160, np.int32)
    tokens[:sum(map(len, seqs))] = np.concatenate(seqs)
    logits = {}
    mesh = make_mesh(1)
    for f in ("bfloat16", "fp8", "int8", "int4"):
        cfg = EngineConfig(CFG, CacheConfig(page_size=8, num_pages=40, max_pages_per_seq=12, kv_dtype=f),
                           BatcherConfig(token_buckets=(16,), max_seqs=4))
        # The engine's Runner, set up as Engine does at TP 1, without compiling its step programs: Runner.logits
        # compiles its own program (the layer-program code) and reads none of them (they took ~2/3 of the time).
        model = LlamaModel(CFG, nnx.Rngs(0))
        shard_model(model, mesh)
        logits[f] = np.asarray(Runner(model, cfg, mesh).logits(tokens, meta), np.float32)
    ref = logits["bfloat16"]
    for f, tol in (("fp8", 0.05), ("int8", 0.02), ("int4", 0.15)):       # measured 0.025, 0.007 and 0.087
        err = np.linalg.norm(logits[f] - ref) / np.linalg.norm(ref - ref.mean(-1, keepdims=True))
        assert err < tol, (f, err)
        assert (logits[f].argmax(-1) == ref.argmax(-1)).all(), f


@pytest.mark.parametrize("fmt", ["kivi64", "fp8r"])
def test_tail_formats_batch_invariance_under_budget_chunking(fmt):
    """kivi64 and fp8r (the filling group of 64 K positions in a tail row by sequence; docs/design.md 14.1, 14.3):
    a budget of 68 chunks the prompts, decodes crowd the prefills (some decodes sit a step out so a prefill gets a
    whole group), pages tight enough to swap sequences (tail rows with them), and the prefix cache on; every
    non-final chunk ends at a multiple of 64, and each prompt's greedy tokens equal its own run alone on the same
    engine (then with prefix hits). A page holding generated positions is not shared: decodes wrote it seeing
    their group unquantized, which a prefill of the same tokens does not."""
    cache = CacheConfig(page_size=64, num_pages=9, max_pages_per_seq=4, kv_dtype=fmt)
    engine = make_engine(cache, BatcherConfig(token_buckets=(68,), max_seqs=8, predict_memory=False), cfg=CFG)
    b = engine.batcher
    b.LONGEST_FIRST = False                 # the short prompts first: their decodes crowd the long ones' chunks
    chunks, made = [], []
    form, make_room = b.next_batch, b._make_room

    def next_batch(slots):
        batch = form(slots)
        if batch is not None:
            chunks.extend((s.start + s.num_tokens, s.req.prompt_len) for s in batch.seqs[batch.num_decode:])
        return batch

    b.next_batch = next_batch
    b._make_room = lambda *a: made.append(make_room(*a)) or made[-1]
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 9, 3, 12, 7, 6, 130, 100, 70)]
    prompts.append(prompts[6][:80] + [int(t) for t in rng.integers(0, 256, 20)])     # shares a page with one
    params = [SamplingParams.greedy(max_tokens=n, ignore_eos=True) for n in (30, 40, 35, 30, 70, 25, 20, 30, 25, 15)]
    outs = engine.generate(prompts, params)
    assert engine.preemptions > 0 and engine.runner.tails.rows_swapped > 0 and engine.pages_used == 0
    assert True in made and any(end < n for end, n in chunks)
    assert all(end == n or end % 64 == 0 for end, n in chunks), chunks
    hits = b.stats.hit_tokens_gpu
    for p, sp, o in zip(prompts, params, outs):
        assert o.token_ids == engine.generate([p], sp)[0].token_ids
    assert b.stats.hit_tokens_gpu > hits
    x, sp = prompts[4] + outs[4].token_ids + [1, 2, 3], SamplingParams.greedy(max_tokens=8, ignore_eos=True)
    hits = b.stats.hit_tokens_gpu
    first = engine.generate([x], sp)[0].token_ids
    assert b.stats.hit_tokens_gpu == hits              # its first page holds generated positions: not shared
    assert engine.generate([x], sp)[0].token_ids == first and b.stats.hit_tokens_gpu == hits + 64
    # a forward outside the step programs (Runner.logits, the accuracy bench): fp8r's prefill copy holds every
    # row's whole table, since no batcher bounded its pages (kivi64 reads no copy)
    meta = build_metadata([([1], 0, 3)], 16, 2, 4, 64)
    assert engine.runner.whole_table_opts(meta).prefill_copy_pages == (2 * 4 if fmt == "fp8r" else 0)
