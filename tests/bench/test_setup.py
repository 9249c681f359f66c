"""bench/setup.py: the bench flags are the product's engine flags plus the model's, and a bench's own sizes
fill only what the flags leave unset."""
from __future__ import annotations

import argparse

import pytest

from bench.setup import add_bench_args, bench_overrides, config_record, engine_flags, model_config, setting
from nfjax.engine.builder import engine_config, resolve


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_bench_args(ap)
    return ap.parse_args(list(argv))


def test_defaults_are_the_builders():
    a = _args("--shape", "smoke")
    assert bench_overrides(a) == {} and engine_flags(a) == {"shape": "smoke"}
    cfg = resolve(engine_config(model_config(a), bench_overrides(a)), None, on_gpu=False)
    assert cfg.cache.num_pages == 512 and cfg.batcher.token_buckets == (1, 16, 256)    # a CPU's sizes
    assert setting(a, "cache", "page_size") == 16 and setting(a, "batcher", "max_seqs") is None
    assert config_record(cfg)["batcher"]["max_seqs"] == 256


def test_bench_sizes_fill_only_what_the_flags_leave_unset():
    a = _args("--shape", "smoke", "--layers", "1", "--token-buckets", "32,64", "--plan", "p.json")
    ov = bench_overrides(a, context=80, defaults={"batcher": {"token_buckets": (2048,), "max_seqs": 8}},
                         extra={"parallel": {"tp": 2}})
    assert ov["batcher"] == {"token_buckets": (32, 64), "max_seqs": 8}
    assert ov["cache"] == {"max_model_len": 80} and ov["parallel"] == {"tp": 2}
    assert [s.plan for s in ov["execution"]["strategies"]] == ["p.json"]
    assert model_config(a).num_layers == 1
    sized = bench_overrides(_args("--max-pages-per-seq", "9"), context=80)
    assert sized["cache"] == {"max_pages_per_seq": 9}            # the flags size the page table: no context
    cfg = resolve(engine_config(model_config(a), ov), None, on_gpu=False)
    assert cfg.cache.max_pages_per_seq == 5                      # 80 positions in pages of 16


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(SystemExit, match="--shape"):
        model_config(_args("--shape", "llama9"))
