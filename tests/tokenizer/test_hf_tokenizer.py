import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nfjax.tokenizer import HFTokenizer, IncrementalDetokenizer, load_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "你好，世界！日本語のテキストも少し。한국어 문장도 있어요.",
    "Emoji: 🙂 👍🏽 👨‍👩‍👧 🇫🇷 and accents: café, naïve, Ångström, façade.",
    "def f(x):\n    return x * 2  # code with    spaces\n\ttabs too",
"", " leading space", "unseen wörds ßþ ﷽ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "<|im_start|>user\nhi<|im_end|>",
                  "a</s>b <s>", "🙂" * 5 + "你好" * 3]


@pytest.fixture(scope="module")
def tok(bpe_dir):
    t = load_tokenizer(bpe_dir)
    assert isinstance(t, HFTokenizer)
    return t


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_reference, text):
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf_reference.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_reference.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text  # lossless


def test_special_ids_match_transformers(tok, hf_reference):
    assert tok.bos_token_id == hf_reference.bos_token_id == tok.token_to_id("<s>")
    assert tok.eos_token_ids[0] == hf_reference.eos_token_id                  # the tokenizer's own eos first
    assert tok.eos_token_ids == (tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>"))  # + generation_config
    assert tok.vocab_size == len(hf_reference)
    assert tok.special_tokens["bos_token"] == "<s>" and tok.special_tokens["eos_token"] == "</s>"
    assert tok.encode("hi")[0] == tok.bos_token_id


@pytest.mark.parametrize("flags", [{"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}])
def test_add_bos_eos_flags_like_transformers(bpe_dir, tmp_path, flags):
    """transformers 5.23 lets tokenizer.json's post-processor decide, whatever these flags say; so do we."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "flags"
    shutil.copytree(bpe_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **flags}))
    ours, ref = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))
    for text in ("hello world", ""):
        assert ours.encode(text) == ref.encode(text) == [ours.bos_token_id] + ours.encode(text, False)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_for_text(tok, text):
    ids = tok.encode(text)
    for cut in range(len(ids) + 1):
        d = IncrementalDetokenizer(tok)
        pieces = [d.add(ids[:cut]), d.add(ids[cut:]), d.finish()]
        assert "".join(pieces) == tok.decode(ids)
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    pieces = [d.add(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)   # a multi-token character is emitted whole
    pieces.append(d.finish())
    assert "".join(pieces) == "<s>" + text


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_incremental_equals_full_decode_for_random_ids(tok, data):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=16))
    skip = data.draw(st.booleans())
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [d.add(i) for i in ids] + [d.finish()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_with_prompt_context(tok):
    prompt = tok.encode("Hello world, this")
    gen = tok.encode(" is a tiny 🙂 corpus.", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, context_ids=prompt)
    out = "".join(d.add(i) for i in gen) + d.finish()
    assert out == " is a tiny 🙂 corpus."


def test_chat_template_list_and_jinja_file(bpe_dir, tmp_path):
    d = tmp_path / "tpl"
    shutil.copytree(bpe_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(d).apply_chat_template([]) == "D"
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"
