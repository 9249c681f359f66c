"""The cost model on run 4's H100 profile (tests/autosearch/data/h100_run4_profile.json, a copy of
bench/results/autosearch-run4-profile-20261124.json) against what run 4 measured per layer (step / 32 layers,
bench/results/autosearch-run4-20261124.json): host-bound measurements, the pair's parts, the interference over the
parts' balance, and the ranking of Sequential, the hand-tuned plan and the searched plans."""
import json
from pathlib import Path

import pytest

from nfjax.autosearch.costs import BatchClass, CostModel
from nfjax.autosearch.emit import record, schedule_ms
from nfjax.autosearch.floor import LAUNCH_MS, corrected, floors
from nfjax.autosearch.search import SearchOptions, search
from nfjax.schedule.graph import layer_graph
from nfjax.schedule.plan import Plan, load_plan

RUN4 = json.loads((Path(__file__).parent / "data" / "h100_run4_profile.json").read_text())
HAND = "llama3-8b_h100_tp1_beside_mact"
# run 4, ms per layer: Sequential, the hand-tuned plan, the searched plan of run 4
MEASURED = {2048: (1.9706, 1.8920, 1.9131), 1024: (1.0611, 1.0134, 1.1115)}


def _plan(bucket: int, groups, order, share) -> Plan:
    """Run 4's searched plans (bench/results/autosearch-plans-run4-20261124/)."""
    return Plan.from_json({"format": 1, "name": f"run4_{bucket}", "bucket": bucket, "min_bucket": bucket,
                           "max_bucket": bucket, "align": 64, "share": share,
                           "streams": [{"stream": 0, "order": order}],
                           "groups": [{"name": n, "ops": o, "nano_batches": s} for n, o, s in groups]})


QKV, MLP = ["attn_norm", "kqv", "rope_append"], ["act", "down", "mlp_reduce", "residual"]
MID = ["attn_decode", "attn_prefill", "o_proj_op", "attn_reduce", "ffn_norm"]
RUN4_PLANS = {
    2048: _plan(2048, [("a", QKV, [2048]), ("b", MID + ["up_gate"], [320, 1728]), ("c", MLP, [2048])],
                ["a:0", *[f"{o}:1" for o in MID], "attn_decode:0+up_gate:1", *[f"{o}:0" for o in MID[1:]],
                 "up_gate:0", "c:0"], {"attn_decode:0": 0.25}),
    1024: _plan(1024, [("a", QKV + MID, [1024]), ("b", ["up_gate"], [256, 448, 320]), ("c", MLP, [1024])],
                ["a:0", "b:0", "b:1", "b:2", "c:0"], {})}


