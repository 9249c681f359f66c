"""Parity with HF transformers (torch, CPU), a peer implementation, through the real conversion path.

For each supported architecture: build a small random model with transformers, `save_pretrained` it to
safetensors, convert it with `nfjax convert`, load the nfjax checkpoint, then compare
  - the logits of the reference forward (`nfjax.models.reference`, the one the engine tests and train-tiny use)
    with one HF forward over the same whole sequence (the prompt's positions, and every generated one):
    max |ours - hf| / max |hf| <= 1e-3 in float32;
  - 64 greedy tokens of the reference forward and of the engine (paged cache, prefill then decode steps):
    identical to HF `generate(do_sample=False)` with eos disabled.
Weights use a large init (initializer_range 0.2) so logits are well separated and greedy argmaxes are not
near-ties.
"""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nfjax import cli  # noqa: E402
from nfjax.checkpoint.orbax_io import load_model  # noqa: E402
from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, pages_for  # noqa: E402
from nfjax.engine import Engine, SamplingParams  # noqa: E402
from nfjax.models import reference  # noqa: E402
from nfjax.tokenizer.silent import SilentTokenizer  # noqa: E402

PROMPT_LEN = 12
NEW_TOKENS = 64
STEP_TOKENS = 16          # one static token budget for prefill and decode steps: one compile per model
PAGE_SIZE = 16
REL_TOL = 1e-3

_SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=256)
_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    # small enough that, with head_dim 16, frequencies fall in all three llama3 bands
                    original_max_position_embeddings=64)

# name -> (config class, config overrides, save_pretrained kwargs, rewrite config.json in the pre-v5 style)
CASES = {
    "llama2": ("LlamaConfig", dict(num_key_value_heads=4, rope_theta=10000.0, rms_norm_eps=1e-5), {}, False),
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, rms_norm_eps=1e-5), {}, False),
    "llama3.1-rope-scaling": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE), {}, True),
    "llama3.2-tied": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                                          tie_word_embeddings=True), {}, False),
    "mistral": ("MistralConfig", dict(rope_theta=1000000.0, sliding_window=None), {}, False),
    "qwen2-bias": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=False), {}, False),
    # DeepSeek-67B: llama arch, GQA 8:1, FFN ratio 2.6875, bos/eos at the end of the vocab; sharded safetensors
    "deepseek-67b-sharded": ("LlamaConfig", dict(vocab_size=512, num_hidden_layers=3, num_attention_heads=8,
                                                 num_key_value_heads=1, intermediate_size=172,
                                                 bos_token_id=500, eos_token_id=501),
                             dict(max_shard_size="100KB"), False),
}


def _legacy_config(path):
    """Rewrite a transformers-5 config.json the way Hub checkpoints of Llama-3.1 spell it (rope_theta +
    rope_scaling at top level, torch_dtype)."""
    d = json.loads(path.read_text())
    rp = d.pop("rope_parameters")
    d["rope_theta"] = rp.pop("rope_theta")
    d["rope_scaling"] = rp
    d["torch_dtype"] = d.pop("dtype")
    path.write_text(json.dumps(d))


def _hf_model(name, tmp_path):
    cls_name, overrides, save_kw, legacy = CASES[name]
    torch.manual_seed(sorted(CASES).index(name))
    cfg = getattr(transformers, cls_name)(**{**_SMALL, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir, **save_kw)
    if legacy:
        _legacy_config(hf_dir / "config.json")
    return model, hf_dir


def _convert(monkeypatch, *argv):
    # Only the subcommand under test is imported (others may not be importable in this checkout).
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"convert": "nfjax.checkpoint.convert"})
    return cli.main(["convert", *map(str, argv)])


def _engine_greedy(model, prompt: list[int]) -> list[int]:
    """The engine's greedy tokens: one sequence through the paged cache, a prefill then one decode per step."""
    cache = CacheConfig(page_size=PAGE_SIZE, num_pages=8,       # 112 slots >= PROMPT_LEN + NEW_TOKENS
                        max_pages_per_seq=pages_for(PROMPT_LEN + NEW_TOKENS, PAGE_SIZE))
    eng = Engine(model, SilentTokenizer(model.cfg.vocab_size), EngineConfig(
        model.cfg, cache, BatcherConfig(token_buckets=(STEP_TOKENS,), max_seqs=1)), take_weights=False)
    out, = eng.generate([prompt], SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True))
    return out.token_ids


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def assert_matches_hf(model, hf) -> None:
    """A random prompt's 64 greedy tokens (nfjax's reference forward, the engine, HF's generate) all equal, and
    the reference forward's logits over prompt + tokens within REL_TOL of HF's (the prompt's rows alone too)."""
    prompt = np.random.default_rng(0).integers(3, hf.config.vocab_size, PROMPT_LEN).tolist()
    ours_tokens = reference.greedy(model, prompt, NEW_TOKENS)
    engine_tokens = _engine_greedy(model, prompt)
    ours_logits = np.asarray(reference.logits(model, jnp.asarray([prompt + ours_tokens[:-1]]))[0])

    hf.generation_config.eos_token_id = None      # eos disabled: always NEW_TOKENS tokens
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
        hf_tokens = gen[0, PROMPT_LEN:].tolist()
        hf_logits = hf(torch.tensor([prompt + ours_tokens[:-1]])).logits[0].float().numpy()

    assert len(hf_tokens) == NEW_TOKENS
    err_prefill = _rel_err(ours_logits[:PROMPT_LEN], hf_logits[:PROMPT_LEN])
    err_all = _rel_err(ours_logits, hf_logits)
    assert err_prefill <= REL_TOL and err_all <= REL_TOL, (err_prefill, err_all)
    first_diff = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), None)
    assert ours_tokens == hf_tokens, f"greedy tokens differ from step {first_diff}"
    first_diff = next((i for i, (a, b) in enumerate(zip(engine_tokens, hf_tokens)) if a != b), None)
    assert engine_tokens == hf_tokens, f"the engine's greedy tokens differ from step {first_diff}"


def assert_config_refused(hf_config: dict, field: str, tmp_path) -> None:
    """An HF config.json nfjax does not support: a ConfigError naming `field` from `ModelConfig.from_hf`, and a
    UserError naming it from `nfjax convert`, which leaves no output folder."""
    from nfjax.checkpoint.convert import convert
    from nfjax.config import ConfigError, ModelConfig
    from nfjax.errors import UserError

    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(hf_config)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(UserError, match=field):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", list(CASES))
def test_hf_parity(name, tmp_path, monkeypatch):
    hf, hf_dir = _hf_model(name, tmp_path)
    if name.endswith("-sharded"):
        assert (hf_dir / "model.safetensors.index.json").exists()
    out = tmp_path / "nfjax"
    assert _convert(monkeypatch, "--hf", hf_dir, "--out", out, "--no-progress") == 0

    model = load_model(out)
    assert model.cfg.dtype == "float32"
    assert (model.lm_head is None) == hf.config.tie_word_embeddings
    assert model.cfg.qkv_bias == name.startswith("qwen2")

    assert_matches_hf(model, hf)
