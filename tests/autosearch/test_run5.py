"""The cost model and the search on run 5's H100 profile (tests/autosearch/data/h100_run5_profile.json, a copy of
bench/results/autosearch-run5-profile-20261125.json) against what run 5 measured per layer (step / 32,
bench/results/autosearch-run5-20261125.json): Sequential, the hand-tuned plan, and run 5's searched plan (512/1536
at 0.3 of the SMs, the down projection split after the merged activation), which measured 5% behind the hand-tuned
one while the search's model of the time put it 2% ahead."""
import json
from pathlib import Path

import pytest

from nfjax.autosearch.costs import BatchClass, CostModel
from nfjax.autosearch.emit import record, schedule_ms
from nfjax.autosearch.floor import corrected
from nfjax.autosearch.search import SearchOptions, build_problem, search
from nfjax.schedule.api import ScheduleContext
from nfjax.schedule.graph import layer_graph
from nfjax.schedule.plan import Plan, load_plan
from nfjax.schedule.strategies import NanoFlow

RUN5 = json.loads((Path(__file__).parent / "data" / "h100_run5_profile.json").read_text())
HAND = "llama3-8b_h100_tp1_beside_mact"
# run 5, ms per layer (step / 32 layers)
MEASURED = {2048: {"sequential": 2.0032, "hand": 1.8994, "searched": 1.9973},
            1024: {"sequential": 1.0703, "hand": 1.0217}}
MID = ["attn_decode", "attn_prefill", "o_proj_op", "attn_reduce", "ffn_norm"]
# run 5's searched plan for 2048 tokens / 256 decodes (bench/results/autosearch-plans-run5-20261125/)
RUN5_PLAN = Plan.from_json({
    "format": 1, "name": "run5_2048", "bucket": 2048, "min_bucket": 2048, "max_bucket": 2048, "align": 64,
    "share": {"attn_decode:0": 0.3},
    "groups": [{"name": "a", "ops": ["attn_norm", "kqv", "rope_append"], "nano_batches": [2048]},
               {"name": "b", "ops": MID + ["up_gate"], "nano_batches": [512, 1536]},
               {"name": "c", "ops": ["act"], "nano_batches": [2048]},
               {"name": "d", "ops": ["down"], "nano_batches": [512, 1536]},
               {"name": "e", "ops": ["mlp_reduce", "residual"], "nano_batches": [2048]}],
    "streams": [{"stream": 0, "order": ["a:0", *[f"{o}:1" for o in MID], "attn_decode:0+up_gate:1",
                                        *[f"{o}:0" for o in MID[1:]], "up_gate:0", "c:0", "down:1", "down:0",
                                        "e:0"]}]})


def _hand_ms(model: CostModel, bucket: int) -> float:
    return schedule_ms(NanoFlow(load_plan(HAND)).record(ScheduleContext(bucket, layer_graph())), model)


def _model(bucket: int, decodes: int, prof: dict = RUN5) -> CostModel:
    return CostModel(prof, BatchClass(bucket, decodes, 1280))


