"""`nfjax autosearch`: a missing or mismatched profile (device, shape, TP) is one error line naming it; a good one
writes plans that load."""
import json

import pytest

from synthetic import h100_like
from nfjax.cli import main
from nfjax.schedule.plan import load_plan


@pytest.fixture
def h100_profile(tmp_path):
    p = tmp_path / "llama3-8b_h100_tp1.json"
    p.write_text(json.dumps(h100_like()))
    return p


def _err(capsys) -> str:
    return capsys.readouterr().err.strip()


def test_missing_profile_is_named(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert main(["autosearch", "search", "--profile", str(missing)]) == 2
    err = _err(capsys)
    assert err.count("\n") == 0 and str(missing) in err and "nfjax autosearch profile" in err


@pytest.mark.parametrize("args, field", [
    (["--shape", "llama3-8b", "--device", "h200"],
     "llama3-8b_h100_tp1.json.device: the profile was measured on 'h100'"),
    (["--shape", "smoke", "--device", "h100"], "llama3-8b_h100_tp1.json.shape.hidden_size"),
    ([], "llama3-8b_h100_tp1.json.device"),                                   # this machine: a CPU
    (["--shape", "llama3-8b", "--device", "h100", "--tp", "2"],
     "llama3-8b_h100_tp1.json.tp: the profile was measured at TP=1"),
])
def test_mismatched_profile_is_an_error_naming_the_field(h100_profile, capsys, args, field):
    assert main(["autosearch", "search", "--profile", str(h100_profile), *args]) == 2
    err = _err(capsys)
    assert field in err and err.startswith("nfjax autosearch: error:")


def test_bad_profile_fields_are_named(tmp_path, capsys):
    d = h100_like()
    d["tokens"]["kqv"]["ms"][0] = -1
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    assert main(["autosearch", "search", "--profile", str(p), "--shape", "llama3-8b", "--device", "h100"]) == 2
    assert "bad.json.tokens.kqv.ms" in _err(capsys)
    p.write_text("{not json")
    assert main(["autosearch", "search", "--profile", str(p)]) == 2
    assert "not valid JSON" in _err(capsys)


@pytest.mark.parametrize("args, msg", [
    (["profile", "--tp", "2"], "--tp: the profiler measures one device"),
    (["search", "--model", "x", "--shape", "smoke"], "--model and --shape"),
    (["search", "--shape", "llama9"], "--shape: expected one of"),
    (["search", "--model", "/no/such/model"], "no such model folder"),
])
def test_argument_errors(capsys, args, msg):
    assert main(["autosearch", *args]) == 2
    assert msg in _err(capsys)


def test_search_writes_plans_that_load(h100_profile, tmp_path, capsys):
    out = tmp_path / "plans"
    assert main(["autosearch", "search", "--profile", str(h100_profile), "--shape", "llama3-8b", "--device", "h100",
                 "--buckets", "2048", "--decodes", "256", "--out", str(out), "--time-limit", "30"]) == 0
    text = capsys.readouterr().out
    assert "searched 1 batch classes" in text and "bucket 2048, decodes >= 128" in text
    (f,) = sorted(out.glob("*.json"))
    plan = load_plan(f)
    assert plan.name == "llama3-8b_h100_tp1_auto_t2048_d256" and plan.source.startswith("nfjax autosearch")
