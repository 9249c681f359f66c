"""The search end to end on a device-like synthetic profile: the structure it finds, the plan it writes, its time
limit and its fallbacks (a timed-out solve keeps its incumbent, nothing feasible is Sequential; both say so)."""
import time

import pytest

from synthetic import h100_like
from nfjax.autosearch import milp
from nfjax.autosearch.costs import BatchClass, CostModel
from nfjax.autosearch.emit import record, schedule_ms
from nfjax.autosearch.search import SearchOptions, bands, search
from nfjax.schedule.graph import layer_graph
from nfjax.schedule.plan import load_plan


def test_search_finds_the_decodes_attention_beside_the_prefill_gate_up():
    """With 256 decodes in a 2048-token step, the search's plan is the hand-tuned `_mact` structure: the decodes'
    attention beside the prefill tokens' gate/up on a quarter of the SMs, attention..gate/up split with every
    decode in the first nano-batch, the rest merged; the written plan records and models at the structure's time, which is no worse than the
    hand-tuned plan's under the same model."""
    g = layer_graph()
    prof = h100_like()
    (r,) = search(g, prof, [2048], [256], 1280, 2, SearchOptions(time_limit=60))
    plan = r.plan
    assert plan is not None and r.best_ms < r.sequential_ms
    assert plan.bucket == plan.min_bucket == plan.max_bucket == 2048 and plan.min_decode == 128
    assert plan.streams[0].order.count("attn_decode:0+up_gate:1") == 1
    assert plan.share == {"attn_decode:0": 0.25}
    split = {op for gr in plan.groups if len(gr.nano_batches) == 2 for op in gr.ops}
    assert {"attn_decode", "attn_prefill", "o_proj_op", "ffn_norm", "up_gate"} <= split
    assert not split & {"attn_norm", "kqv", "act", "down"}
    sizes = next(gr.nano_batches for gr in plan.groups if "up_gate" in gr.ops)
    assert sizes[0] >= 256 and sum(sizes) == 2048 and all(n % 64 == 0 for n in sizes)   # all decodes in the pair
    model = CostModel(prof, BatchClass(2048, 256, 1280))
    ls = record(plan, g)
    assert schedule_ms(ls, model) == pytest.approx(r.best_ms, rel=1e-9)
    hand = schedule_ms(record(load_plan("llama3-8b_h100_tp1_beside_mact"), g), model)
    assert r.best_ms <= hand + 1e-9
    assert not [n for n in r.notes if "models at" in n]


def test_two_buckets_and_two_bands_within_the_time_limit():
    t = time.perf_counter()
    res = search(layer_graph(), h100_like(), [2048, 1024], [128, 256], 1280, 2, SearchOptions(time_limit=60))
    assert time.perf_counter() - t < 60
    assert [(r.batch.tokens, r.batch.decodes, r.min_decode) for r in res] == [
        (2048, 128, 64), (2048, 256, 181), (1024, 128, 64), (1024, 256, 181)]
    for r in res:
        assert r.best_ms <= r.sequential_ms + 1e-12
        if r.plan:
            assert r.plan.name == f"llama3-8b_h100_tp1_auto_t{r.batch.tokens}_d{r.batch.decodes}"


def test_bands():
    assert bands([256, 128, 512]) == [(128, 64), (256, 181), (512, 362)]


def test_a_search_out_of_time_is_sequential_and_says_so():
    (r,) = search(layer_graph(), h100_like(), [2048], [256], 1280, 2, SearchOptions(time_limit=0.01))
    assert r.plan is None and r.best_ms == r.sequential_ms
    assert any("time limit" in n for n in r.notes) and any("Sequential" in n for n in r.notes)


def test_nothing_feasible_is_sequential_and_says_so():
    (r,) = search(layer_graph(), h100_like(), [2048], [256], 1280, 2,
                  SearchOptions(nano_batches=(1,), min_overlaps=1))
    assert r.plan is None and any("Sequential" in n for n in r.notes)


def test_a_timed_out_solve_keeps_its_incumbent_and_says_so(monkeypatch):
    real = milp.solve

    def stopped(prob, limit):          # the solver's answer as when its time limit ends the search
        res = real(prob, limit)
        return milp.Solved("incumbent", res.seconds, res.solver) if res.status != "none" else res
    monkeypatch.setattr(milp, "solve", stopped)
    (r,) = search(layer_graph(), h100_like(), [2048], [256], 1280, 2, SearchOptions(nano_batches=(1, 2), top=1))
    assert r.plan is not None
    assert any("best incumbent" in n for n in r.notes)
    assert r.structure.status == "incumbent"


def test_a_cpu_profile_with_nothing_to_overlap_gives_sequential():
    """Where the horizontal kernel runs its parts in turn (a CPU profile: fused = both parts), a split only costs:
    Sequential."""
    prof = h100_like(device="cpu")
    prof["shares"] = {}
    prof["num_sms"] = 0
    prof["pairs"] = [{"kernel": "decode_beside_up_gate", "ops": ["attn_decode", "up_gate"], "sizes": [256, 1792],
                      "share": 0.25, "fused_ms": 0.51 + 0.58, "a_ms": 0.51, "b_ms": 0.58}]
    (r,) = search(layer_graph(), prof, [2048], [256], 1280, 2, SearchOptions(time_limit=60))
    assert r.plan is None and r.best_ms == r.sequential_ms
