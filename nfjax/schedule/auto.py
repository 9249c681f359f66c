"""`--plan auto`: the shipped NanoFlow plans for this model shape, device and TP degree, or Sequential.

A shipped plan (nfjax/plans/*.json) records the `model` shape name, `device` and `tp` it was made for. `auto`
takes the plans of the running key: the autosearched ones (source "nfjax autosearch ...", one per bucket and
decode band) if the key has any, else the hand-tuned ones. Each becomes a `nanoflow` strategy whose
`min_decode` is the plan's band, ordered from the highest band down, so the runtime's per-batch choice (the
first strategy whose limits the batch meets; nfjax/schedule/variants.py) picks the band's plan and every other
batch runs Sequential. No plan for the key: Sequential alone.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from nfjax.config import ExecutionConfig

AUTO = "auto"
AUTOSEARCH_SOURCE = "nfjax autosearch"
log = logging.getLogger("nfjax")


def shipped_plans(plans_dir: Path | None = None) -> list[tuple[Path, object]]:
    from nfjax.schedule.plan import PLANS_DIR, Plan, PlanError
    from nfjax.config import read_json
    out = []
    for p in sorted((plans_dir or PLANS_DIR).glob("*.json")):
        try:
            out.append((p, Plan.from_json(read_json(p, PlanError), where=p.name)))
        except PlanError as e:
            log.warning("skipping plan %s: %s", p.name, e)
    return out


def auto_plans(model: str, device: str, tp: int, plans_dir: Path | None = None) -> list[tuple[Path, object]]:
    """The plans `auto` runs for this key, highest decode band first."""
    mine = [(p, pl) for p, pl in shipped_plans(plans_dir) if (pl.model, pl.device, pl.tp) == (model, device, tp)]
    searched = [(p, pl) for p, pl in mine if pl.source.startswith(AUTOSEARCH_SOURCE)]
    chosen = searched or mine
    return sorted(chosen, key=lambda x: (-x[1].min_decode, -x[1].bucket, x[0].name))


def resolve_auto(execution: ExecutionConfig, model_cfg, tp: int, device: str | None = None,
                 plans_dir: Path | None = None) -> tuple[ExecutionConfig, str | None]:
    """`execution` with every `nanoflow:auto` strategy replaced by the key's plans; and a line saying what was
    chosen (None when nothing was `auto`)."""
    if not any(s.kind == "nanoflow" and s.plan == AUTO for s in execution.strategies):
        return execution, None
    from nfjax.autosearch.profile import device_key, model_name
    model, dev = model_name(model_cfg), device or device_key()
    plans = auto_plans(model, dev, tp, plans_dir)
    out = []
    for s in execution.strategies:
        if not (s.kind == "nanoflow" and s.plan == AUTO):
            out.append(s)
            continue
        for path, pl in plans:
            out.append(dataclasses.replace(s, plan=str(path), name=None, min_decode=max(s.min_decode, pl.min_decode),
                                           min_bucket=max(s.min_bucket, pl.min_bucket)))
    if plans:
        msg = (f"--plan auto: {len(plans)} plan(s) for {model} on {dev} at TP={tp}: "
               + ", ".join(f"{p.stem} (decodes >= {pl.min_decode})" for p, pl in plans))
    else:
        msg = f"--plan auto: no shipped plan for {model} on {dev} at TP={tp}; Sequential"
    return dataclasses.replace(execution, strategies=tuple(out)), msg
