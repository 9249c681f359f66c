"""Probe: what the GPU runs during a window of a real offline run. The engine (bench flags, as bench.offline builds it)
runs one workload; the profiler starts when the engine records step `--from-step` and stops `--steps` steps later,
on the engine's own thread. Reported per step of the window: kernel ms by kernel (the Pallas kernels told apart by
their grid), the GPU's busy ms against the window's wall ms (idle = the device waiting for the host), and the step
kinds the window held. Each variant (engine flags) runs in its own process.

`--windows 100:16,250:16,500:16` traces several windows of the one run (one engine build), each reported apart.

usage: python -m bench.probes.engine_window --shape llama3-8b --workload 1024x512 --num-requests 512 \
           --from-step 60 --steps 20 --variants "bf16=;fp8=--kv-dtype fp8" --out $OUT
CPU:   python -m bench.probes.engine_window --shape smoke --workload 64x16 --num-requests 8 --from-step 2 --steps 3
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from bench.common import module_command
from bench.offline import parse_variants
from bench.setup import add_bench_args

OP_STATS = ("hlo_op", "tf_op", "long_name")        # event stats that name the XLA op a kernel belongs to


def kernel_key(name: str, stats: dict) -> str:
    """A kernel's row: its name, and for the Pallas kernels (one name for all) the grid it ran on (the decode
    kernel's persistent grid is the SM count; the prefill kernel's, its tiles x kv heads) and the XLA op."""
    if "mosaic" not in name and "pallas" not in name:
        return name
    grid = next((p for p in str(stats.get("kernel_details", "")).split() if p.startswith("grid:")), "")
    op = next((str(stats[k]) for k in OP_STATS if k in stats), "")
    tag = " ".join(filter(None, (grid, op[:60])))
    return f"{name} [{tag}]" if tag else name


def window_table(pd, steps: int) -> dict:
    """Per-step kernel ms by kernel key on the busiest stream, its busy ms and the window's wall ms."""
    from bench.step_bench import gpu_lines
    if isinstance(pd, str):
        return {"error": pd}
    lines = [(ln, evs) for ln, evs in gpu_lines(pd) if "stream" in ln.lower()] or gpu_lines(pd)
    if not lines:
        return {"error": "no GPU events in the trace"}
    ln, evs = max(lines, key=lambda le: sum(e[2] for e in le[1]))
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, _, dur, stats in evs:
        a = agg[kernel_key(name, stats)]
        a[0] += dur / 1e6 / steps
        a[1] += 1
    t0 = min(e[1] for e in evs)
    t1 = max(e[1] + e[2] for e in evs)
    busy = sum(e[2] for e in evs) / 1e6
    samples = {}
    for name, _, _, stats in evs:
        if "mosaic" in name and len(samples) < 4:
            samples.setdefault(kernel_key(name, stats), {k: str(v)[:200] for k, v in stats.items()})
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])
    return {"line": ln, "busy_ms_per_step": busy / steps, "wall_ms_per_step": (t1 - t0) / 1e6 / steps,
            "idle_share": 1 - busy * 1e6 / max(t1 - t0, 1), "stat_samples": samples,
            "top": [{"name": k[:200], "ms": v[0], "count": v[1] / steps} for k, v in rows[:40]]}


