"""bench/probes/replay_mixtral.py: the Mixtral step model beside the measured runs, and its replay-only switches."""
import argparse

from bench.probes import batcher_replay as br
from bench.probes import replay_mixtral as rm


def test_replay_forms_the_measured_run_and_the_model_reads_its_seconds():
    """The engine's warm-up and one-step lag make the replay form the measured run's steps exactly (kinds and
    padding); the trace's per-step GPU times sum to the run's seconds; the fitted model reads it within 5%."""
    run = rm.load("budget-b2048")
    steps = rm.schedule(run)
    kinds = [k for k, _ in steps]
    assert {k: kinds.count(k) for k in set(kinds)} == {k: v["steps"] for k, v in run["step_ms_by_kind"].items()}
    own = rm.measured_own(run, kinds)
    assert abs(sum(own.values()) / 1e3 - run["seconds"]) < 0.1
    row = rm.validate({"lin": rm.LIN_MS, "tile_ms": rm.TILE_MS, "attn": rm.ATTN_MS_PER_MTOK}, ["budget-b2048"])[0]
    assert row["steps"] == (1096, 1096) and row["kind_steps_off"] == 0
    assert abs(row["model_s"] / row["measured_s"] - 1) < 0.05
    r = br.replay(rm.workload(), run["num_pages"], rm.batcher_config(), None, model=rm.MIXTRAL, warmup=8, lag=True,
                  step_fn=rm.step_ms, batcher_cls=rm.MeasuredBatcher)
    assert r["padding"] == run["trace"]["padding_tokens"] and r["steps"] == 1096


def test_the_measured_runs_bound_never_admits_more_than_the_exact_forecast():
    """BoundForecast (the rule the measured runs ran with) is the exact count plus under a page a request."""
    import numpy as np
    rng = np.random.default_rng(3)
    for _ in range(20):
        exact, bound = rm.MemoryForecast(16), rm.BoundForecast(16)
        reqs = [(int(rng.integers(1, 2000)), int(rng.integers(1, 600))) for _ in range(int(rng.integers(1, 40)))]
        for now, more in reqs:
            exact.add(now, now + more)
            bound.add(now, now + more)
        assert exact.peak() <= bound.peak() < exact.peak() + len(reqs)


def test_padding_tiles_and_prefill_first():
    """Padding rows pile onto two experts (extra tiles); prefill-first forms prefill-bucket steps while decodes
    run, every request still finishing."""
    assert abs(rm.extra_tiles(256, 0)) < 0.05 and 1.5 < rm.extra_tiles(144, 112) < 2.1
    assert rm.extra_tiles(512, 0) > 2                     # ~128 rows an expert: about half pass one tile
    f = argparse.Namespace(prefill_first=True, no_pad_tiles=False, swap_gb_s=rm.SWAP_GB_S)
    cls, fn = rm.variant(br.Batcher, f)
    work = rm.workload(64, "1024x64")
    out: list = []
    r = br.replay(work, 3000, rm.batcher_config(), None, batcher_cls=cls, model=rm.MIXTRAL, step_fn=fn, warmup=8,
                  lag=True, steps_out=out)
    kinds = [k for k, _, _ in out]
    assert kinds.count("prefill@8192") >= 4 and r["preemptions"] == 0
    first_decode = next(i for i, k in enumerate(kinds) if k.startswith("decode"))
    assert any(k == "prefill@8192" for k in kinds[first_decode:])       # prefill while decodes wait
    assert r["steps"] >= max(o for _, o in work)


def test_main_runs_the_mixtral_model(capsys):
    br.main(["--model", "mixtral", "--num-requests", "24", "--num-pages", "2000",
             "--variants", "now=;b8192=--buckets 16,32,64,128,160,192,256,384,512,1024,2048,8192 --prefill-bucket 0"])
    out = capsys.readouterr().out
    assert "1024x512  now" in out and "1024x512  b8192" in out
