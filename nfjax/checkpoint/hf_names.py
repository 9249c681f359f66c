"""Hugging Face Llama-family tensor names -> nfjax parameter paths.

HF stores one tensor per layer (`model.layers.{i}.self_attn.q_proj.weight`, Linear weights as [out, in]); nfjax
stacks every per-layer parameter on a leading layer axis (`layers.q_proj.kernel` [L, in, out]). Llama-2/3,
Mistral, Qwen2 and DeepSeek-67B (llama arch) all use the same names; Qwen2 adds q/k/v biases.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from nfjax.config import ModelConfig

# Buffers some checkpoints ship that are not parameters (nfjax recomputes RoPE frequencies from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"

# HF name (after `model.layers.{i}.`) -> (nfjax path under `layers`, transpose)
_LAYER = {
    "input_layernorm.weight": (("input_norm", "scale"), False),
    "self_attn.q_proj.weight": (("q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("v_proj", "kernel"), True),
    "self_attn.q_proj.bias": (("q_proj", "bias"), False),
    "self_attn.k_proj.bias": (("k_proj", "bias"), False),
    "self_attn.v_proj.bias": (("v_proj", "bias"), False),
    "self_attn.o_proj.weight": (("o_proj", "kernel"), True),
    "post_attention_layernorm.weight": (("post_norm", "scale"), False),
    "mlp.gate_proj.weight": (("gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("down_proj", "kernel"), True),
}
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")

_GLOBAL = {
    EMBED: (("embed", "embedding"), False),
    "model.norm.weight": (("norm", "scale"), False),
    LM_HEAD: (("lm_head", "kernel"), True),
}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: `path` in the nfjax param dict, `layer` index into the stacked axis (None for
    unstacked params), whether the HF array is transposed ([out, in] -> [in, out]), and `expert`: the index into
    a second stacked axis (a MoE layer's experts, nfjax/checkpoint/moe_names.py), None for the rest."""
    path: tuple[str, ...]
    layer: int | None
    transpose: bool
    expert: int | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """The index of this tensor in its stacked parameter."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def is_ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES)


def parse(name: str) -> Target | None:
    """The target of an HF tensor name, or None when nfjax has no such parameter (ignored names included)."""
    if name in _GLOBAL:
        path, tr = _GLOBAL[name]
        return Target(path, None, tr)
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        path, tr = _LAYER[m.group(2)]
        return Target(("layers",) + path, int(m.group(1)), tr)
    return None


def expected_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor a checkpoint of `cfg` must hold, in a stable order (globals, then layer by layer).

    `lm_head.weight` is left out for tied embeddings (such checkpoints may or may not ship it).
    """
    names = [EMBED, "model.norm.weight"] + ([] if cfg.tie_word_embeddings else [LM_HEAD])
    suffixes = [s for s in _LAYER if cfg.qkv_bias or s not in _BIASES]
    names += [f"model.layers.{i}.{s}" for i in range(cfg.num_layers) for s in suffixes]
    return names


def for_model(cfg: ModelConfig):
    """The naming module of `cfg`'s architecture: this one for the Llama family, `opt_names` for OPT,
    `moe_names` for Mixtral / Qwen2-MoE (all have EMBED, LM_HEAD, is_ignored, parse, expected_names)."""
    if cfg.model_type == "opt":
        from nfjax.checkpoint import opt_names
        return opt_names
    if cfg.num_experts:
        from nfjax.checkpoint import moe_names
        return moe_names
    import sys
    return sys.modules[__name__]


def hf_shape(target: Target, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape that fills `target` of an nfjax parameter of shape `param_shape`."""
    shape = param_shape[len(target.index):]
    return tuple(reversed(shape)) if target.transpose else tuple(shape)
