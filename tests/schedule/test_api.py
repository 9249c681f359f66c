"""Op graph, scheduling API, strategy orders, nano-batch metadata and the per-batch choice: recording only (no
compiles)."""
import numpy as np
import pytest

from nfjax.config import ConfigError, ExecutionConfig, StrategyConfig
from nfjax.kv.metadata import build_metadata
from nfjax.models.ops import Resource
from nfjax.schedule import (REDUCE_NORM, CommOverlap, DualBatchOverlap, FusedReduceNorm, NanoBatchOnly,
                            ScheduleContext, ScheduleError, Strategy, Sequential, layer_graph)
from nfjax.schedule.meta import nano_metadata
from nfjax.schedule.variants import Variants

G = layer_graph()


def ctx(t=64, tp=2):
    return ScheduleContext(t, G, tp)


def test_graph_comes_from_the_model_ops():
    from nfjax.models.llama import LAYER_OPS
    assert G.names == tuple(s.name for s in LAYER_OPS)
    assert G["attn_decode"].resource is Resource.MEMORY and G["attn_prefill"].resource is Resource.COMPUTE
    assert G.by_resource(Resource.NETWORK) == ("attn_reduce", "mlp_reduce")
    assert dict(G["attn_prefill"].deps) == {"q_rot": "rope_append", "kv": "rope_append", "attn_d": "attn_decode"}
    assert dict(G["ffn_norm"].deps) == {"x": None, "o": "attn_reduce"}      # x: the layer input
    assert G["rope_append"].writes_global
    assert G.stages() == (("attn_norm", "kqv", "rope_append"),
                          ("attn_decode", "attn_prefill", "o_proj_op", "attn_reduce"),
                          ("ffn_norm", "up_gate", "act", "down", "mlp_reduce", "residual"))


class Probe(Strategy):
    """Runs a test body as its schedule."""
    name = "probe"

    def __init__(self, body):
        self.body = body

    def schedule(self, ctx):
        self.body(self, ctx)


def test_ready_ops_follow_dependencies():
    seen = {}

    def body(s, c):
        s.split([16, 48])
        seen["start"] = [o.name for o in s.get_ready_ops(1)]
        for name in ("attn_norm", "kqv", "rope_append"):
            s.execute(s.nano_op(name, 0))
        # the cache is read only after every nano-batch wrote it
        seen["after_nb0_rope"] = [o.name for o in s.get_ready_ops(0)]
        for name in ("attn_norm", "kqv", "rope_append"):
            s.execute(s.nano_op(name, 1))
        seen["after_all_rope"] = [o.name for o in s.get_ready_ops(0)]
        for node in c.graph:
            for i in (0, 1):
                if not s.is_done(node.name, i):
                    s.execute(s.nano_op(node.name, i))

    sched = Probe(body).record(ctx())
    assert seen["start"] == ["attn_norm"]
    assert seen["after_nb0_rope"] == []
    assert seen["after_all_rope"] == ["attn_decode"]
    assert len(sched.steps) == 2 * len(G) and sched.carry_ranges == ((0, 16), (16, 64))


@pytest.mark.parametrize("body,msg", [
    (lambda s, c: s.split([10, 10]), "sum to the bucket's 64"),
    (lambda s, c: (s.split([32, 32]), s.execute(s.nano_op("kqv", 0))), "kqv@0 is not ready: it waits for attn_norm@0"),
    (lambda s, c: (s.split([32, 32]), s.execute(s.nano_op("attn_norm", 0)), s.execute(s.nano_op("attn_norm", 0))),
     "already executed"),
    (lambda s, c: (s.split([16, 16, 32]), s.execute([s.nano_op("attn_norm", 0), s.nano_op("attn_norm", 2)])),
     "must be adjacent"),
    (lambda s, c: (s.split([64]), s.execute([s.nano_op("attn_norm", 0), s.nano_op("kqv", 0)])), "need kernel="),
    (lambda s, c: (s.split([64]), s.execute(s.nano_op("attn_norm", 0)), s.execute(s.nano_op("kqv", 0)),
                   s.execute(s.nano_op("rope_append", 0), stream=1)), "rope_append must stay on the main stream"),
    (lambda s, c: (s.split([64]), s.execute(s.nano_op("attn_norm", 0), share=1.5)), "share must be in"),
    (lambda s, c: (s.split([64]), s.execute(s.nano_op("attn_norm", 0))), "ops never executed: kqv@0"),
    (lambda s, c: (s.split([64]), s.nano_op("qkv", 0)), "no op named 'qkv'"),
])
def test_schedule_errors_name_the_culprit(body, msg):
    with pytest.raises(ScheduleError, match=msg):
        Probe(body).record(ctx())


