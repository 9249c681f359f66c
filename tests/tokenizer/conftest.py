"""A tiny byte-level BPE tokenizer trained locally (no downloads), saved as an HF checkpoint folder."""
from __future__ import annotations

import json

import pytest

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Hello world, this is a tiny corpus for a tiny tokenizer; it has numbers 0123456789.",
    "你好，世界！日本語のテキストも少し。한국어 문장도 있어요.",
    "Emoji: 🙂 👍🏽 👨‍👩‍👧 🇫🇷 and accents: café, naïve, Ångström, façade.",
    "def f(x):\n    return x * 2  # code with    spaces\n\ttabs too",
]


def train_bpe(vocab_size: int = 420):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory):
    """Folder with tokenizer.json, tokenizer_config.json (ChatML template) and generation_config.json."""
    d = tmp_path_factory.mktemp("bpe")
    tok = train_bpe()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}, "chat_template": CHATML}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id("</s>"),
                                                                           tok.token_to_id("<|im_end|>")]}))
    return d


@pytest.fixture(scope="session")
def hf_reference(bpe_dir):
    """transformers' fast tokenizer over the very same files."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
