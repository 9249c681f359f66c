"""Tokenizers: the `Tokenizer` interface, HF (`tokenizer.json`) and byte-level implementations, chat
templates, and streaming detokenization. `load_tokenizer(checkpoint_dir)` picks one (see `loader`)."""
from nfjax.tokenizer.base import Tokenizer
from nfjax.tokenizer.byte import ByteTokenizer
from nfjax.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplateError
from nfjax.tokenizer.hf import HFTokenizer, TokenizerFileError
from nfjax.tokenizer.incremental import IncrementalDetokenizer
from nfjax.tokenizer.loader import load_tokenizer, save_byte_tokenizer

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "IncrementalDetokenizer", "load_tokenizer",
           "save_byte_tokenizer", "DEFAULT_CHAT_TEMPLATE", "ChatTemplateError", "TokenizerFileError"]
