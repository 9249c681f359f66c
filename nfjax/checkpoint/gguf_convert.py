"""`nfjax convert --gguf FILE`: a llama-architecture GGUF file -> an nfjax checkpoint folder.

The file is read with the `gguf` package (`pip install gguf`). Every tensor is dequantized (Q4_1, Q8_0, K-quants,
... through `gguf.quants.dequantize`) to float32, renamed to its Hugging Face name, and llama.cpp's row
permutation of `attn_q`/`attn_k` (done for its rotary layout) is reversed exactly as transformers' GGUF loader
reverses it. The model config comes from the `llama.*` metadata keys (tied embeddings when `output.weight` is
absent); the tokenizer (`tokenizer.ggml.*`, byte-level BPE) and the chat template (`tokenizer.chat_template`)
become `tokenizer.json` and `tokenizer_config.json`.

These are staged as an HF folder in a temp folder next to `--out` and handed to `nfjax.checkpoint.convert`, so the
checks, the dtype cast and the atomic write (temp folder renamed at the end) are the HF path's own.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import secrets
from pathlib import Path

from nfjax.checkpoint.convert import ConversionError
from nfjax.config import ModelConfig

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# GGUF tensor name (after `blk.{i}.`) -> HF name (after `model.layers.{i}.`)
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_IGNORED = ("rope_freqs.weight",)
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise ConversionError("reading GGUF files needs the `gguf` package: pip install gguf "
                              "(or pip install 'nfjax[smol]')") from None
    if not path.is_file():
        raise ConversionError(f"--gguf {path}: no such file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:                          # noqa: BLE001  (gguf raises ValueError, struct.error, ...)
        raise ConversionError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _meta(reader, path: Path) -> dict:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            out[name] = field.contents()
        except Exception as e:                      # noqa: BLE001
            raise ConversionError(f"{path}: metadata {name} is unreadable ({e})") from None
    return out


def hf_config(meta: dict, tensor_names: set[str], path: Path) -> dict:
    """An HF `config.json` (LlamaForCausalLM) from the GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path}: general.architecture is {arch!r}; nfjax converts llama GGUF files")

    def get(key, default=None, required=True):
        v = meta.get(f"llama.{key}", default)
        if v is None and required:
            raise ConversionError(f"{path}: metadata llama.{key} is missing")
        return v

    if int(get("expert_count", 0, required=False) or 0):
        raise ConversionError(f"{path}: llama.expert_count={meta['llama.expert_count']} (a mixture of experts, e.g. "
                              "Mixtral) is not supported from GGUF; convert its safetensors with --hf")
    d, h = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ConversionError(f"{path}: neither llama.vocab_size nor tokenizer.ggml.tokens is present")
        vocab = len(tokens)
    rope_dim = get("rope.dimension_count", required=False)
    if rope_dim is not None and int(rope_dim) != d // h:
        raise ConversionError(f"{path}: llama.rope.dimension_count={rope_dim} (partial rotary) is not supported")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(vocab), "hidden_size": d, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": h,
        "num_key_value_heads": int(get("attention.head_count_kv", h)), "head_dim": d // h,
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if get("rope.scaling.type", required=False) not in (None, "none"):
        raise ConversionError(f"{path}: llama.rope.scaling.type={meta['llama.rope.scaling.type']!r} is not supported")
    return cfg


def hf_name(name: str, path: Path) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLK.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    if name in _IGNORED:
        return None
    raise ConversionError(f"{path}: tensor {name} has no place in nfjax's llama model")


def reverse_permute(w, n_head: int):
    """Undo llama.cpp's rotary row permutation of attn_q (n_head heads) / attn_k (n_head = kv heads)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_tensors(reader, cfg: dict, path: Path) -> dict:
    """HF name -> float32 numpy array (dequantized, Q/K rows un-permuted)."""
    import numpy as np
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        name = hf_name(t.name, path)
        if name is None:
            continue
        try:
            x = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as e:
            raise ConversionError(f"{path}: tensor {t.name} of type {t.tensor_type.name} cannot be "
                                  f"dequantized ({e})") from None
        want = tuple(int(s) for s in reversed(t.shape))
        x = x.reshape(want)
        if ".attn_q." in t.name:
            x = reverse_permute(x, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            x = reverse_permute(x, cfg["num_key_value_heads"])
        out[name] = x
    return out


def tokenizer_files(meta: dict, path: Path) -> dict[str, dict]:
    """`tokenizer.json` and `tokenizer_config.json` (as dicts) from the `tokenizer.*` metadata.

    Byte-level BPE (`tokenizer.ggml.model` = gpt2) is built here, as transformers' GGUF loader builds it
    (GPT2Tokenizer: byte-level pre-tokenizer and decoder, tokens marked control added as special tokens); for
    other tokenizer models transformers' own GGUF converter is used when transformers is installed."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        return {}
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2" and meta.get("tokenizer.ggml.pre") not in (None, "default", "gpt2", "smollm"):
        kind = "transformers"              # a pre-tokenizer split of its own: transformers knows the regexes
    if kind == "gpt2":
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
        tok.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED])
        tokenizer_json = json.loads(tok.to_str())
    else:
        try:
            from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
        except ImportError:
            raise ConversionError(f"{path}: tokenizer.ggml.model={meta.get('tokenizer.ggml.model')!r} with "
                                  f"pre-tokenizer {meta.get('tokenizer.ggml.pre')!r} needs transformers to build "
                                  "its tokenizer (pip install transformers)") from None
        arch, tdict, _ = get_gguf_tokenizer(str(path))
        backend, _ = convert_gguf_tokenizer(arch, tdict)
        tokenizer_json = json.loads(backend.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": meta.get("llama.context_length"),
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            config[role] = tokens[int(i)]
    if meta.get("tokenizer.chat_template") is not None:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config}


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str | None = None, force: bool = False,
                 progress: bool | None = None) -> ModelConfig:
    """Convert the GGUF file into `out_dir` (default dtype: float32); returns the written ModelConfig."""
    from nfjax.checkpoint import convert as hf_convert

    path, out = Path(gguf_file), Path(out_dir)
    reader = _reader(path)
    meta = _meta(reader, path)
    cfg = hf_config(meta, {t.name for t in reader.tensors}, path)
    hf_convert.check_output(path.parent, out, force)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    # Named and marked like convert's own temp folders, so that a later run removes it if this one is killed.
    stage = parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        stage.mkdir()
        (stage / hf_convert.TMP_MARKER).touch()
        _stage(reader, meta, cfg, path, stage)
        try:
            return hf_convert.convert(stage, out, dtype=dtype, force=force, progress=progress)
        except ConversionError as e:
            raise ConversionError(str(e).replace(str(stage), str(path))) from None
    except OSError as e:
        raise ConversionError(f"converting {path} to {out}: {e}") from None
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(stage, ignore_errors=True)


def _stage(reader, meta: dict, cfg: dict, path: Path, stage: Path) -> None:
    from safetensors.numpy import save_file

    (stage / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, data in tokenizer_files(meta, path).items():
        (stage / name).write_text(json.dumps(data, ensure_ascii=False))
    save_file(hf_tensors(reader, cfg, path), str(stage / "model.safetensors"))
