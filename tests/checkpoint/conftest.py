"""Tiny HF checkpoints (written by transformers' save_pretrained) for the conversion tests."""
from __future__ import annotations

import shutil

import pytest

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def save_tiny(path, dtype="float32", max_shard_size=None, **overrides):
    """Save a random tiny Llama (HF) to `path` (sharded when `max_shard_size` is given); returns the model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


@pytest.fixture(scope="session")
def _tiny_hf_master(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hf") / "hf"
    save_tiny(path)
    return path


@pytest.fixture
def tiny_hf(_tiny_hf_master, tmp_path):
    """A private copy of a tiny float32 Llama checkpoint at tmp_path/hf (single model.safetensors)."""
    dst = tmp_path / "hf"
    shutil.copytree(_tiny_hf_master, dst)
    return dst


@pytest.fixture
def save_hf():
    """`save_hf(path, dtype="float32", max_shard_size=None, **config_overrides)`: save another tiny HF Llama."""
    return save_tiny
