"""Request (nfjax/engine/request.py): the tokens the host knows, by position, and the prompt length kept as a plain
attribute."""
from nfjax.engine import SamplingParams
from nfjax.engine.request import Request


def test_tokens_across_prompt_and_outputs():
    req = Request("r", [10, 11, 12, 13, 14], SamplingParams.greedy(max_tokens=8), 0)
    req.output_ids += [20, 21, 22]
    for lo in range(8):
        for hi in range(lo, 9):
            want = [req.token_at(p) for p in range(lo, hi)]
            got = req.tokens(lo, hi)
            if None in want:
                assert got is None, (lo, hi)
            else:
                assert got == want, (lo, hi)
    assert req.tokens(3, 8) == [13, 14, 20, 21, 22]
    assert req.tokens(5, 9) is None                    # position 8 is not on the host yet


def test_prompt_ids_taken_as_a_list():
    req = Request("r", (1, 2, 3), SamplingParams.greedy(max_tokens=2), 0)
    assert req.prompt_ids == [1, 2, 3] and req.prompt_len == 3
    req.output_ids.append(9)
    assert req.tokens(1, 4) == [2, 3, 9]