def test_merged_and_fused_execution():
    def body(s, c):
        s.split([16, 16, 32])
        s.execute([s.nano_op("attn_norm", 0), s.nano_op("attn_norm", 1)])        # merged
        s.execute(s.nano_op("attn_norm", 2))
        for name in ("kqv", "rope_append", "attn_decode", "attn_prefill", "o_proj_op"):
            s.execute([s.nano_op(name, i) for i in range(3)])                     # one op on all three
        s.execute([s.nano_op(n, i) for n in REDUCE_NORM.replaces for i in (0, 1, 2)], kernel=REDUCE_NORM)
        for name in ("up_gate", "act", "down", "mlp_reduce", "residual"):
            for i in range(3):
                s.execute(s.nano_op(name, i))

    sched = Probe(body).record(ctx())
    assert sched.order[:2] == ["attn_norm@0,1[0:32]", "attn_norm@2[32:64]"]
    fused = [s for s in sched.steps if s.kernel]
    assert len(fused) == 1 and fused[0].ops == ("attn_reduce", "ffn_norm") and fused[0].ins == ("o_partial", "x")
    # kqv reads attn_norm's two pieces as one; the fused kernel reads the residual carried in three pieces
    assert sched.buffered == {"h", "x"}
    assert sched.carry_ranges == ((0, 16), (16, 32), (32, 64))


def test_comm_overlap_issues_each_all_reduce_before_the_next_gemm():
    order = CommOverlap((1, 1)).record(ctx()).order
    pos = {s.split("[")[0]: i for i, s in enumerate(order)}
    assert pos["attn_reduce@0"] == pos["o_proj_op@0"] + 1 and pos["attn_reduce@0"] < pos["o_proj_op@1"]
    assert pos["mlp_reduce@0"] == pos["down@0"] + 1 and pos["mlp_reduce@0"] < pos["down@1"]
    # the baseline that only splits keeps op order: both GEMMs before either all-reduce
    base = [s.split("[")[0] for s in NanoBatchOnly((1, 1)).record(ctx()).order]
    assert base.index("o_proj_op@1") < base.index("attn_reduce@0")


def test_fused_reduce_norm_replaces_two_ops():
    sched = FusedReduceNorm((1, 1), align=8).record(ctx())
    names = [s.kernel or s.ops[0] for s in sched.steps]
    assert names.count("reduce_norm") == 2 and "attn_reduce" not in names and "ffn_norm" not in names
    assert not FusedReduceNorm().splits and FusedReduceNorm((1, 1)).splits


def test_dual_batch_overlaps_attention_of_one_with_mlp_of_the_other():
    sched = DualBatchOverlap().record(ctx())
    order = [s.split("[")[0].split(" ")[0] for s in sched.order]
    first_mlp0, last_attn1 = order.index("ffn_norm@0"), order.index("attn_prefill@1")
    assert order.index("attn_decode@1") < first_mlp0 < last_attn1        # interleaved in recorded order
    by = {repr(s).split("[")[0]: s.stream for s in sched.steps}
    assert by["kqv@0"] is None and by["kqv@1"] == 1 and by["rope_append@1"] is None and by["attn_reduce@1"] is None


def test_split_sizes_and_eligibility():
    assert NanoBatchOnly((1, 15), align=4).sizes(ctx()) == [4, 60]
    assert NanoBatchOnly((1, 1, 2), align=8).sizes(ctx()) == [16, 16, 32]
    assert NanoBatchOnly((1, 1), align=8).eligible(ctx(t=8)) is not None   # 8 tokens cannot split at 8
    with pytest.raises(ScheduleError, match="cannot run"):
        NanoBatchOnly((1, 1), align=8).record(ctx(t=8))


def _positions_from_kernel_fields(m):
    """What a kernel derives: token i of sequence s sits at seq_lens[s] - q_len[s] + (i - query_start[s])."""
    qs, lens, nd = np.asarray(m.query_start), np.asarray(m.seq_lens), int(m.num_decode)
    out = {}
    for s in range(len(lens)):
        for i in range(qs[s], qs[s + 1]):
            out[i] = (s, lens[s] - (qs[s + 1] - qs[s]) + (i - qs[s]))
    return out, nd


@pytest.mark.parametrize("lo,hi", [(0, 2), (1, 3), (0, 12), (2, 12), (5, 9), (12, 30), (20, 32), (0, 32)])
def test_nano_metadata_is_a_batch_of_its_own(lo, hi):
    """3 decodes, then prefill chunks of 9 and 11 tokens, then padding: every nano-batch, also one cutting a
    decode run or a chunk, sees its tokens at the right sequence and position through the kernel-facing fields
    (rebased query_start / seq_lens / num_decode / page_table) and the per-token ones."""
    seqs = [([1], 4, 1), ([2], 7, 1), ([3, 4], 9, 1), ([5, 6], 3, 9), ([7, 8], 0, 11)]
    full = build_metadata(seqs, 32, 6, 4, 8, num_decode=3).to_device()
    m = nano_metadata(full, lo, hi)
    real = 23
    derived, nd = _positions_from_kernel_fields(m)
    assert nd == max(0, min(3, hi) - lo)                                       # decode rows of [lo, hi)
    pt_full, pt = np.asarray(full.page_table), np.asarray(m.page_table)
    for i in range(lo, min(hi, real)):
        s, pos = derived[i - lo]
        assert pos == int(full.positions[i])                                   # kernel view
        g = int(full.token_seq[i])
        assert (pt[s] == pt_full[g]).all() and int(m.token_seq[i - lo]) == s  # same sequence, both views
        assert (i < 3) == (s < nd)                                             # decode rows first
    assert np.array_equal(np.asarray(m.positions), np.asarray(full.positions)[lo:hi])
    assert nano_metadata(full, 0, 32) is full


def test_variants_choose_per_batch():
    cfg = ExecutionConfig((StrategyConfig("nanobatch", min_bucket=64, min_tokens=40),
                          StrategyConfig("comm_overlap", split=(1, 3), align=4, min_decode=8)))
    v = Variants(cfg, (16, 64), tp=1)
    assert set(v.by_bucket[16]) == {"comm_overlap:1-3", "sequential"}
    assert set(v.by_bucket[64]) == {"nanobatch:1-1", "comm_overlap:1-3", "sequential"}
    assert v.choose(64, num_tokens=50, num_decode=2) == "nanobatch:1-1"       # first that qualifies
    assert v.choose(64, num_tokens=30, num_decode=9) == "comm_overlap:1-3"
    assert v.choose(64, num_tokens=30, num_decode=2) == "sequential"          # the fallback
    assert v.choose(16, num_tokens=16, num_decode=16) == "comm_overlap:1-3"
    assert v.choose(16, num_tokens=16, num_decode=0, pinned="nanobatch:1-1") == "sequential"   # not compiled
    assert v.skipped[(16, "nanobatch:1-1")] == "bucket < min_bucket=64"


@pytest.mark.parametrize("kw,msg", [
    (dict(kind="nope"), "kind must be one of"),
    (dict(kind="nanoflow"), "plan is required"),
    (dict(kind="nanobatch", split=(1, 0)), "split weights must be positive"),
    (dict(kind="dual_batch", split=(1, 1, 1)), "dual_batch needs a split of 2"),
    (dict(kind="nanobatch", min_tokens=-1), "min_tokens must be >= 0"),
])
def test_strategy_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        StrategyConfig(**kw)
    with pytest.raises(ConfigError, match="labelled 'nanobatch:1-1'"):
        ExecutionConfig((StrategyConfig("nanobatch"), StrategyConfig("nanobatch")))