def _layer_ms(bucket: int, decodes: int = None, host_floor: bool = True) -> tuple[float, float, float]:
    """Modelled ms per layer: Sequential, the hand-tuned plan, run 4's searched plan."""
    from nfjax.schedule.api import ScheduleContext
    from nfjax.schedule.strategies import NanoFlow
    g = layer_graph()
    m = CostModel(RUN4, BatchClass(bucket, decodes or bucket // 8, 1280), host_floor)
    seq = sum(m.full_ms(op, 0, bucket) for op in g.names)
    hand = schedule_ms(NanoFlow(load_plan(HAND)).record(ScheduleContext(bucket, g)), m)
    return seq, hand, schedule_ms(record(RUN4_PLANS[bucket], g), m)


def test_host_bound_measurements_read_as_launches_plus_scaled_work():
    tok, ker = floors(RUN4)
    assert 0.012 < tok < 0.03 and ker == pytest.approx(0.04688)          # decode attention over no decode
    p, report = corrected(RUN4)
    dec = p["decode"]["ms"][0]
    assert dec[0] == LAUNCH_MS and dec[1:] == RUN4["decode"]["ms"][0][1:]    # GPU-bound rows as measured
    pf, raw = p["prefill"], RUN4["prefill"]
    assert pf["empty_ms"] == LAUNCH_MS
    # a 1024-row chunk from position 0: a quarter of the 2048-row chunk's query x key pairs
    assert pf["ms"][0][1] == pytest.approx(LAUNCH_MS + (raw["ms"][0][2] - LAUNCH_MS) / 4)
    assert pf["ms"][0][2] == raw["ms"][0][2]
    # o_proj: GPU-bound from 512 tokens; 256 tokens read as half of 512's work
    o = p["tokens"]["o_proj_op"]["ms"]
    assert o[3:] == RUN4["tokens"]["o_proj_op"]["ms"][3:]
    assert o[2] == pytest.approx(LAUNCH_MS + (o[3] - LAUNCH_MS) / 2)
    # the TP=1 reduce (a no-op) is host-bound at every size: its bytes at the copy rate, never above the measurement
    red, raw_red = p["tokens"]["attn_reduce"]["ms"], RUN4["tokens"]["attn_reduce"]["ms"]
    assert all(a <= b for a, b in zip(red, raw_red)) and red[0] < 0.4 * raw_red[0]
    assert set(report) >= {"attn_norm", "attn_reduce", "attn_decode@ctx1280", "attn_prefill@empty"}
    # up_gate is GPU-bound from 128 tokens: a point moves only to the sum of two smaller ones (run 4 merged the
    # copies' GEMMs: 512 tokens measured 0.1915 ms against 2 x 0.0928 at 256)
    ug = p["tokens"]["up_gate"]
    at = dict(zip(ug["tokens"], ug["ms"]))
    for x, was, now in report.get("up_gate", []):
        assert x == 64 or any(now == pytest.approx(at[a] + at[x - a]) for a in at if x - a in at)
    # a profile that states its floors is read with them (0: nothing is host-bound); the empty prefill launch,
    # measured above the 256-row chunk (0.0594 against 0.0520), is still read as at most that chunk
    same, none = corrected({**RUN4, "floor_ms": {"tokens": 0.0, "kernels": 0.0}})
    assert [k for k in none if "@" in k] == ["attn_prefill@empty"] and same["decode"] == RUN4["decode"]
    assert none["attn_prefill@empty"] == [(0, 0.059431, 0.052038)]


def test_a_pair_at_its_profiled_sizes_and_share_models_at_its_measured_time():
    """Run 4's fused kernel took 0.8389 ms at 256 decodes beside 1792 gate/up tokens on a quarter of the SMs;
    the parts read from the share-taking kernel's own time at share 1 modelled it at 0.88. At 0.2 of the SMs the
    fused kernel (0.9168) beat its decode part alone (0.9365): kappa < 0, and the pair models at the fused time."""
    m = CostModel(RUN4, BatchClass(2048, 256, 1280))
    for r in RUN4["pairs"]:
        s = r["share"]
        assert m.op_ms("attn_decode", 0, 256, s) == pytest.approx(r["a_ms"], rel=1e-3)
        assert m.op_ms("up_gate", 256, 2048, 1 - s) == pytest.approx(r["b_ms"], rel=1e-3)
        assert m.pair_ms("attn_decode", (0, 256), "up_gate", (256, 2048), (s, 1 - s)) == pytest.approx(
            r["fused_ms"], rel=1e-3)


def test_interference_follows_the_parts_balance():
    m = CostModel(RUN4, BatchClass(2048, 256, 1280))
    rows = sorted(RUN4["pairs"], key=lambda r: r["a_ms"] / r["b_ms"])
    ks = [m.kappa(("attn_decode", "up_gate"), (256, 1792), r["share"], r["a_ms"] / r["b_ms"]) for r in rows]
    assert ks == sorted(ks, reverse=True) and ks[0] > 0.4 and ks[-1] < 0    # the longer the decodes, the less
    # a 0.2 share balanced by sizes (decode part ~ gate/up part) is not read as the unbalanced 0.2 row's -0.03
    assert m.kappa(("attn_decode", "up_gate"), (256, 1792), 0.2, 1.0) > 0.15
    assert m.kappa(("attn_decode", "up_gate"), (256, 1792), 0.2, 9.0) == pytest.approx(ks[-1])   # clamped
    # nor a 0.25 share unbalanced by sizes as a 0.2 row (the larger of the two readings)
    assert m.kappa(("attn_decode", "up_gate"), (256, 1792), 0.25, 1.5) == pytest.approx(
        m.kappa(("attn_decode", "up_gate"), (256, 1792), 0.25))
    # a pair of a shape no row measured (256 decodes beside 896 tokens; the rows: 7 tokens a decode) is not
    # credited with an overlap
    assert m.kappa(("attn_decode", "up_gate"), (256, 896), 0.25, 1.0) == 1.0
    assert m.kappa(("attn_decode", "up_gate"), (128, 896), 0.25, 1.0) < 1.0


@pytest.mark.parametrize("bucket", [2048, 1024])
def test_the_model_ranks_the_plans_as_run_4_measured(bucket):
    """The hand-tuned plan models within 2% of its measured layer time and ahead of run 4's searched plan and of
    Sequential, as measured; before (as measured, ratio to share 1, kappa over the share) the hand-tuned plan
    modelled behind Sequential at 1024 (1.2425 against 1.2141) and behind the searched 320/1728 plan at 2048."""
    seq, hand, searched = _layer_ms(bucket)
    m_seq, m_hand, m_searched = MEASURED[bucket]
    assert hand == pytest.approx(m_hand, rel=0.02)
    assert searched == pytest.approx(m_searched, rel=0.05)
    assert hand < searched and hand < seq
    old_seq, old_hand, _ = _layer_ms(bucket, host_floor=False)
    assert old_hand > hand


def test_the_search_on_run_4_finds_the_hand_tuned_plan_at_2048():
    """Offline on run 4's profile the search's plan for 2048 tokens with 256 decodes is the hand-tuned one: the
    decodes' attention beside gate/up at 256/1792 on a quarter of the SMs, qkv and the MLP tail merged (run 4's own
    search wrote 320/1728, measured 0.989x the hand-tuned)."""
    (r,) = search(layer_graph(), RUN4, [2048], [256], 1280, 2, SearchOptions(time_limit=40))
    p = r.plan
    assert p is not None and p.share == {"attn_decode:0": 0.25}
    sizes = {op: gr.nano_batches for gr in p.groups for op in gr.ops}
    assert sizes["up_gate"] == sizes["attn_decode"] == (256, 1792)
    assert all(sizes[op] == (2048,) for op in QKV + MLP)
    assert "attn_decode:0+up_gate:1" in p.streams[0].order
    assert r.best_ms == pytest.approx(_layer_ms(2048, 256)[1], rel=1e-9)


def test_a_measured_sequential_layer_is_the_baseline():
    """With the profile's whole-layer table (here run 4's measured step / 32 where it has one: 1.9706 ms at
    2048 tokens / 256 decodes, 1.0611 at 1024 / 128; 1.82 and 1.20 made up for the other two corners), a plan is
    written only where it models `min_gain` (2%) under the measured layer: the hand-tuned structures at 2048/256 and
    1024/128 do (1.882, 1.008 modelled); at 2048/128 the best plan models 1.805 ms, under its ops' sum (1.899) and
    the layer's 1.82 but by less than 2%, and the class stays Sequential. (Two nano-batches at most: the time.)"""
    prof = {**RUN4, "layer": {"tokens": [1024, 2048], "decodes": [128, 256], "ctx": 1280, "chunks": 2,
                              "ms": [[1.0611, 1.20], [1.82, 1.9706]]}}
    assert CostModel(prof, BatchClass(2048, 256, 1280)).measured_sequential_ms() == pytest.approx(1.9706)
    assert CostModel(prof, BatchClass(2048, 256, 640)).measured_sequential_ms() is None       # other context
    assert CostModel(prof, BatchClass(2048, 64, 1280)).measured_sequential_ms() is None       # outside the table
    res = search(layer_graph(), prof, [2048, 1024], [128, 256], 1280, 2,
                 SearchOptions(nano_batches=(1, 2), time_limit=50))
    by = {(r.batch.tokens, r.batch.decodes): r for r in res}
    assert by[2048, 256].plan is not None and by[2048, 256].sequential_ms == pytest.approx(1.9706)
    assert by[1024, 128].plan is not None and by[1024, 128].best_ms < 1.0611 * 0.98
    r = by[2048, 128]
    assert r.plan is None and r.sequential_ms == pytest.approx(1.82) and r.best_ms == pytest.approx(1.82)
    best = min(c[2] for c in r.candidates if c[0].k > 1)
    assert 1.82 * 0.98 < best < 1.82 < sum(
        CostModel(RUN4, BatchClass(2048, 128, 1280)).full_ms(op, 0, 2048) for op in layer_graph().names)
    assert any("measured as a whole layer" in n for n in r.notes) and any("min_gain" in n for n in r.notes)
