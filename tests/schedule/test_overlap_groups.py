"""Which steps of a program share an XLA scheduling group with a stream region (executor._OverlapGroups)."""
import itertools

from nfjax.schedule.api import ScheduleContext
from nfjax.schedule.executor import _OverlapGroups, gpu_stream
from nfjax.schedule.graph import layer_graph
from nfjax.schedule.plan import load_plan
from nfjax.schedule.strategies import NanoFlow


def test_region_groups_the_main_stream_work_up_to_the_reader_of_its_tokens():
    prog = NanoFlow(load_plan("llama3-8b_h100_tp1_decode_overlap")).record(ScheduleContext(2048, layer_graph(), 1))
    groups = _OverlapGroups(itertools.count(7))
    got = [(repr(s).split(" ")[0], groups.enter(s, gpu_stream(s) is not None)) for s in prog.steps]
    region = [name for name, g in got if g == 7]
    assert region[0] == "attn_decode@0[0:256]"                 # the region opens the group ...
    # ... the prefill tokens' attention reads `attn_d` too, but of its own tokens, so it stays in the group
    assert "attn_prefill@1,2[256:2048]" in region and "down@2[768:2048]" in region
    # the first step that reads the region's output on its tokens closes the group
    first = [name for name, _ in got].index(region[0])
    assert got[first + len(region)] == ("attn_prefill@0[0:256]", None)
    assert all(g is None for _, g in got[:3])                  # qkv ran before the region
