"""Pick and load a checkpoint folder's tokenizer.

Decision (in this order):
1. `tokenizer.json` present -> `HFTokenizer` (plus `tokenizer_config.json` etc., see `nfjax.tokenizer.hf`).
2. `nfjax_tokenizer.json` present -> the tokenizer it names; today only `{"type": "bytes"}` -> `ByteTokenizer`
   (it may carry a `chat_template`). `nfjax train-tiny` writes this file. It is a separate file because
   `nfjax_config.json` holds exactly the `ModelConfig` fields.
3. Neither: a byte tokenizer is assumed only when the model's vocabulary fits it (`nfjax_config.json`
   `vocab_size` is 258, or there is no model config); anything else is an error naming the missing file,
   since byte ids would be garbage for a model trained on another vocabulary -- or, with
   `token_ids_only=True` (how engines load checkpoints), a `SilentTokenizer`: token-id prompts work, text
   prompts are a UserError naming the missing file.
"""
from __future__ import annotations

import json
from pathlib import Path

from nfjax.tokenizer.base import Tokenizer
from nfjax.tokenizer.byte import EOS_ID, ByteTokenizer
from nfjax.tokenizer.hf import HFTokenizer, TokenizerFileError, _read_json

NFJAX_TOKENIZER_FILE = "nfjax_tokenizer.json"


def load_tokenizer(checkpoint_dir: str | Path, token_ids_only: bool = False) -> Tokenizer:
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise TokenizerFileError(f"{path}: not a folder")
    if (path / "tokenizer.json").exists():
        return HFTokenizer.from_dir(path)
    marker = path / NFJAX_TOKENIZER_FILE
    if marker.exists():
        spec = _read_json(marker)
        kind = spec.get("type")
        if kind != "bytes":
            raise TokenizerFileError(f"{marker}: unknown tokenizer type {kind!r} (supported: 'bytes')")
        return ByteTokenizer(chat_template=spec.get("chat_template"))
    model_cfg = _read_json(path / "nfjax_config.json")
    vocab = model_cfg.get("vocab_size")
    if vocab in (None, EOS_ID + 1):
        return ByteTokenizer()
    hint = " (convert SentencePiece tokenizer.model files to tokenizer.json with transformers)" if (
        path / "tokenizer.model").exists() else ""
    if token_ids_only:
        from nfjax.tokenizer.silent import SilentTokenizer
        eos = model_cfg.get("eos_token_ids") or ()
        return SilentTokenizer(int(vocab), tuple(int(t) for t in eos),
                               reason=f"this model has no tokenizer (no tokenizer.json in {path}){hint}")
    raise TokenizerFileError(f"{path}: no tokenizer.json (and the model's vocab_size={vocab} is not the byte "
                             f"tokenizer's {EOS_ID + 1}){hint}")


def save_byte_tokenizer(checkpoint_dir: str | Path, chat_template: str | None = None) -> None:
    """Mark a checkpoint folder as using the byte tokenizer (writes `nfjax_tokenizer.json`)."""
    spec = {"type": "bytes", "bos_token_id": 256, "eos_token_id": 257}
    if chat_template is not None:
        spec["chat_template"] = chat_template
    (Path(checkpoint_dir) / NFJAX_TOKENIZER_FILE).write_text(json.dumps(spec, indent=2) + "\n")
