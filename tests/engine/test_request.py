"""Request (nfjax/engine/request.py): the tokens the host knows, by position, and the prompt length kept as a plain
attribute; the batcher's length prediction (`nfjax.engine.batcher.predicted`) on hand-worked cases."""
from nfjax.engine import SamplingParams
from nfjax.engine.batcher import predicted
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


def test_predicted_lengths():
    exact = Request("e", [1] * 100, SamplingParams.greedy(max_tokens=50, ignore_eos=True), 0)
    exact.num_launched_outputs = 10
    # exact length: 40 steps left surely and at most; ends at 150 whatever other requests' mean output
    assert predicted(exact, 1000, 7) == (40, 40, 150)
    assert predicted(exact, 120, None) == (10, 10, 120)        # the context cuts it at 120 positions
    loose = Request("l", [1] * 100, SamplingParams.greedy(max_tokens=50, min_tokens=15), 0)
    loose.num_launched_outputs = 10
    # EOS may end it: surely to min_tokens (5 more), at most to max_tokens; its end predicted by the mean (20)
    assert predicted(loose, 1000, 20) == (5, 40, 120)
    assert predicted(loose, 1000, None) == (5, 40, 150)        # no request finished yet: max_tokens
    assert predicted(loose, 1000, 4) == (5, 40, 111)           # never before what it has launched, plus one
