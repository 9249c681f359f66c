"""`nfjax autosearch`: profile a model's layer ops on this device, and search NanoFlow plans from a profile.

  nfjax autosearch profile [--model DIR | --shape NAME] [--out FILE] [--grid quick|full]
  nfjax autosearch search  [--model DIR | --shape NAME] [--profile FILE] [--device D] [--tp N]
                           [--buckets 2048,1024] [--decodes 128,256] [--ctx 1280] [--out DIR] [--time-limit 60]

The profile goes to nfjax/plans/profiles/<model>_<device>_tp<N>.json unless --out says; the search reads that
file for the model, device and TP it is asked for (this device unless --device) and writes one plan per batch
class that beats Sequential (`--plan FILE`, or copied into nfjax/plans/ for `--plan auto`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nfjax.errors import UserError


def _ints(s: str) -> tuple[int, ...]:
    try:
        v = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not v or any(x <= 0 for x in v):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return v


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="profile layer ops and search NanoFlow plans (NanoFlow's auto-search)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    acts = p.add_subparsers(dest="action", required=True)
    for act in ("profile", "search"):
        a = acts.add_parser(act)
        a.add_argument("--model", default=None, help="nfjax checkpoint folder or model name (default: the tiny model)")
        a.add_argument("--shape", default=None, help="a random-weight model shape instead (llama3-8b, smoke, ...)")
        a.add_argument("--tp", type=int, default=1, help="tensor-parallel degree the profile / plans are for")
    pr = acts.choices["profile"]
    pr.add_argument("--out", default=None,
                    help="profile file (default nfjax/plans/profiles/<model>_<device>_tp<N>.json)")
    pr.add_argument("--grid", choices=("quick", "full"), default="full",
                    help="sizes measured: full (the device's default grid) or quick (a few sizes, for smoke runs)")
    pr.add_argument("--page-size", type=int, default=None,
                    help="KV page size of the attention cases (GPU 64, CPU 16)")
    se = acts.choices["search"]
    se.add_argument("--profile", default=None, help="profile file (default: the one for the model, device and TP)")
    se.add_argument("--device", default=None, help="device the plans are for (default: this one), e.g. h100")
    se.add_argument("--buckets", type=_ints, default=None,
                    help="token buckets to plan for (default 2048,1024 on a GPU profile, the largest profiled count "
                         "on a CPU one)")
    se.add_argument("--decodes", type=_ints, default=None,
                    help="decode counts representing the bands (default 128,256 on a GPU profile)")
    se.add_argument("--ctx", type=int, default=None, help="decode context length (default: the profile's)")
    se.add_argument("--chunks", type=int, default=2, help="prefill chunks in a step")
    se.add_argument("--nano-batches", type=_ints, default=(1, 2, 3), help="nano-batch counts to try")
    se.add_argument("--time-limit", type=float, default=60.0, help="seconds for the whole search")
    se.add_argument("--out", default=None, help="folder the plans are written to (default: print only)")


def _subject_config(args):
    if args.model and args.shape:
        raise UserError("--model and --shape: give one")
    if args.shape:
        from nfjax.models.random_init import SHAPES
        if args.shape not in SHAPES:
            raise UserError(f"--shape: expected one of {', '.join(SHAPES)}, got {args.shape!r}")
        return SHAPES[args.shape]
    from nfjax.checkpoint.models import resolve
    from nfjax.checkpoint.orbax_io import load_config
    from nfjax.engine.engine import TINY_MODEL
    path = Path(resolve(args.model)) if args.model else TINY_MODEL
    if not path.is_dir():
        raise UserError(f"--model: {path}: no such model folder")
    return load_config(path)


def run(args) -> int:
    if args.tp != 1 and args.action == "profile":
        raise UserError("--tp: the profiler measures one device (TP=1); profiling sharded ops is not implemented")
    if args.tp < 1:
        raise UserError(f"--tp must be >= 1, got {args.tp}")
    cfg = _subject_config(args)
    return _profile(args, cfg) if args.action == "profile" else _search(args, cfg)


def _profile(args, cfg) -> int:
    import jax

    from nfjax.autosearch.profile import default_path, device_key, model_name, save_profile
    from nfjax.autosearch.profiler import CPU_GRID, GPU_GRID, pages_needed, profile, quick
    from nfjax.autosearch.subjects import LlamaSubject
    from nfjax.compat import num_sms, on_gpu
    gpu = on_gpu()
    grid = GPU_GRID if gpu else CPU_GRID
    if args.grid == "quick":
        grid = quick(grid)
    ps = args.page_size or (64 if gpu else 16)
    subject = LlamaSubject(cfg, page_size=ps, max_seqs=512 if gpu else 64, max_pages=pages_needed(grid, ps))
    dev = device_key()
    d = jax.devices()[0]
    prof = profile(subject, grid, device=dev, device_name=getattr(d, "device_kind", d.platform),
                   num_sms=num_sms() if gpu else 0, command=" ".join(["nfjax", "autosearch", *sys.argv[2:]]),
                   align=64 if gpu else 16, log=lambda m: print(m, file=sys.stderr, flush=True))
    prof["page_size"] = ps
    out = save_profile(prof, args.out or default_path(model_name(cfg), dev, 1))
    print(f"wrote {out} ({len(prof['tokens'])} ops, {prof['seconds']} s)")
    return 0


def _search(args, cfg) -> int:
    import time

    from nfjax.autosearch.profile import default_path, device_key, load_profile, model_name, shape_of
    from nfjax.autosearch.search import SearchOptions, search
    from nfjax.schedule.graph import layer_graph
    from nfjax.schedule.plan import save_plan
    dev = args.device or device_key()
    path = Path(args.profile) if args.profile else default_path(model_name(cfg), dev, args.tp)
    prof = load_profile(path, device=dev, shape=shape_of(cfg), tp=args.tp)
    gpu = bool(prof.get("num_sms"))
    buckets = args.buckets or ((2048, 1024) if gpu else (max(prof["grid"]["tokens"]),))
    decodes = args.decodes or ((128, 256) if gpu else (prof["grid"]["share_decodes"],))
    ctx = args.ctx or (prof.get("decode", {}).get("ctx") or [1280])[0]
    t0 = time.perf_counter()
    res = search(layer_graph(), prof, buckets, decodes, ctx, args.chunks,
                 SearchOptions(nano_batches=args.nano_batches, time_limit=args.time_limit))
    dt = time.perf_counter() - t0
    print(f"searched {len(res)} batch classes in {dt:.1f} s ({prof['model']} on {prof['device']}, TP={prof['tp']}, "
          f"profile {path.name})")
    for r in res:
        what = r.plan.name if r.plan else "Sequential"
        print(f"  bucket {r.batch.tokens}, decodes >= {r.min_decode} (at {r.batch.decodes}): {what}; modelled layer "
              f"{r.best_ms:.4f} ms vs Sequential {r.sequential_ms:.4f} ms ({r.sequential_ms / r.best_ms:.3f}x)")
        for n in r.notes:
            print(f"    note: {n}")
        if r.plan and args.out:
            print(f"    wrote {save_plan(r.plan, Path(args.out) / f'{r.plan.name}.json')}")
    return 0
