import json
from pathlib import Path

import pytest

import nfjax

from nfjax.errors import UserError
from nfjax.tokenizer import ByteTokenizer, HFTokenizer, TokenizerFileError, load_tokenizer, save_byte_tokenizer


def test_hf_when_tokenizer_json(bpe_dir):
    assert isinstance(load_tokenizer(bpe_dir), HFTokenizer)


def test_bytes_marker_with_template(tmp_path):
    save_byte_tokenizer(tmp_path, chat_template="{{ messages[0].content }}!")
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_bytes_fallback_only_when_vocab_fits(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)           # nothing at all: bytes
    (tmp_path / "nfjax_config.json").write_text(json.dumps({"vocab_size": 258}))
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    (tmp_path / "nfjax_config.json").write_text(json.dumps({"vocab_size": 32000}))
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(UserError, match="no tokenizer.json.*32000.*tokenizer.model"):
        load_tokenizer(tmp_path)


def test_bad_files_are_user_errors(tmp_path):
    with pytest.raises(TokenizerFileError, match="not a folder"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "nfjax_tokenizer.json").write_text(json.dumps({"type": "sentencepiece"}))
    with pytest.raises(TokenizerFileError, match="unknown tokenizer type"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerFileError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_shipped_tiny_checkpoint_uses_bytes():
    tiny = Path(nfjax.__file__).parent / "assets" / "tiny"
    assert (tiny / "nfjax_tokenizer.json").exists(), "the tiny checkpoint must ship with its tokenizer marker"
    tok = load_tokenizer(tiny)
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_ids == (257,)
