"""Mixtral and Qwen2-MoE against HF transformers (torch, CPU, f32), through the real conversion path: a small
random model is saved with `save_pretrained` (per-expert safetensors names), converted with `nfjax convert` and
loaded; then
  - the reference forward's logits (the MoE layer's own ops) over the prompt and every generated position:
    max |ours - hf| / max |hf| <= 1e-3;
  - 64 greedy tokens of the reference forward and of the paged engine (Engine.generate: prefill, then one decode
    a step) equal HF's `generate(do_sample=False)` with eos disabled.
The routers get a large random init (Qwen2-MoE's starts at zero: every expert tied), so top-k choices are not
near-ties. Also: MoE config features nfjax does not run are a ConfigError naming the config.json field.
"""
from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nfjax.checkpoint.convert import convert  # noqa: E402
from nfjax.checkpoint.orbax_io import load_model  # noqa: E402
from nfjax.config import ModelConfig  # noqa: E402
from nfjax.models.moe import MoEModel  # noqa: E402
from tests.models.test_hf_parity import assert_config_refused, assert_matches_hf  # noqa: E402

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               initializer_range=0.2, max_position_embeddings=256, num_experts_per_tok=2)
CASES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=4, sliding_window=None)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=4, norm_topk_prob=False,
                                         tie_word_embeddings=False)),
}


def _hf_moe(tmp_path, name):
    cls_name, overrides = CASES[name]
    torch.manual_seed(sorted(CASES).index(name))
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls_name)(**{**_COMMON, **overrides})).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn_like(p) * 0.5)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    return model, hf_dir


@pytest.mark.parametrize("name", list(CASES))
def test_moe_hf_parity(name, tmp_path):
    hf, hf_dir = _hf_moe(tmp_path, name)
    cfg = convert(hf_dir, tmp_path / "nfjax", progress=False)
    assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    model = load_model(tmp_path / "nfjax")
    assert isinstance(model, MoEModel)

    assert_matches_hf(model, hf)


_MIXTRAL = {**_COMMON, "model_type": "mixtral", "intermediate_size": 64, "num_local_experts": 4}
_QWEN = {**_COMMON, "model_type": "qwen2_moe", "intermediate_size": 96, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "num_experts": 4}


@pytest.mark.parametrize("base,field,value", [
    (_QWEN, "decoder_sparse_step", 2), (_QWEN, "mlp_only_layers", [1]), (_QWEN, "use_sliding_window", True),
    (_QWEN, "layer_types", ["sliding_attention", "full_attention"]), (_QWEN, "shared_expert_intermediate_size", 0),
    (_MIXTRAL, "sliding_window", 128), (_MIXTRAL, "num_experts_per_tok", 5), (_MIXTRAL, "hidden_act", "gelu")])
def test_unsupported_moe_config_names_the_field(tmp_path, base, field, value):
    assert_config_refused({**base, field: value}, field, tmp_path)


def test_moe_config_fields():
    mix, qw = ModelConfig.from_hf(_MIXTRAL), ModelConfig.from_hf(_QWEN)
    assert (mix.num_experts, mix.moe_intermediate_size, mix.shared_expert_intermediate_size, mix.norm_topk_prob,
            mix.qkv_bias) == (4, 64, 0, True, False)
    assert (qw.num_experts, qw.moe_intermediate_size, qw.shared_expert_intermediate_size, qw.norm_topk_prob,
            qw.qkv_bias) == (4, 32, 48, False, True)
    assert ModelConfig.from_json(qw.to_json()) == qw
    # active parameters: the top-2 of 4 experts' FFNs per layer
    assert mix.num_params() - mix.num_active_params() == 2 * 2 * 3 * 64 * 64


def test_moe_gguf_is_refused():
    from pathlib import Path
    from nfjax.checkpoint.convert import ConversionError
    from nfjax.checkpoint.gguf_convert import hf_config
    meta = {"general.architecture": "llama", "llama.expert_count": 8, "llama.embedding_length": 64,
            "llama.attention.head_count": 4}
    with pytest.raises(ConversionError, match="expert_count=8"):
        hf_config(meta, set(), Path("mixtral.gguf"))
