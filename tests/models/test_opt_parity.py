"""OPT against HF transformers' OPTForCausalLM (torch, CPU), through the real conversion path (`nfjax convert
--hf`): a small random OPT is saved with `save_pretrained`, converted and loaded; then
  - the reference forward's logits (nfjax.models.reference, the OPT layer's own ops) over the prompt and every
    generated position: max |ours - hf| / max |hf| <= 1e-3 in float32;
  - 64 greedy tokens of the reference forward and of the paged engine (prefill, then one decode a step) equal
    HF's `generate(do_sample=False)` with eos disabled.
Also: config features nfjax's OPT lacks are a ConversionError naming the config.json field.
"""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nfjax.checkpoint.convert import convert  # noqa: E402
from nfjax.checkpoint.orbax_io import load_model  # noqa: E402
from nfjax.config import ModelConfig  # noqa: E402
from nfjax.models.opt import OPTModel  # noqa: E402
from tests.models.test_hf_parity import assert_config_refused, assert_matches_hf  # noqa: E402

_SMALL = dict(vocab_size=384, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, word_embed_proj_dim=64, init_std=0.2)
CASES = {"opt-tied": {}, "opt-untied-3layers": dict(tie_word_embeddings=False, num_hidden_layers=3)}


def _hf_opt(tmp_path, seed: int, **overrides):
    torch.manual_seed(seed)
    cfg = transformers.OPTConfig(**{**_SMALL, **overrides})
    model = transformers.OPTForCausalLM(cfg).float().eval()
    # OPT's init zeroes the biases and sets the LayerNorms to (1, 0): randomize them so parity covers them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    return model, hf_dir


@pytest.mark.parametrize("name", list(CASES))
def test_opt_hf_parity(name, tmp_path):
    hf, hf_dir = _hf_opt(tmp_path, sorted(CASES).index(name), **CASES[name])
    out = tmp_path / "nfjax"
    cfg = convert(hf_dir, out, progress=False)
    assert cfg.model_type == "opt" and cfg.num_params() == sum(p.numel() for p in hf.parameters())
    model = load_model(out)
    assert isinstance(model, OPTModel) and (model.lm_head is None) == hf.config.tie_word_embeddings

    assert_matches_hf(model, hf)


@pytest.mark.parametrize("field,value", [("do_layer_norm_before", False), ("word_embed_proj_dim", 32),
                                         ("activation_function", "gelu"), ("enable_bias", False)])
def test_unsupported_opt_config_names_the_field(tmp_path, field, value):
    assert_config_refused({**_SMALL, "model_type": "opt", field: value}, field, tmp_path)


def test_opt_tensor_parallel_gives_the_tp1_tokens():
    """OPT's modules carry the Llama layer's names, so TP shards them by the same rules; its o_proj / fc2 biases
    are added after the all-reduce (once, not once per device)."""
    from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, ParallelConfig
    from nfjax.engine import Engine, SamplingParams
    from nfjax.models.random_init import random_model
    from nfjax.tokenizer.silent import SilentTokenizer
    cfg = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=4, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
                      qkv_bias=True, model_type="opt")
    prompts = [np.random.default_rng(i).integers(3, 320, 5 + 4 * i).tolist() for i in range(3)]
    outs = []
    for tp in (1, 2):
        m = _random_biases(random_model(cfg, seed=1, std=0.25, host=True))
        eng = Engine(m, SilentTokenizer(cfg.vocab_size), EngineConfig(
            cfg, CacheConfig(page_size=16, num_pages=32, max_pages_per_seq=4),
            BatcherConfig(token_buckets=(16,), max_seqs=4), ParallelConfig(tp=tp)))
        outs.append([o.token_ids for o in eng.generate(prompts, SamplingParams.greedy(max_tokens=12,
                                                                                       ignore_eos=True))])
    assert outs[0] == outs[1]


def _random_biases(m):
    """random_model zeroes biases; the TP test must see them."""
    import jax
    from flax import nnx
    state = nnx.state(m, nnx.Param)
    rng = np.random.default_rng(0)
    pure = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype) if str(getattr(p[-1], "key", p[-1])) == "bias"
        else x, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(m, state)
    return m
