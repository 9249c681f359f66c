"""A normal (non-editable) install carries what nfjax loads by name: the shipped NanoFlow plans, the kernels, the
tiny model; `pallas_kernels/` imports nothing from nfjax, and nothing outside nfjax/experimental/ imports it."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_install_loads_a_shipped_plan_by_name(tmp_path):
    src, site, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in ("nfjax", "pallas_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True, cwd=tmp_path)
    assert (site / "nfjax" / "assets" / "tiny").is_dir() and (site / "nfjax" / "plans" / "README.md").is_file()
    elsewhere.mkdir()
    code = f"""
import sys
sys.path.insert(0, {str(site)!r})
import nfjax, pallas_kernels
assert nfjax.__file__.startswith({str(site)!r}), nfjax.__file__
assert pallas_kernels.__file__.startswith({str(site)!r}), pallas_kernels.__file__
from nfjax.schedule.plan import load_plan
print(load_plan("llama3-8b_h100_tp1_beside_mact").name)
import nfjax.kv.attention   # the kernels come with the wheel
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["llama3-8b_h100_tp1_beside_mact"]


def _imports(f: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(f.read_text())):
        out += ([a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
    return out


def test_pallas_kernels_import_nothing_from_nfjax():
    for f in sorted((ROOT / "pallas_kernels").glob("*.py")):
        assert not [n for n in _imports(f) if n.split(".")[0] == "nfjax"], f.name


def test_the_product_never_imports_the_experiments():
    for f in sorted((ROOT / "nfjax").rglob("*.py")):
        if "experimental" not in f.relative_to(ROOT / "nfjax").parts:
            assert not [n for n in _imports(f) if n.startswith("nfjax.experimental")], f