def test_config_kinds_are_the_strategy_registry():
    """nfjax.config names the kinds without importing JAX code; the registry maps the same names to classes, and
    every class builds from a config with its label."""
    from nfjax.config import STRATEGY_KINDS
    from nfjax.schedule.strategies import STRATEGIES
    from nfjax.schedule.variants import build_strategy
    assert tuple(STRATEGIES) == STRATEGY_KINDS
    for kind, cls in STRATEGIES.items():
        sc = StrategyConfig(kind, plan="llama3-8b_h100_tp1_beside_mact" if kind == "nanoflow" else None, name="x")
        s = build_strategy(sc)
        assert type(s) is cls and s.kind == kind and s.name == "x"


@pytest.mark.parametrize("spec", ["sequential", "nanobatch:1-1", "dual_batch:1-3", "comm_overlap:1-1-2",
                                  "nanoflow:llama3-8b_h100_tp1_beside_mact"])
def test_strategy_spec_round_trips_through_its_label(spec):
    sc = StrategyConfig.from_spec(spec, align=64)
    assert sc.label == spec and sc.align == 64


@pytest.mark.parametrize("spec,msg", [("nanobatch:a-b", "weights like 1-1"), ("nanoflow", "plan is required"),
                                      ("bogus:1-1", "kind must be one of")])
def test_bad_strategy_spec_names_the_problem(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        StrategyConfig.from_spec(spec)


def test_sequential_is_the_plain_forward():
    sched = Sequential().record(ctx())
    assert [s.ops[0] for s in sched.steps] == list(G.names) and sched.carry_ranges == ((0, 64),)
    assert not sched.buffered and all(s.stream is None for s in sched.steps)


def test_horizontal_kernel_runs_ops_of_different_nano_batches_side_by_side():
    from nfjax.schedule.api import Strategy
    from nfjax.schedule.beside import DECODE_BESIDE_UP_GATE as K

    class Beside(Strategy):
        name = "beside"

        def __init__(self, pair, stream=None):
            self.pair, self.stream = pair, stream

        def schedule(self, c):
            self.split([8, 56])
            for name in ("attn_norm", "kqv", "rope_append"):
                self.execute([self.nano_op(name, 0), self.nano_op(name, 1)])
            for name in ("attn_decode", "attn_prefill", "o_proj_op", "attn_reduce", "ffn_norm"):
                self.execute(self.nano_op(name, 1))
            self.execute([self.nano_op(op, i) for op, i in self.pair], kernel=K, stream=self.stream,
                         shares=[0.25, None])
            for i in (1, 0):            # the rest, in graph order
                while ready := self.get_ready_ops(i):
                    self.execute(ready[0])

    sched = Beside([("attn_decode", 0), ("up_gate", 1)]).record(ctx())
    step = next(s for s in sched.steps if s.parts)
    assert repr(step) == "decode_beside_up_gate(attn_decode@0[0:8] share=0.25 + up_gate@1[8:64])"
    assert [(p.ops, p.start, p.stop, p.ins, p.outs) for p in step.parts] == [
        (("attn_decode",), 0, 8, ("q_rot", "kv"), ("attn_d",)), (("up_gate",), 8, 64, ("h2",), ("gate", "up"))]
    ops = sorted((op, i) for s in sched.steps for p in s.pieces for op in p.ops for i in p.nbs)
    assert ops == sorted((op, i) for op in G.names for i in (0, 1))
    with pytest.raises(ScheduleError, match="runs \\['attn_decode', 'up_gate'\\] side by side"):
        Beside([("attn_decode", 0), ("down", 1)]).record(ctx())
    with pytest.raises(ScheduleError, match="it runs on stream 0"):
        Beside([("attn_decode", 0), ("up_gate", 1)], stream=1).record(ctx())
    with pytest.raises(ScheduleError, match="not ready before the kernel runs"):   # up_gate@0 needs attn_decode@0
        Beside([("attn_decode", 0), ("up_gate", 0)]).record(ctx())
