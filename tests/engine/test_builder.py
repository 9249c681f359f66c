"""The engine builder: flags and JSON files to one EngineConfig, automatic sizes, clear errors."""
import argparse
import json

import pytest

from nfjax.config import ConfigError
from nfjax.engine import Engine
from nfjax.engine.builder import add_engine_args, engine_config, overrides_from_args, resolve
from nfjax.errors import UserError
from tests.engine.conftest import TINY


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_flags_override_the_json_file(tmp_path):
    f = tmp_path / "engine.json"
    f.write_text(json.dumps({"cache": {"page_size": 8, "num_pages": 40}, "batcher": {"max_seqs": 4},
                             "execution": {"strategies": ["dual_batch:1-1"]}}))
    ov = overrides_from_args(_parse("--engine-config", str(f), "--max-seqs", "6", "--token-buckets", "32,16"))
    cfg = engine_config(TINY, ov)
    assert (cfg.cache.page_size, cfg.cache.num_pages, cfg.batcher.max_seqs) == (8, 40, 6)
    assert cfg.batcher.token_buckets == (16, 32)
    assert [s.label for s in cfg.execution.strategies] == ["dual_batch:1-1"]


def test_plan_flag_is_a_nanoflow_strategy():
    ov = overrides_from_args(_parse("--plan", "llama3-8b_h100_tp1_beside_mact", "--strategy-min-decode", "128"))
    (s,) = engine_config(TINY, ov).execution.strategies
    assert (s.kind, s.plan, s.min_decode) == ("nanoflow", "llama3-8b_h100_tp1_beside_mact", 128)


def test_automatic_sizes():
    cfg = resolve(engine_config(TINY, {"cache": {"page_size": 8}}), free_bytes=None, on_gpu=False)
    assert cfg.cache.num_pages == 512 and cfg.cache.max_pages_per_seq == TINY.max_position_embeddings // 8
    assert cfg.batcher.token_buckets == (1, 16, 256) and cfg.batcher.max_seqs == 256
    gpu = resolve(engine_config(TINY), free_bytes=1 << 30, on_gpu=True)
    per_page = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4 * 16     # f32 K and V, 16 positions
    penalties = 1024 * TINY.vocab_size * 3      # a penalty slot per sequence: int16 counts + bool prompt flags
    assert gpu.cache.num_pages == (int((1 << 30) * 0.9) - penalties) // per_page
    assert gpu.batcher.token_buckets[0] == 16 and gpu.batcher.max_seqs == 1024
    assert gpu.batcher.seqs_for(16) == 16 and gpu.batcher.seqs_for(2048) == 1024
    # a prefill bucket above the token buckets on a GPU only, unless the buckets already reach it
    assert cfg.batcher.prefill_bucket == 0 and cfg.batcher.all_buckets == (1, 16, 256)
    assert gpu.batcher.prefill_bucket == 8192 and gpu.batcher.all_buckets[-2:] == (2048, 8192)
    assert gpu.batcher.prefill_seqs_for(8192) == 64 and gpu.batcher.prefill_seqs_for(2048) == 16
    wide = resolve(engine_config(TINY, {"batcher": {"token_buckets": [16, 8192]}}), free_bytes=1 << 30, on_gpu=True)
    assert wide.batcher.prefill_bucket == 0
    flag = overrides_from_args(_parse("--prefill-bucket", "4096"))
    assert resolve(engine_config(TINY, flag), free_bytes=None, on_gpu=False).batcher.prefill_bucket == 4096


@pytest.mark.parametrize("overrides,match", [
    ({"cache": {"page_sise": 8}}, "cache.page_sise"),
    ({"caches": {}}, "unknown section 'caches'"),
    ({"cache": {"num_pages": 1}}, "cache.num_pages"),
    ({"batcher": {"token_buckets": [0, 16]}}, "token_buckets"),
    ({"execution": {"strategies": [{"kind": "nanoflow"}]}}, "plan is required"),
])
def test_bad_settings_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        engine_config(TINY, overrides)


def test_bad_engine_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no such"):
        overrides_from_args(_parse("--engine-config", str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        overrides_from_args(_parse("--engine-config", str(bad)))


def test_from_pretrained_refuses_an_unknown_setting():
    with pytest.raises(UserError, match="max_seq"):
        Engine.from_pretrained(max_seq=4)


def test_compile_cache_a_second_start_compiles_nothing_and_generate_prints_the_tier_rule(tmp_path):
    """`--compile-cache DIR`: the first `nfjax generate` writes its programs there, a second identical one finds
    every program (no new entry) and prints the same text. With a host tier (here in both runs, so the tier's
    programs are cached too), the CLI says at start which tiers beat recomputing here and at what rates.
    (One test for both: each `nfjax generate` start compiles the engine; one token bucket, not the CPU's default
    three: every program goes through the cache alike, and one bucket compiles in about half the time.)"""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cache = tmp_path / "xla"
    # a cold start: without the test run's shared cache (tests/conftest.py), which would hold the first run's
    # programs before --compile-cache is read
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}

    def run():
        p = subprocess.run([sys.executable, "-m", "nfjax.cli", "generate", "--compile-cache", str(cache),
                            "--host-cache-gb", "0.01", "--token-buckets", "16", "--max-tokens", "6", "--temperature",
                            "0", "Hello"], cwd=root,
                           capture_output=True, text=True, timeout=600, env={**env, "JAX_PLATFORMS": "cpu"})
        assert p.returncode == 0, p.stderr[-2000:]
        line = next(x for x in p.stderr.splitlines() if x.startswith("[prefix tiers:"))
        assert "recomputes in" in line and "from host" in line and "host rows: numpy" in line
        return p.stdout, sorted(os.listdir(cache))
    out1, files1 = run()
    out2, files2 = run()
    assert len(files1) > 5 and files2 == files1 and out2 == out1


def test_compile_cache_flag_is_an_execution_setting():
    assert overrides_from_args(_parse("--compile-cache", "/tmp/x")) == {"execution": {"compile_cache_dir": "/tmp/x"}}


def test_xla_remat_flag_is_an_execution_setting():
    assert overrides_from_args(_parse("--xla-remat")) == {"execution": {"xla_remat": True}}
    assert engine_config(TINY, overrides_from_args(_parse())).execution.xla_remat is False


def test_kernel_lowering_cache_flag_is_an_execution_setting():
    assert overrides_from_args(_parse("--kernel-lowering-cache")) == {"execution": {"kernel_lowering_cache": True}}
    assert engine_config(TINY, overrides_from_args(_parse())).execution.kernel_lowering_cache is False
