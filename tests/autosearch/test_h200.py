"""The cost model and the search on the H200 profile shipped in nfjax/plans/profiles/llama3-8b_h200_tp1.json (a
copy of bench/results/autosearch-h200-epi-profile-20261129.json: device-timed, gate/up with the SwiGLU epilogue)
against what that run measured a step: Sequential 30.58 / 59.14 ms, the hand-tuned plan 32.07 / 60.88 at 1,024 /
2,048 tokens. The search writes no plan at either batch (Sequential), as the steps measured."""
import json
from pathlib import Path

import pytest

from nfjax.autosearch.costs import BatchClass, CostModel
from nfjax.autosearch.emit import schedule_ms
from nfjax.autosearch.profile import PROFILES_DIR
from nfjax.autosearch.search import SearchOptions, search
from nfjax.schedule.api import ScheduleContext
from nfjax.schedule.graph import layer_graph
from nfjax.schedule.plan import load_plan
from nfjax.schedule.strategies import NanoFlow

H200 = json.loads((PROFILES_DIR / "llama3-8b_h200_tp1.json").read_text())
HAND = "llama3-8b_h100_tp1_beside_mact"


def test_the_shipped_profile_is_device_timed_and_served_as_the_engine_runs():
    assert H200["device"] == "h200" and H200["timing"] == "device" and H200["swiglu_epilogue"] is True
    assert H200["floor_ms"] == {"tokens": 0.0, "kernels": 0.0}
    # busy times: a 2,048-token norm takes ~11 us, not the ~20-35 us dispatch floor the wall clock read
    assert max(H200["tokens"]["attn_norm"]["ms"]) < 0.015
    # each span (first start to last end) holds its busy time (the union of the kernels' intervals)
    tok = H200["tokens"]["kqv"]
    for n, busy in zip(tok["tokens"], tok["ms"]):
        assert H200["device_spans_ms"][str(("tokens", "kqv", n))] >= busy


@pytest.mark.parametrize("bucket", [1024, 2048])
def test_no_plan_models_the_two_percent_a_plan_must_gain(bucket):
    """The hand-tuned plan models 1.1% over Sequential's measured layer at 1,024 and 0.6% under it at 2,048, short
    of the search's 2% (it measured 4.6% / 2.9% slower a step)."""
    m = CostModel(H200, BatchClass(bucket, bucket // 8, 1280))
    seq = m.measured_sequential_ms()
    hand = schedule_ms(NanoFlow(load_plan(HAND)).record(ScheduleContext(bucket, layer_graph())), m)
    assert seq is not None and hand > 0.98 * seq


@pytest.mark.parametrize("bucket,decodes", [(2048, 256), (1024, 128)])
def test_the_search_on_the_h200_profile_writes_sequential(bucket, decodes):
    (r,) = search(layer_graph(), H200, [bucket], [decodes], 1280, 2, SearchOptions(nano_batches=(1, 2), time_limit=20))
    assert r.plan is None
