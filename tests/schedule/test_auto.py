"""`--plan auto` and the plan fields the search writes: the shipped plans of the model shape, device and TP degree
(autosearched ones first), one per bucket and decode band, chosen per batch by the runtime; Sequential where none
applies."""
import dataclasses

import pytest

from nfjax.config import ExecutionConfig, StrategyConfig
from nfjax.engine.builder import engine_config, overrides_from_args
from nfjax.models.random_init import SHAPES
from nfjax.schedule.auto import auto_plans, resolve_auto
from nfjax.schedule.plan import PlanError, load_plan, save_plan
from nfjax.schedule.variants import Variants

AUTO = ExecutionConfig(strategies=(StrategyConfig("nanoflow", plan="auto"),))


def test_auto_picks_the_shipped_plan_of_the_key():
    ex, msg = resolve_auto(AUTO, SHAPES["llama3-8b"], 1, device="h100")
    (s,) = ex.strategies
    assert s.plan.endswith("llama3-8b_h100_tp1_beside_mact.json") and s.min_decode == 128 and s.min_bucket == 1024
    assert "llama3-8b_h100_tp1_beside_mact (decodes >= 128)" in msg
    ex, _ = resolve_auto(AUTO, SHAPES["llama3-8b"], 2, device="h200")
    assert [s.plan.rsplit("/", 1)[-1] for s in ex.strategies] == ["llama3-8b_h200_tp2_beside.json"]


@pytest.mark.parametrize("cfg, tp, device", [(SHAPES["llama3-8b"], 1, "a100"), (SHAPES["llama3-8b"], 4, "h100"),
                                              (SHAPES["smoke"], 1, "h100")])
def test_auto_without_a_plan_is_sequential(cfg, tp, device):
    ex, msg = resolve_auto(AUTO, cfg, tp, device=device)
    assert ex.strategies == () and "Sequential" in msg


def test_auto_from_the_flags_on_this_cpu_is_sequential(capsys):
    cfg = engine_config(SHAPES["smoke"], overrides_from_args({"plan": "auto"}))
    assert cfg.execution.strategies == ()
    assert "--plan auto: no shipped plan for smoke on cpu at TP=1; Sequential" in capsys.readouterr().err


def test_load_plan_auto_says_where_it_is_resolved():
    with pytest.raises(PlanError, match="resolved when the engine is built"):
        load_plan("auto")


def _searched(tmp_path):
    """The hand-tuned plan as if searched for two decode bands at 2048 and one at 1024."""
    hand = load_plan("llama3-8b_h100_tp1_beside_mact")
    out = []
    for bucket, dec, lo in ((2048, 128, 64), (2048, 256, 181), (1024, 128, 64)):
        groups = tuple(dataclasses.replace(g, nano_batches=tuple(n * bucket // 2048 for n in g.nano_batches))
                       for g in hand.groups)
        p = dataclasses.replace(hand, name=f"auto_t{bucket}_d{dec}", bucket=bucket, min_bucket=bucket,
                                max_bucket=bucket, min_decode=lo, groups=groups, source="nfjax autosearch (test)")
        out.append(save_plan(p, tmp_path / f"llama3-8b_h100_tp1_auto_t{bucket}_d{dec}.json"))
    save_plan(hand, tmp_path / "llama3-8b_h100_tp1_beside_mact.json")
    return out


def test_searched_plans_win_over_hand_tuned_and_follow_the_decode_bands(tmp_path):
    _searched(tmp_path)
    chosen = auto_plans("llama3-8b", "h100", 1, plans_dir=tmp_path)
    assert [p.stem for p, _ in chosen] == ["llama3-8b_h100_tp1_auto_t2048_d256", "llama3-8b_h100_tp1_auto_t2048_d128",
                                           "llama3-8b_h100_tp1_auto_t1024_d128"]
    ex, _ = resolve_auto(AUTO, SHAPES["llama3-8b"], 1, device="h100", plans_dir=tmp_path)
    v = Variants(ex, (512, 1024, 2048), tp=1)
    assert set(v.by_bucket[512]) == {"sequential"}
    assert set(v.by_bucket[1024]) == {"sequential", "nanoflow:llama3-8b_h100_tp1_auto_t1024_d128"}
    assert set(v.by_bucket[2048]) == {"sequential", "nanoflow:llama3-8b_h100_tp1_auto_t2048_d256",
                                      "nanoflow:llama3-8b_h100_tp1_auto_t2048_d128"}
    assert "buckets <= 1024" in v.skipped[(2048, "nanoflow:llama3-8b_h100_tp1_auto_t1024_d128")]
    assert v.choose(2048, 2048, 300) == "nanoflow:llama3-8b_h100_tp1_auto_t2048_d256"
    assert v.choose(2048, 2048, 181) == "nanoflow:llama3-8b_h100_tp1_auto_t2048_d256"
    assert v.choose(2048, 2048, 180) == "nanoflow:llama3-8b_h100_tp1_auto_t2048_d128"
    assert v.choose(2048, 2048, 63) == "sequential"
    assert v.choose(1024, 1024, 100) == "nanoflow:llama3-8b_h100_tp1_auto_t1024_d128"


def test_new_plan_fields_round_trip_and_are_checked(tmp_path):
    p = save_plan(dataclasses.replace(load_plan("llama3-8b_h100_tp1_beside_mact"), max_bucket=2048, min_decode=64),
                  tmp_path / "p.json")
    again = load_plan(p)
    assert (again.max_bucket, again.min_decode) == (2048, 64)
    p.write_text(p.read_text().replace('"min_decode": 64', '"min_decode": -1'))
    with pytest.raises(PlanError, match=r"p.json.min_decode: expected an integer >= 0"):
        load_plan(p)
