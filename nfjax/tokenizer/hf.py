"""Tokenizer over an HF `tokenizer.json` (the `tokenizers` library), configured like transformers does it.

Files read from the checkpoint folder (all but `tokenizer.json` optional):
- `tokenizer.json`: vocabulary, merges, added/special tokens, normalizer, decoder, post-processor.
- `tokenizer_config.json`: `bos_token`/`eos_token`/`unk_token`/`pad_token` (strings or `{"content": ...}`),
  `chat_template` (a string, or a list of `{"name", "template"}`: "default" is used);
  `special_tokens_map.json` fills special tokens it lacks.
- `chat_template.jinja`: the newer place for the chat template (wins over `tokenizer_config.json`).
- `generation_config.json`, `config.json`, `nfjax_config.json`: more eos ids (e.g. Llama-3's `<|eot_id|>`)
  and a bos id when the tokenizer config names none.

Special tokens added by `encode(..., add_special_tokens=True)` are exactly what the post-processor in
`tokenizer.json` adds (e.g. Llama's BOS); `add_bos_token`/`add_eos_token` in `tokenizer_config.json` are not
consulted, which is what transformers 5.23 does when it loads a `tokenizer.json` (tests compare the two).
Decode never applies `clean_up_tokenization_spaces` (transformers 5 ignores it for BPE tokenizers, i.e. for
every model nfjax runs).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nfjax.errors import UserError
from nfjax.tokenizer.base import Tokenizer

SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerFileError(UserError):
    """A tokenizer file that cannot be read, with the file named."""


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _pick_chat_template(value: Any, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise TokenizerFileError(f"{path}: chat_template lists {sorted(map(str, named))} but no 'default'")
    raise TokenizerFileError(f"{path}: chat_template must be a string or a list of named templates")


class HFTokenizer(Tokenizer):
    def __init__(self, tokenizer, special_tokens: dict[str, str] | None = None, chat_template: str | None = None,
                 extra_eos_token_ids: tuple[int, ...] = (), fallback_bos_token_id: int | None = None):
        """`tokenizer` is a `tokenizers.Tokenizer`; `special_tokens` maps roles (`bos_token`, ...) to strings."""
        self._tok = tokenizer
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template

        bos = self._special.get("bos_token")
        self._bos_id = tokenizer.token_to_id(bos) if bos is not None else None
        if self._bos_id is None:
            self._bos_id = fallback_bos_token_id
        eos = self._special.get("eos_token")
        eos_ids = [tokenizer.token_to_id(eos)] if eos is not None else []
        eos_ids += list(extra_eos_token_ids)
        self._eos_ids = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        self._special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if getattr(t, "special", False))

    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTokenizer":
        from tokenizers import Tokenizer as RawTokenizer
        path = Path(path)
        tj = path / "tokenizer.json"
        try:
            raw = RawTokenizer.from_file(str(tj))
        except Exception as e:   # tokenizers raises a bare Exception for malformed files
            raise TokenizerFileError(f"{tj}: cannot load ({e})") from None
        tc = _read_json(path / "tokenizer_config.json")
        stm = _read_json(path / "special_tokens_map.json")
        special = {}
        for role in SPECIAL_ROLES:
            text = _token_text(tc.get(role)) or _token_text(stm.get(role))
            if text is not None:
                special[role] = text
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        else:
            template = _pick_chat_template(tc.get("chat_template"), path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        hf_cfg = _read_json(path / "config.json")
        nf_cfg = _read_json(path / "nfjax_config.json")
        extra_eos = tuple(_ids(gen.get("eos_token_id")) + _ids(hf_cfg.get("eos_token_id"))
                          + _ids(nf_cfg.get("eos_token_ids")))
        bos_fallback = next((b for b in (gen.get("bos_token_id"), hf_cfg.get("bos_token_id"),
                                         nf_cfg.get("bos_token_id")) if isinstance(b, int)), None)
        return cls(raw, special, template, extra_eos, bos_fallback)

    # ---- Tokenizer ----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, str]:
        return dict(self._special)

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok
