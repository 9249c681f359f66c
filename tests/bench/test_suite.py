"""bench/ is a package run from the repository root as modules (`python -m bench.offline`): no file in it edits
sys.path, and every script there answers --help. Product code cites docs/design.md, never the measurement log."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _modules() -> list[str]:
    """Every bench script (a file with a __main__ block), as a module name."""
    out = []
    for p in sorted(BENCH.rglob("*.py")):
        if "__main__" in p.read_text():
            out.append(".".join(p.relative_to(ROOT).with_suffix("").parts))
    return out


def test_no_file_in_bench_edits_sys_path():
    pat = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\b|\[[^\]]*\]\s*=|\+=)")
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in BENCH.rglob("*.py")
           for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert bad == []


def test_product_code_cites_the_design_doc_not_the_log():
    files = [p for d in ("nfjax", "pallas_kernels") for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".json")]
    assert files
    assert [str(p.relative_to(ROOT)) for p in files if "NOTES.md" in p.read_text()] == []


def test_the_suite_has_its_scripts():
    mods = set(_modules())
    for m in ("bench.offline", "bench.serving", "bench.tp", "bench.latency", "bench.nanoflow", "bench.profile_step",
              "bench.probes.host_overhead", "bench.peers.hf"):
        assert m in mods, m


@pytest.mark.parametrize("module", _modules())
def test_every_bench_script_answers_help(module):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage:" in p.stdout
