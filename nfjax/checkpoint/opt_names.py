"""Hugging Face OPT (`OPTForCausalLM`, model_type opt): config.json -> ModelConfig fields, tensor names -> nfjax
parameter paths. JAX-free (nfjax.config imports it).

HF stores `model.decoder.layers.{i}.self_attn.q_proj.weight` ([out, in]) and friends; nfjax's OPT layer
(nfjax/models/opt.py) keeps the Llama layer's module names where the role is the same (q/k/v_proj, o_proj for
out_proj, up_proj for fc1, down_proj for fc2, input_norm / post_norm for the two LayerNorms), so tensor
parallelism shards OPT's weights by the same rules. The learned position table has OPT's 2 extra rows.
"""
from __future__ import annotations

import re

from nfjax.checkpoint.hf_names import Target, hf_shape  # noqa: F401 - the same Target / hf_shape as Llama's

EMBED = "model.decoder.embed_tokens.weight"
POSITIONS = "model.decoder.embed_positions.weight"
LM_HEAD = "lm_head.weight"
POSITION_OFFSET = 2            # OPT's learned positions start at row 2 of the table (fairseq's padding rows)

_LAYER = {
    "self_attn_layer_norm.weight": (("input_norm", "scale"), False),
    "self_attn_layer_norm.bias": (("input_norm", "bias"), False),
    "self_attn.q_proj.weight": (("q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("v_proj", "kernel"), True),
    "self_attn.q_proj.bias": (("q_proj", "bias"), False),
    "self_attn.k_proj.bias": (("k_proj", "bias"), False),
    "self_attn.v_proj.bias": (("v_proj", "bias"), False),
    "self_attn.out_proj.weight": (("o_proj", "kernel"), True),
    "self_attn.out_proj.bias": (("o_proj", "bias"), False),
    "final_layer_norm.weight": (("post_norm", "scale"), False),
    "final_layer_norm.bias": (("post_norm", "bias"), False),
    "fc1.weight": (("up_proj", "kernel"), True),
    "fc1.bias": (("up_proj", "bias"), False),
    "fc2.weight": (("down_proj", "kernel"), True),
    "fc2.bias": (("down_proj", "bias"), False),
}
_GLOBAL = {
    EMBED: (("embed", "embedding"), False),
    POSITIONS: (("positions", "embedding"), False),
    "model.decoder.final_layer_norm.weight": (("norm", "scale"), False),
    "model.decoder.final_layer_norm.bias": (("norm", "bias"), False),
    LM_HEAD: (("lm_head", "kernel"), True),
}
_LAYER_RE = re.compile(r"^model\.decoder\.layers\.(\d+)\.(.+)$")


def is_ignored(name: str) -> bool:
    return False


def parse(name: str) -> Target | None:
    if name in _GLOBAL:
        path, tr = _GLOBAL[name]
        return Target(path, None, tr)
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        path, tr = _LAYER[m.group(2)]
        return Target(("layers",) + path, int(m.group(1)), tr)
    return None


def expected_names(cfg) -> list[str]:
    names = [EMBED, POSITIONS, "model.decoder.final_layer_norm.weight", "model.decoder.final_layer_norm.bias"]
    names += [] if cfg.tie_word_embeddings else [LM_HEAD]
    names += [f"model.decoder.layers.{i}.{s}" for i in range(cfg.num_layers) for s in _LAYER]
    return names


def opt_config_fields(hf: dict) -> dict:
    """ModelConfig keyword arguments from an OPT config.json; a feature nfjax's OPT does not have is a
    ConfigError naming the field."""
    from nfjax.config import ConfigError

    def need(field: str, want, default, why: str):
        got = hf.get(field, default)
        if got != want:
            raise ConfigError(f"config.json: {field}={got!r} is not supported for OPT ({why}); nfjax runs "
                              f"{field}={want!r}")

    need("do_layer_norm_before", True, True, "post-norm layers, as OPT-350m's")
    need("activation_function", "relu", "relu", "the MLP is ReLU")
    need("enable_bias", True, True, "every projection has a bias")
    need("layer_norm_elementwise_affine", True, True, "the LayerNorms have a scale and a bias")
    need("_remove_final_layer_norm", False, False, "the decoder ends with its final LayerNorm")
    try:
        d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        kw = dict(vocab_size=int(hf["vocab_size"]), hidden_size=d, intermediate_size=int(hf["ffn_dim"]),
                  num_layers=int(hf["num_hidden_layers"]), num_heads=h,
                  max_position_embeddings=int(hf["max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"config.json: missing field {e.args[0]!r}") from None
    proj = hf.get("word_embed_proj_dim", d)
    if proj != d:
        raise ConfigError(f"config.json: word_embed_proj_dim={proj} differs from hidden_size={d} (OPT-350m's "
                          "project_in/project_out); nfjax's OPT needs them equal")
    if d % h:
        raise ConfigError(f"config.json: hidden_size={d} is not a multiple of num_attention_heads={h}")
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype = "bfloat16" if hf.get("torch_dtype", hf.get("dtype")) == "bfloat16" else "float32"
    return dict(**kw, num_kv_heads=h, head_dim=d // h, rms_norm_eps=1e-5,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), qkv_bias=True, model_type="opt",
                bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids, dtype=dtype)
