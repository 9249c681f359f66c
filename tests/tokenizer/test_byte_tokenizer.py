import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nfjax.tokenizer import ByteTokenizer, IncrementalDetokenizer
from nfjax.tokenizer.byte import BOS_ID, EOS_ID

TEXTS = ["", "hello", "héllo wörld", "你好，世界", "🙂👍🏽👨‍👩‍👧🇫🇷", "mixed: a你🙂b\n\tz", "\x00\x7f"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_specials_and_vocab():
    tok = ByteTokenizer()
    assert tok.vocab_size == 258 and tok.bos_token_id == 256 and tok.eos_token_ids == (257,)
    assert tok.decode([BOS_ID, 104, 105, EOS_ID]) == "hi"
    assert tok.decode([BOS_ID, 104, 105, EOS_ID], skip_special_tokens=False) == "<|bos|>hi<|eos|>"
    assert tok.encode("<|eos|>", add_special_tokens=False) == list(b"<|eos|>")   # text never becomes a special
    with pytest.raises(ValueError, match="outside"):
        tok.decode([258])


def test_invalid_utf8_decodes_to_replacement():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"


def _stream(tok, chunks, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = [d.add(c) for c in chunks]
    pieces.append(d.finish())
    assert "".join(pieces) == d.text
    return pieces


def test_incremental_holds_incomplete_character():
    tok = ByteTokenizer()
    euro = list("€".encode())            # 3 bytes
    d = IncrementalDetokenizer(tok)
    assert d.add(0x61) == "a"
    assert d.add(euro[0]) == "" and d.add(euro[1]) == ""
    assert d.add(euro[2]) == "€"
    assert d.add([0xF0, 0x9F]) == ""      # first half of an emoji ...
    assert d.finish() == "\ufffd"         # ... becomes U+FFFD only when the stream ends
    assert d.text == "a€\ufffd"
    with pytest.raises(RuntimeError):
        d.add(0x61)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=24))
def test_incremental_equals_full_decode_at_every_split(data):
    tok = ByteTokenizer()
    ids = list(data)
    full = tok.decode(ids)
    for cut in range(len(ids) + 1):               # two chunks, split at every point
        assert "".join(_stream(tok, [ids[:cut], ids[cut:]])) == full
    # one byte at a time: a U+FFFD emitted early for bytes a later byte completes would break the equality
    assert "".join(_stream(tok, [[i] for i in ids])) == full


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=20), st.lists(st.integers(1, 5), max_size=10))
def test_incremental_text_streams_whole_characters(text, sizes):
    tok = ByteTokenizer()
    ids = tok.encode(text) + [EOS_ID]
    chunks, i = [], 0
    for s in sizes + [len(ids)]:
        chunks.append(ids[i:i + s])
        i += s
    pieces = _stream(tok, chunks)
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)        # valid UTF-8 never yields a replacement char
