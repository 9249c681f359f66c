"""The cost model and the search on run 7's H100 profile (tests/autosearch/data/h100_run7_profile.json, a copy of
bench/results/autosearch-run7-profile-20261128.json) against what run 7 measured (step / 32,
bench/results/autosearch-run7-20261128.json): the hand-tuned plan 1.0499 / 1.9473 ms a layer against Sequential's
1.0682 / 1.9996 at 1,024 / 2,048 tokens. Run 7's model put the hand-tuned plan at 1.3455 / 2.1029 against
Sequential's 1.0811 / 2.0031 and searched Sequential: its prefill attention over no prefill row measured 0.191 ms
(a 256-row chunk 0.049), and the model charged that to every prefill launch."""
import json
from pathlib import Path

import pytest

from nfjax.autosearch.costs import BatchClass, CostModel
from nfjax.autosearch.emit import record, schedule_ms
from nfjax.autosearch.floor import LAUNCH_MS, corrected
from nfjax.autosearch.search import SearchOptions, search
from nfjax.schedule.api import ScheduleContext
from nfjax.schedule.graph import layer_graph
from nfjax.schedule.plan import load_plan
from nfjax.schedule.strategies import NanoFlow

RUN7 = json.loads((Path(__file__).parent / "data" / "h100_run7_profile.json").read_text())
HAND = "llama3-8b_h100_tp1_beside_mact"
MID = ["attn_decode", "attn_prefill", "o_proj_op", "attn_reduce", "ffn_norm"]


def _model(bucket: int, prof: dict = RUN7) -> CostModel:
    return CostModel(prof, BatchClass(bucket, bucket // 8, 1280))


def _hand_ms(m: CostModel, bucket: int) -> float:
    return schedule_ms(NanoFlow(load_plan(HAND)).record(ScheduleContext(bucket, layer_graph())), m)


def test_an_empty_prefill_launch_is_read_as_at_most_its_least_chunk():
    p, report = corrected(RUN7)
    assert RUN7["prefill"]["empty_ms"] == 0.191195 and p["prefill"]["empty_ms"] == LAUNCH_MS
    assert report["attn_prefill@empty"] == [(0, 0.191195, LAUNCH_MS)]
    # with no host-bound reading (floors 0), the least chunk measured (0.048849: 256 rows from position 0)
    p, _ = corrected({**RUN7, "floor_ms": {"tokens": 0.0, "kernels": 0.0}})
    assert p["prefill"]["empty_ms"] == 0.048849
    # an empty launch measured under every chunk is not raised
    low = {**RUN7, "prefill": {**RUN7["prefill"], "empty_ms": 0.004}}
    assert corrected(low)[0]["prefill"]["empty_ms"] == 0.004


@pytest.mark.parametrize("bucket", [1024, 2048])
def test_sequentials_ops_sum_to_its_measured_layer(bucket):
    """Its ops summed to 1.2213 / 2.1310 ms against the measured 1.0811 / 2.0031 (13% and 6% over: prefill
    attention on the two chunks at the 0.191 ms floor); now 1.0548 / 2.0009."""
    m = _model(bucket)
    ops = sum(m.full_ms(op, 0, bucket) for op in layer_graph().names)
    assert ops == pytest.approx(m.measured_sequential_ms(), rel=0.03)
    assert m.full_ms("attn_prefill", 0, bucket // 8) == LAUNCH_MS          # the decode nano-batch's launch


@pytest.mark.parametrize("bucket", [1024, 2048])
def test_the_hand_tuned_plan_models_ahead_of_sequential_as_measured(bucket):
    """Measured 1.017x / 1.027x Sequential's step; modelled 0.993 / 1.787 against 1.055 / 2.001 (the model
    credits the plan more than it measured: 6% / 11% against 2% / 3%)."""
    m = _model(bucket)
    seq = min(sum(m.full_ms(op, 0, bucket) for op in layer_graph().names), m.measured_sequential_ms())
    assert _hand_ms(m, bucket) < 0.98 * seq


@pytest.mark.parametrize("bucket,decodes,sizes", [(2048, 256, (256, 1792)), (1024, 128, (128, 896))])
def test_the_search_on_run_7_finds_the_hand_tuned_structure(bucket, decodes, sizes):
    """Run 7's search wrote Sequential at both batches; now the decodes' attention beside the prefill tokens'
    gate/up on a quarter of the SMs, attention..gate/up split, the rest merged: the hand-tuned plan."""
    (r,) = search(layer_graph(), RUN7, [bucket], [decodes], 1280, 2,
                  SearchOptions(nano_batches=(1, 2), time_limit=30))
    p = r.plan
    assert p is not None and p.share == {"attn_decode:0": 0.25}
    got = {op: gr.nano_batches for gr in p.groups for op in gr.ops}
    assert all(got[op] == sizes for op in MID + ["up_gate"])
    assert all(got[op] == (bucket,) for op in ("attn_norm", "kqv", "rope_append", "act", "down", "mlp_reduce",
                                               "residual"))
    m = _model(bucket)
    assert r.best_ms == pytest.approx(schedule_ms(record(p, layer_graph()), m), rel=1e-9)
    assert r.best_ms <= _hand_ms(m, bucket) + 1e-9