FUSION_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\bfusion\(.*$", re.M)
META = re.compile(r'op_name="([^"]*)"(?:.*?source_file="([^"]*)")?(?:.*?source_line=(\d+))?')


def fusion_sources(hlo_texts, names) -> dict:
    """{kernel name: "op_name @ file:line"} for the XLA fusions among `names`, from the step programs' optimized
    HLO (a kernel is named after its fusion, "." as "_"): where in the model each costly fusion comes from."""
    found = {}
    for text in hlo_texts:
        for m in FUSION_LINE.finditer(text):
            key = m.group(1).replace(".", "_")
            if key in names and key not in found:
                meta = META.search(m.group(0))
                if meta:
                    op, f, line = meta.groups()
                    found[key] = op[-160:] + (f" @ {os.path.basename(f)}:{line}" if f else "")
    return found


def parse_windows(spec: str | None, from_step: int, steps: int) -> list[tuple[int, int]]:
    """'FROM:STEPS,...' -> [(first step, step count)], in order and apart (None: the one window of the flags)."""
    if not spec:
        return [(from_step, steps)]
    try:
        wins = [tuple(int(x) for x in w.split(":")) for w in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--windows: FROM:STEPS,... with integers, got {spec!r}") from None
    if any(len(w) != 2 or w[0] < 1 or w[1] < 1 for w in wins):
        raise SystemExit(f"--windows: each window FROM:STEPS with FROM >= 1 and STEPS >= 1, got {spec!r}")
    if any(b[0] < a[0] + a[1] for a, b in zip(wins, wins[1:])):
        raise SystemExit(f"--windows: windows in order and apart, got {spec!r}")
    return wins


def child(args) -> dict:
    import jax
    from bench.engine_bench import longest, step_kind
    from bench.setup import bench_engine, config_record, model_config
    from bench.workloads import parse
    from nfjax.engine import SamplingParams

    wins = parse_windows(args.windows, args.from_step, args.steps)
    cfg = model_config(args)
    work = parse(args.workload, args.num_requests, cfg.vocab_size, seed=1)
    engine = bench_engine(args, context=longest([work]))
    sps = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in work]
    engine.generate([p for p, _ in work[:8]], [SamplingParams(max_tokens=4, ignore_eos=True)] * len(work[:8]))
    engine.trace.steps.clear()
    dirs = [os.path.join(tempfile.gettempdir(), f"engine_window_{args.variant}_{i}") for i in range(len(wins))]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    marks: list[list[int]] = [[] for _ in wins]        # per window: [first] then [first, last] recorded steps

    class Steps(list):
        """The trace's step list, starting and stopping the profiler as the engine records steps."""
        def append(self, st):
            super().append(st)
            for i, (start, n) in enumerate(wins):
                m = marks[i]
                if not m and len(self) == start:
                    if not args.no_trace:
                        jax.profiler.start_trace(dirs[i])
                    m.append(len(self))
                elif len(m) == 1 and len(self) == m[0] + n:
                    if not args.no_trace:
                        jax.profiler.stop_trace()
                    m.append(len(self))
    steps = engine.trace.steps = Steps()
    t = time.perf_counter()
    engine.generate([p for p, _ in work], sps)
    dt = time.perf_counter() - t
    if len(marks[-1]) < 2:
        if len(marks[-1]) == 1 and not args.no_trace:
            jax.profiler.stop_trace()
        return {"error": f"the run ended after {len(steps)} steps, before window {wins[-1]} closed"}
    from jax.profiler import ProfileData
    hlo = None
    out = []
    for (first, last), d in zip(marks, dirs):
        # steps recorded while tracing; the step launched before the start and the ones in flight at the stop blur
        # the edges by about a step each
        kinds = collections.Counter(step_kind(s) for s in steps[first:last])
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        table = window_table(ProfileData.from_file(max(files, key=os.path.getmtime)), last - first) if files else \
            {"error": "not traced" if args.no_trace else "no xplane.pb written"}
        if "top" in table:
            if hlo is None:     # the optimized HLO of the programs the windows ran (their steps' buckets), once
                buckets = {s.bucket for (a, b) in marks for s in steps[a:b]}
                hlo = [c.as_text() for tb in (engine.runner._steps, engine.runner._decode_steps)
                       for key, c in tb.items() if key[0] in buckets and hasattr(c, "as_text")]
            src = fusion_sources(hlo, {r["name"] for r in table["top"]})
            for r in table["top"]:
                if r["name"] in src:
                    r["source"] = src[r["name"]]
        host = [s.host_ms for s in steps[first:last]]
        out.append({"window": [first, last], "kinds": dict(kinds), "host_ms_per_step": sum(host) / max(len(host), 1),
                    "kernels": table})
    from bench.common import device_info
    return {"command": " ".join(["python -m bench.probes.engine_window", *sys.argv[1:]]), "device": device_info(),
            "date": time.strftime("%Y-%m-%d"), "variant": args.variant, "workload": args.workload,
            "requests": len(work), "run_s": dt, "steps": len(steps), **out[0], "windows": out,
            "num_pages": engine.config.cache.num_pages, "engine_config": config_record(engine.config)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--workload", default="1024x512")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--from-step", type=int, default=60)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--windows", default=None, metavar="FROM:STEPS,...",
                    help="several windows of the one run (instead of --from-step / --steps)")
    ap.add_argument("--no-trace", action="store_true", help="run the window untraced (host ms only)")
    ap.add_argument("--variants", default="", help="'NAME=FLAGS;...' engine flags per variant (own process each)")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)      # child mode
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--timeout", type=int, default=420)
    args = ap.parse_args()
    if args.variant:
        res = child(args)               # whole before the file is opened: a crash leaves no empty file
        with open(os.path.join(args.out, f"engine_window_{args.variant}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    os.makedirs(args.out, exist_ok=True)
    for name, flags in parse_variants(args.variants):
        try:
            subprocess.run(module_command("bench.probes.engine_window", *sys.argv[1:], *flags, "--variant", name),
                           timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"[{name}] timed out", flush=True)
        p = os.path.join(args.out, f"engine_window_{name}.json")
        if not os.path.exists(p):
            continue
        r = json.load(open(p))
        if "error" in r:
            print(f"== {name}: {r['error']}")
            continue
        for w in r.get("windows", [r]):
            k = w["kernels"]
            if "error" in k:
                print(f"== {name}: steps {w['window']} {w['kinds']}; host {w['host_ms_per_step']:.2f} ms; {k['error']}")
                continue
            print(f"== {name}: steps {w['window']} {w['kinds']}; per step: wall {k.get('wall_ms_per_step', 0):.2f} "
                  f"ms, GPU busy {k.get('busy_ms_per_step', 0):.2f} ms (idle {k.get('idle_share', 0):.1%}), host "
                  f"{w['host_ms_per_step']:.2f} ms; {r['num_pages']} pages")
            for row in k.get("top", [])[:24]:
                src = f"  <- {row['source']}" if row.get("source") else ""
                print(f"   {row['ms']:8.3f} ms x{row['count']:<7.1f} {row['name'][:140]}{src}")


if __name__ == "__main__":
    main()
