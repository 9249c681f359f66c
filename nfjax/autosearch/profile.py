"""Op profiles: what the plan search reads (JSON under nfjax/plans/profiles/, one per model shape x device x TP).

A profile holds, for one decoder layer's op graph (fields, all times in ms for one layer):
  * `tokens`: every op's time against its token count (`{"op": {"tokens": [...], "ms": [...]}}`);
  * `decode`: decode attention against decode sequences x their context (`ms[c][d]` for `ctx[c]`, `decodes[d]`);
  * `prefill`: prefill attention against chunk length x start position (`ms[s][c]`: one chunk of `chunks[c]` rows
    continuing a sequence at `starts[s]`; `empty_ms`: a step with no prefill row);
  * `shares`: time against resource share (the kernel's CTA count = share x SMs) at one size, per op that takes a
    share (`{"op": {"at": {...}, "share": [...], "ms": [...]}}`);
  * `pairs`: the interference table (NanoFlow's R -> P): for each horizontal kernel that runs two ops side by side,
    the fused time at a share of the first op (the second takes the rest) and each op alone on its share;
  * `layer` (optional): the whole layer as Sequential compiles it, against step tokens x decodes (`ms[t][d]`, at
    context `ctx`, prefill in `chunks` chunks): the search's baseline where a class falls inside it;
  * `timing` (optional): "device" (each time a call's busy time on the GPU, the union of its kernels' intervals, no
    host dispatch in it; each call's span beside it in `device_spans_ms`) or "wall"
    (the wall clock of back-to-back calls; absent: "wall", as in every profile before it);
  * `floor_ms` (optional): the host's dispatch floor per op of the token ops and of the attention kernels (0 in a
    device-timed profile), and `launch_ms`, a launch in the step program (floor.py; estimated where absent);
  * `value_bytes` (bytes per token of every value) and `copy_bytes_per_ms` (what joining pieces costs);
  * the record: `command`, `date`, `device` (e.g. "h100", "cpu"), `device_name`, `num_sms`, `model`, `shape`,
    `tp`, `page_size`, `align`, the op graph it was measured on, and `projections` ("joined": q/k/v and gate/up
    as one weight each, as the engine serves them; "separate"; absent: separate, as in run 7's and earlier ones).
A profile from another device, shape or TP degree than the search asks for is refused, naming the field.
"""
from __future__ import annotations

import json
from pathlib import Path

from nfjax.config import read_json
from nfjax.errors import UserError

FORMAT = 1
KIND = "nfjax-op-profile"
PROFILES_DIR = Path(__file__).resolve().parents[1] / "plans" / "profiles"
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "dtype")
REQUIRED = ("format", "kind", "command", "date", "device", "model", "shape", "tp", "graph", "tokens", "align")


class ProfileError(UserError):
    """A profile the search cannot use; the message names the file and the field."""


def shape_of(cfg) -> dict:
    """The fields of a ModelConfig that set an op's cost (the layer count does not)."""
    return {f: getattr(cfg, f) for f in SHAPE_FIELDS}


def model_name(cfg) -> str:
    """The name of a model shape: a `--shape` name (llama3-8b, ...), "tiny" for the shipped model, else
    "custom-<hidden>x<intermediate>"."""
    from nfjax.models.random_init import SHAPES
    want = shape_of(cfg)
    for name, c in SHAPES.items():
        if shape_of(c) == want:
            return name
    try:
        from nfjax.checkpoint.orbax_io import load_config
        from nfjax.engine.engine import TINY_MODEL
        if shape_of(load_config(TINY_MODEL)) == want:
            return "tiny"
    except Exception:  # noqa: BLE001 - a missing asset only loses the name
        pass
    return f"custom-{cfg.hidden_size}x{cfg.intermediate_size}"


def device_key(name: str | None = None) -> str:
    """A short device name: "h100", "h200", "a100", ... from the device kind, "cpu" on a CPU."""
    if name is None:
        import jax
        d = jax.devices()[0]
        if d.platform == "cpu":
            return "cpu"
        name = getattr(d, "device_kind", d.platform)
    low = name.lower()
    for k in ("h100", "h200", "h20", "b200", "gh200", "a100", "a10", "l40", "l4"):
        if k in low:
            return k
    return low.replace("nvidia", "").strip().replace(" ", "-") or "unknown"


def default_path(model: str, device: str, tp: int) -> Path:
    return PROFILES_DIR / f"{model}_{device}_tp{tp}.json"


def save_profile(prof: dict, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(prof, indent=1) + "\n")
    tmp.replace(p)
    return p


def load_profile(path: str | Path, *, device: str | None = None, shape: dict | None = None,
                 tp: int | None = None) -> dict:
    """Read and check a profile; with `device`, `shape`, `tp`: refuse one measured for other ones."""
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"profile {p}: no such file; make it with `nfjax autosearch profile --out {p}` on "
                           "the device it is for")
    d = read_json(p, ProfileError)
    where = p.name
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected a JSON object")
    for k in REQUIRED:
        if k not in d:
            raise ProfileError(f"{where}: missing field {k!r}")
    if d["kind"] != KIND or d["format"] != FORMAT:
        raise ProfileError(f"{where}: not an nfjax op profile of format {FORMAT} (kind {d['kind']!r}, format "
                           f"{d['format']!r})")
    for op, t in d["tokens"].items():
        _series(t, "tokens", f"{where}.tokens.{op}")
    for op, t in (d.get("shares") or {}).items():
        _series(t, "share", f"{where}.shares.{op}")
        if 1.0 not in [float(s) for s in t["share"]]:
            raise ProfileError(f"{where}.shares.{op}.share: must include 1.0 (the full GPU)")
    check_target(d, where, device=device, shape=shape, tp=tp)
    return d


def check_target(d: dict, where: str, *, device=None, shape=None, tp=None) -> None:
    if device is not None and d["device"] != device:
        raise ProfileError(f"{where}.device: the profile was measured on {d['device']!r}, the search is for "
                           f"{device!r}; profile on that device (`nfjax autosearch profile`) or pass --device "
                           f"{d['device']}")
    if shape is not None:
        for k, v in shape.items():
            if d["shape"].get(k) != v:
                raise ProfileError(f"{where}.shape.{k}: the profile's model has {d['shape'].get(k)!r}, the search's "
                                   f"{v!r} (profile {d['model']!r}); profile this model shape")
    if tp is not None and int(d["tp"]) != int(tp):
        raise ProfileError(f"{where}.tp: the profile was measured at TP={d['tp']}, the search is for TP={tp}")


def _series(t, x: str, where: str) -> None:
    if not isinstance(t, dict) or x not in t or "ms" not in t:
        raise ProfileError(f"{where}: expected {{{x!r}: [...], 'ms': [...]}}")
    if len(t[x]) != len(t["ms"]) or not t["ms"]:
        raise ProfileError(f"{where}: {x} and ms must be non-empty lists of one length")
    if any(not isinstance(v, (int, float)) or v < 0 for v in t["ms"]):
        raise ProfileError(f"{where}.ms: times must be numbers >= 0")
    if list(t[x]) != sorted(set(t[x])):
        raise ProfileError(f"{where}.{x}: must be increasing")
