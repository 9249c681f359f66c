"""Synthetic offline workloads: fixed 1024 in / 512 out, and ShareGPT-shaped lengths.

The ShareGPT data set is not available offline, so its shape is approximated by log-normal lengths with the
means NanoFlow's Table 4 reports (246 prompt / 322 output tokens) and a spread typical of chat logs.
"""
from __future__ import annotations

import numpy as np


def fixed(n: int, lin: int, lout: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(10, vocab - 10, lin).tolist(), lout) for _ in range(n)]


def sharegpt_like(n: int, vocab: int, seed: int = 0, mean_in: float = 246, mean_out: float = 322,
                  sigma: float = 0.9, max_len: int = 2048):
    rng = np.random.default_rng(seed)
    def lens(mean):
        mu = np.log(mean) - sigma ** 2 / 2          # log-normal with the requested mean
        return np.clip(np.round(rng.lognormal(mu, sigma, n)), 4, max_len).astype(int)
    lin, lout = lens(mean_in), lens(mean_out)
    return [(rng.integers(10, vocab - 10, int(a)).tolist(), int(b)) for a, b in zip(lin, lout)]


def parse(spec: str, n: int, vocab: int, seed: int = 0):
    if spec == "sharegpt":
        return sharegpt_like(n, vocab, seed)
    lin, lout = (int(x) for x in spec.split("x"))
    return fixed(n, lin, lout, vocab, seed)
