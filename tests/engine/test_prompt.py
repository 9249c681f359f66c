"""encode_prompt: the one rule both engines (nfjax/engine, nfjax/offload) apply to a prompt."""
import pytest

from nfjax.engine.engine import TINY_MODEL
from nfjax.engine.prompt import encode_prompt
from nfjax.errors import UserError
from nfjax.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY_MODEL)


def test_text_and_ids(tok):
    assert encode_prompt(tok, "Once upon", 259, 64) == tok.encode("Once upon")
    assert encode_prompt(tok, (3, 7, 258), 259, 64) == [3, 7, 258]


@pytest.mark.parametrize("prompt, vocab, ctx, msg", [
    ([3, 259], 259, 64, "prompt token id 259 is out of range [0, 259)"),
    ([-1], 259, 64, "prompt token id -1 is out of range"),
    ([], 259, 64, "prompt is empty"),
    ([5] * 8, 259, 8, "prompt has 8 tokens; the context holds 8"),
])
def test_refused(tok, prompt, vocab, ctx, msg):
    with pytest.raises(UserError, match=msg.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        encode_prompt(tok, prompt, vocab, ctx)
