"""NanoFlow plan files: shipped plans validate and plan, JSON round trip, validation errors name the field."""
import copy
import json
from pathlib import Path

import pytest

from nfjax.schedule import NanoFlow, Plan, PlanError, ScheduleContext, ScheduleError, layer_graph, load_plan, save_plan
from nfjax.schedule.plan import PLANS_DIR

from sched_common import TINY_PLAN

G = layer_graph()
SHIPPED = sorted(p.stem for p in PLANS_DIR.glob("*.json"))
# plans that lost, and ablations: not shipped, loaded by path (they must keep validating)
PROBES = sorted(str(p) for p in (Path(__file__).resolve().parents[2] / "bench" / "probes" / "plans").rglob("*.json"))


def test_shipped_plans_exist():
    assert SHIPPED == ["llama3-8b_h100_tp1_beside_mact", "llama3-8b_h200_tp2_beside"]
    assert len(PROBES) >= 16


@pytest.mark.parametrize("name", SHIPPED + PROBES)
def test_plan_records_at_its_bucket_and_scales(name):
    plan = load_plan(name)
    nf = NanoFlow(plan)
    sched = nf.record(ScheduleContext(plan.bucket, G, plan.tp))
    ops = [(op, i) for s in sched.steps for p in s.pieces for op in p.ops for i in p.nbs]
    assert sorted(ops) == sorted((op, i) for op in G.names for i in range(len(sched.nano_batches)))
    assert any(s.stream or s.parts for s in sched.steps)       # it overlaps: a second stream or a horizontal kernel
    assert nf.eligible(ScheduleContext(plan.min_bucket, G, plan.tp)) is None
    assert nf.eligible(ScheduleContext(plan.min_bucket // 2, G, plan.tp)) is not None


def test_round_trip(tmp_path):
    plan = load_plan(TINY_PLAN)
    p = save_plan(plan, tmp_path / "sub" / "again.json")
    again = load_plan(p)
    assert again == plan and again.to_json() == plan.to_json()
    assert json.loads(p.read_text()) == plan.to_json()
    assert Plan.from_json(plan.to_json()) == plan


def _bad(tmp_path, mutate):
    d = json.loads(open(TINY_PLAN).read())
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.pop("bucket"), r"bad.json: missing field 'bucket'"),
    (lambda d: d.update(bucket="64"), r"bad.json.bucket: expected an integer >= 1, got '64'"),
    (lambda d: d.update(colour=1), r"bad.json: unknown field 'colour'"),
    (lambda d: d.update(format=2), r"bad.json.format: this nfjax reads format 1"),
    (lambda d: d["groups"][1]["nano_batches"].append(8), r"bad.json.groups\[1\].nano_batches: sizes must sum to "
                                                         r"bucket=64, got 72"),
    (lambda d: d["groups"][0]["ops"].__setitem__(1, "qkv_proj"), r"bad.json.groups\[0\].ops\[1\]: unknown op "
                                                                 r"'qkv_proj'"),
    (lambda d: d["groups"][3]["ops"].append("kqv"), r"bad.json.groups\[3\].ops\[5\]: op 'kqv' is already in "
                                                    r"group 'qkv'"),
    (lambda d: d["groups"][3]["ops"].remove("act"), r"bad.json.groups: op 'act' is in no group"),
    (lambda d: d["groups"][2].update(name="kqv"), r"bad.json.groups\[2\].name: 'kqv' is already a group or op"),
    (lambda d: d["streams"][0]["order"].__setitem__(0, "qkv"), r"bad.json.streams\[0\].order\[0\]: expected "
                                                               r"'GROUP:K'"),
    (lambda d: d["streams"][0]["order"].__setitem__(0, "qkv:7"), r"bad.json.streams\[0\].order\[0\]: group 'qkv' "
                                                                 r"has 3 nano-batches, no 7"),
    (lambda d: d["streams"][0]["order"].append("o:0"), r"bad.json.streams\[0\].order\[7\]: o_proj_op:0 is already "
                                                       r"ordered"),
    (lambda d: d["streams"][1]["order"].pop(), r"bad.json.streams: attn_decode:1 \(group 'attn'\) is in no stream"),
    (lambda d: d["streams"][1]["order"].append("rope_append:2"), r"bad.json.streams\[1\].order\[2\]: 'rope_append' "
                                                                 r"must be on stream 0"),
    (lambda d: d["streams"][1].update(stream=0), r"bad.json.streams: stream ids must be distinct"),
    (lambda d: d["share"].update(kqv=1.5), r"bad.json.share.kqv: must be a number in \(0, 1\], got 1.5"),
    (lambda d: d["share"].update(qkv=0.5), r"bad.json.share.qkv: unknown op 'qkv'"),
    (lambda d: d["share"].update({"down:9": 0.5}), r"bad.json.share.down:9: '9' is not a nano-batch index of "
                                                   r"group 'mlp'"),
    (lambda d: d["share"].update({"dwn:1": 0.5}), r"bad.json.share.dwn:1: unknown op 'dwn'"),
    (lambda d: d.update(xla_dot_merger="yes"), r"bad.json.xla_dot_merger: must be true or false, got 'yes'"),
])
def test_validation_errors_name_the_field(tmp_path, mutate, msg):
    with pytest.raises(PlanError, match=msg):
        load_plan(_bad(tmp_path, mutate))


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(PlanError, match="no such file"):
        load_plan("no_such_plan")
    p = tmp_path / "x.json"
    p.write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(p)