@pytest.mark.parametrize("bucket", [2048, 1024])
def test_the_model_predicts_run_5s_measured_steps(bucket):
    """Within 3% of the measured step / 32 (which also holds the step's embedding and head): at 2048 Sequential
    1.986 (its measured layer) vs 2.003, the hand-tuned plan 1.852 vs 1.899, run 5's searched plan 2.029 vs 1.997;
    at 1024 1.068 vs 1.070 and 1.013 vs 1.022. Run 5's own model had the searched plan at 1.917, ahead of the
    hand-tuned plan's 1.955 (and at 1024 the hand-tuned plan at 1.144, behind Sequential)."""
    m = _model(bucket, bucket // 8)
    got = {"sequential": m.measured_sequential_ms(), "hand": _hand_ms(m, bucket)}
    if bucket == 2048:
        got["searched"] = schedule_ms(record(RUN5_PLAN, layer_graph()), m)
    for k, v in MEASURED[bucket].items():
        assert got[k] == pytest.approx(v, rel=0.03), k
    assert got["hand"] < 0.96 * got["sequential"]                          # measured: 1.055x, 1.047x
    if bucket == 2048:
        assert got["hand"] < 0.95 * got["searched"]                       # measured: 0.951x


def test_the_split_down_projection_pays_for_its_rows_of_the_merged_activation():
    """Run 5's trace of its searched plan: two copies of the activation's rows (0.009 + 0.029 ms a layer) before
    the two down GEMMs. A split GEMM reading a merged value pays its rows' bytes at the copy rate; an XLA fusion or
    an attention kernel does not."""
    m = _model(2048, 256)
    assert m.slice_ms("a", 2048, "down") == pytest.approx(2 * 28672 * 2048 / RUN5["copy_bytes_per_ms"])
    assert m.slice_ms("a", 2048, "act") == 0.0 and m.slice_ms("q_rot", 2048, "attn_decode") == 0.0
    free = _model(2048, 256, {**RUN5, "slice_copy": []})
    ls = record(RUN5_PLAN, layer_graph())
    assert schedule_ms(ls, m) - schedule_ms(ls, free) == pytest.approx(m.slice_ms("a", 2048, "down"))
    pr = build_problem(layer_graph(), m, 64)
    assert ("act", "down", pytest.approx(m.slice_ms("a", 2048, "down"))) in pr.slices
    assert {(a, b) for a, b, _ in pr.slices} <= {(a, b) for a, b, _ in pr.edges}


def test_token_series_read_without_their_noise():
    """An op on fewer tokens takes at most what it took on more (attn_norm: 0.0378 ms at 1024 tokens against 0.0218
    at 1536), and at most the sum of two smaller sizes (down: 0.3459 at 2048 against 0.1568 x 2 at 1024; in a step
    the merged 2048-token GEMM took 0.293-0.300 ms)."""
    p, report = corrected(RUN5)
    t = {op: dict(zip(s["tokens"], s["ms"])) for op, s in p["tokens"].items()}
    for op, s in t.items():
        xs = sorted(s)
        assert all(s[a] <= s[b] + 1e-12 for a, b in zip(xs, xs[1:])), op
    assert t["attn_norm"][1024] <= 0.0218 and t["down"][2048] == pytest.approx(2 * t["down"][1024])
    assert t["down"][2048] < RUN5["tokens"]["down"]["ms"][-1] and "down" in report


def test_a_part_on_a_share_is_read_at_its_size():
    """Decode attention on a quarter of the SMs: 1.77x its whole-GPU time at 256 decodes, 1.48x at 128 (the
    128 x 896 pair rows); the 256-decode ratio alone put the 1024-token hand-tuned pair at 0.488 ms against the
    0.427 measured."""
    for bucket, d in ((2048, 256), (1024, 128)):
        m = _model(bucket, d)
        row = next(r for r in RUN5["pairs"] if r["sizes"][0] == d and r["share"] == 0.25)
        assert m.op_ms("attn_decode", 0, d, 0.25) == pytest.approx(row["a_ms"], rel=1e-6)
        assert m.op_ms("up_gate", d, bucket, 0.75) == pytest.approx(row["b_ms"], rel=1e-3)
        assert m.pair_ms("attn_decode", (0, d), "up_gate", (d, bucket), (0.25, 0.75)) == pytest.approx(
            row["fused_ms"], rel=1e-3)


@pytest.mark.parametrize("bucket,decodes,sizes", [(2048, 256, (256, 1792)), (1024, 128, (128, 896))])
def test_the_search_on_run_5_finds_the_hand_tuned_structure(bucket, decodes, sizes):
    """Solved from run 5's profile (two nano-batches at most, for the time): the decodes' attention beside the
    prefill tokens' gate/up on a quarter of the SMs, attention..gate/up split with the decodes alone in the first
    nano-batch, the rest merged; modelled no slower than the hand-tuned plan and 5-7% under Sequential's measured
    layer. Run 5's own search wrote Sequential at 1024 and 512/1536 at 2048 (measured 0.951x the hand-tuned)."""
    (r,) = search(layer_graph(), RUN5, [bucket], [decodes], 1280, 2,
                  SearchOptions(nano_batches=(1, 2), time_limit=30))
    p = r.plan
    assert p is not None and p.share == {"attn_decode:0": 0.25}
    got = {op: gr.nano_batches for gr in p.groups for op in gr.ops}
    assert all(got[op] == sizes for op in MID + ["up_gate"])
    assert all(got[op] == (bucket,) for op in ("attn_norm", "kqv", "act", "down", "mlp_reduce", "residual"))
    m = _model(bucket, decodes)
    assert r.best_ms == pytest.approx(schedule_ms(record(p, layer_graph()), m), rel=1e-9)
    assert r.best_ms <= _hand_ms(m, bucket) + 1e-9
    assert r.best_ms < 0.95 * m.measured_sequential_ms()


def test_the_bench_models_a_measured_run_offline(tmp_path):
    """`python -m bench.autosearch --profile FILE --search-only --measured RUN.json`: every strategy the run timed,
    modelled from the profile against its measured step / layers (here run 5's 2048-token steps)."""
    from argparse import Namespace

    from bench.autosearch import evaluate_measured
    run = {"data": {"config": {"num_layers": 32}, "buckets": {"2048": {"decode": 256, "ctx": 1280, "strategies": {
        "sequential": {"step_ms": 64.10337}, f"nanoflow:{HAND}": {"step_ms": 60.77965}}}}}}
    f = tmp_path / "run.json"
    f.write_text(json.dumps(run))
    out = {}
    evaluate_measured(Namespace(measured=str(f), measured_plans=None), RUN5, out)
    rows = {r["strategy"]: r for r in out["evaluation"]["rows"]}
    assert rows["sequential"]["modelled_ms"] == pytest.approx(1.985841)
    assert rows[f"nanoflow:{HAND}"]["measured_ms"] == pytest.approx(1.8994, rel=1e-4)
    assert out["evaluation"]["max_abs_error"] < 0.03


def test_a_tie_goes_to_the_structure_nearest_the_measured_pairs():
    """`extrapolation`: 0 for the pair at the profiled 256 x 1792, > 0 for run 5's 256 decodes (512 tokens) beside
    1536; the choice among candidates within `tie` of the best takes the smaller."""
    from nfjax.autosearch.search import extrapolation, overlaps_of
    from nfjax.autosearch.stage1 import Structure
    g = layer_graph()
    m = _model(2048, 256)
    pr = build_problem(g, m, 64, overlaps_of(g, RUN5.get("pair_min_tokens")))
    split = frozenset(MID + ["up_gate"])
    pair = (("decode_beside_up_gate", 0, 1),)
    hand, run5 = (Structure((0, b, 2048), split, pair, (1, 0)) for b in (256, 512))
    assert extrapolation(pr, m, hand) == 0.0 < extrapolation(pr, m, run5)
    assert extrapolation(pr, m, Structure((0, 2048))) == 0.0
