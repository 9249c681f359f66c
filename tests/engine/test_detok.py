"""OutputText (nfjax/engine/detok.py) against the straightforward version it replaced: the whole text kept as one
string, every release a slice of it. Same released pieces, texts and stops on random streams."""
from __future__ import annotations

import random

import pytest

from nfjax.engine.detok import OutputText
from nfjax.engine.sampling_params import SamplingParams
from nfjax.tokenizer import ByteTokenizer, IncrementalDetokenizer


class Reference:
    """The version before #27 (O(output length) per token), as the specification."""

    def __init__(self, tokenizer, params, prompt_ids=()):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            context_ids=prompt_ids)
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text, self.released, self.stopped = "", 0, False

    def add(self, token_ids, check_stops=True):
        if self.stopped:
            return
        before = len(self.text)
        self.text += self.detok.add(token_ids)
        if not check_stops:
            return
        for s in self.stops:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                self.text, self.stopped = self.text[:i], True

    def release(self, final):
        if final and not self.stopped:
            self.text += self.detok.finish()
        end = len(self.text) if (final or self.stopped) else max(self.released, len(self.text) - self.hold)
        out = self.text[self.released:end]
        self.released = end
        return out


# bytes of "a", "b", " ", "é" (2 bytes) and "€" (3 bytes), one token each: stops hit often, characters span tokens
ALPHABET = [97, 98, 32, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xFF, 257]
STOP_SETS = [[], ["ab"], ["a"], ["bab", "é"], ["b b", "€a", "aaaa"], ["\ufffd"], ["ba", "ab"]]


@pytest.mark.parametrize("seed", range(40))
def test_same_releases_texts_and_stops_as_the_reference(seed):
    rng = random.Random(seed)
    tok = ByteTokenizer()
    stops = STOP_SETS[seed % len(STOP_SETS)]
    params = SamplingParams(stop=stops, skip_special_tokens=bool(seed % 2))
    min_tokens = rng.choice([0, 0, 3, 10])
    release_every = rng.choice([1, 1, 2, 7, 10 ** 6])        # the engine releases every step; a caller may not
    new, ref = OutputText(tok, params, [97]), Reference(tok, params, [97])
    got_pieces, ref_pieces = [], []
    for n in range(1, rng.randint(1, 120)):
        t = rng.choice(ALPHABET)
        new.add(t, n > min_tokens)
        ref.add([t], n > min_tokens)
        assert new.stopped == ref.stopped
        final = new.stopped or rng.random() < 0.02
        if final or n % release_every == 0:
            got_pieces.append(new.release(final))
            ref_pieces.append(ref.release(final))
            assert got_pieces == ref_pieces
            assert new.released == ref.released
            assert new.released_text == ref.text[:ref.released]
        assert new.text == ref.text
        if final:
            break
    got_pieces.append(new.release(True))
    ref_pieces.append(ref.release(True))
    assert got_pieces == ref_pieces and new.text == ref.text == new.released_text


def test_a_stop_string_is_removed_and_never_cuts_released_text():
    t = OutputText(ByteTokenizer(), SamplingParams(stop=["xyz"]))
    released = []
    for c in b"abcdxyzq":
        t.add(c)
        released.append(t.release(final=False))
    assert t.stopped and t.text == "abcd"
    assert "".join(released) == "abcd" and released[:4] == ["", "", "a", "b"]     # "xy" of 3 held back


def test_adds_cost_nothing_that_grows_with_the_text():
    """Released text stays in pieces until read; what is held back is the longest stop string less one."""
    t = OutputText(ByteTokenizer(), SamplingParams(stop=["zzzz"]))
    for i in range(5000):
        t.add(97 + i % 3)
        t.release(final=False)
    assert len(t._pending) == 3 and len(t._parts) == 4997
    assert t.released_text == "abc" * 1665 + "ab" and len(t._parts) == 1