def test_deadlocking_stream_orders_are_reported():
    d = json.loads(open(TINY_PLAN).read())
    # any order that respects dependencies records: stream 1 may run nano-batch 1's attention first
    d["streams"][1]["order"] = ["attn:1", "attn:0"]
    plan = Plan.from_json(copy.deepcopy(d)).validate(G)
    sched = NanoFlow(plan).record(ScheduleContext(64, G, 1))
    assert sched.order.index(next(s for s in sched.order if s.startswith("attn_decode@3"))) < \
        sched.order.index(next(s for s in sched.order if s.startswith("attn_decode@0")))
    # stream 0 wants o:1 (needs attention of tokens 32..63) before qkv:2, which every attention waits for
    d["streams"][0]["order"] = ["qkv:0", "qkv:1", "o:1", "qkv:2", "o:0", "mlp:0", "mlp:1"]
    plan = Plan.from_json(d).validate(G)
    with pytest.raises(ScheduleError, match="deadlock; every stream waits: stream 0: o_proj_op"):
        NanoFlow(plan).record(ScheduleContext(64, G, 1))


def test_per_nano_batch_share_wins_over_the_op_share():
    d = json.loads(open(TINY_PLAN).read())
    d["share"] = {"down": 0.5, "down:1": 0.75}
    plan = Plan.from_json(d).validate(G)
    assert (plan.share_of("down", 0), plan.share_of("down", 1), plan.share_of("kqv", 0)) == (0.5, 0.75, None)
    sched = NanoFlow(plan).record(ScheduleContext(64, G, 1))
    # mlp's nano-batches are tokens [0:16] and [16:64]
    assert [s for s in sched.order if s.startswith("down@")] == ["down@0,1[0:16] share=0.5",
                                                                 "down@2,3[16:64] share=0.75"]


def test_a_plan_may_keep_the_dot_merger():
    """Split variants compile with XLA's dot merger off, unless their plan says `xla_dot_merger: true`."""
    from nfjax.config import StrategyConfig
    from nfjax.schedule.variants import Variant
    d = json.loads(open(TINY_PLAN).read())
    for keep, want in ((False, {"xla_gpu_dot_merger_threshold_mb": 0}), (True, {})):
        plan = Plan.from_json({**d, "xla_dot_merger": keep}).validate(G)
        assert plan.xla_dot_merger is keep and Plan.from_json(plan.to_json()) == plan
        nf = NanoFlow(plan)
        v = Variant(nf.name, StrategyConfig(), nf.record(ScheduleContext(64, G, 1)), nf.splits, nf.dot_merger)
        assert v.splits and v.compiler_options() == want
