"""Bucket fitting (nfjax/engine/bucket_fit.py): the length prediction its deferral and the admission forecast use,
on hand-worked cases. (The deferral and chunk shortening themselves: tests/engine/test_batcher.py.)"""
from nfjax.engine import SamplingParams
from nfjax.engine.bucket_fit import predicted
from nfjax.engine.request import Request


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
