"""The accuracy bench's intervals and verdicts (bench/kv_accuracy.py), on synthetic per-position numbers."""
import numpy as np

from bench.kv_accuracy import paired_ci, target_verdict


def test_paired_ci_covers_the_true_change_and_narrows_with_more_text():
    rng = np.random.default_rng(0)

    def draw(n):
        ref, noise = rng.gamma(2.0, 1.5, (4, n)), rng.normal(0, 0.5, (4, n))
        agree = np.zeros((4, n))
        agree.flat[rng.permutation(4 * n)[:int(0.9 * 4 * n)]] = 1      # exactly 90% agreement
        return ref + 0.05 + noise - noise.mean(), ref, agree          # the change exactly 0.05 nats a token
    small, large = paired_ci(*draw(400)), paired_ci(*draw(6400))
    true_pct = 100 * (np.exp(0.05) - 1)                  # 5.13%
    for ci in (small, large):
        lo, hi = ci["ppl_delta_pct_ci95"]
        assert lo < true_pct < hi
        assert ci["top1_agree_ci95"][0] < 0.9 < ci["top1_agree_ci95"][1]
    width = lambda c: c["ppl_delta_pct_ci95"][1] - c["ppl_delta_pct_ci95"][0]   # noqa: E731
    assert width(large) < 0.5 * width(small)
    assert large["blocks"] == 4 * 6400 // 16


def test_a_target_is_judged_against_the_intervals():
    tgt = (5.0, 0.93)
    assert target_verdict({"ppl_delta_pct_ci95": [4.0, 4.9], "top1_agree_ci95": [0.94, 0.96]}, tgt) == "yes"
    assert target_verdict({"ppl_delta_pct_ci95": [4.2, 5.4], "top1_agree_ci95": [0.94, 0.96]}, tgt) == "spans"
    assert target_verdict({"ppl_delta_pct_ci95": [4.2, 5.4], "top1_agree_ci95": [0.86, 0.88]}, tgt) == "NO"
    assert target_verdict({"ppl_delta_pct_ci95": [5.1, 5.9], "top1_agree_ci95": [0.94, 0.96]}, tgt) == "NO"
    assert target_verdict({"ppl_delta_pct": 4.0, "top1_agree": 0.95}, tgt) == "yes"      # points only
    assert target_verdict({"ppl_delta_pct": 4.0, "top1_agree": 0.90}, tgt) == "NO"
