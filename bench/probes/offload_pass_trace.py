"""Where an offload pass's time goes: policies run traced (their prefill and two decode passes, as bench/flexgen.py
runs one), each pass's wall time against every lane's busy time and the cost model's lanes for the same pass.

Why: on the H200 host (bench/results/flexgen-grid-20261127.json, session 20) prefill passes with KV off the GPU
took 2.2x the cost model's time (w0-kv25-16x2: 248 ms a layer against 113), and the LP's policy, 12% of its KV on
disk, decoded at 59-81 ms a layer against 41.

usage: python -m bench.probes.offload_pass_trace [--policies 16x2:25/75/0,4x8:35.2/52.6/12.2]
         [--hardware bench/results/flexgen-grid-p0-<date>.json] [--name offload_pass_trace]
A policy is BSxNB:GPU/CPU/DISK[+ca], the KV cache's split in percent (+ca: attention of CPU-held KV on the CPU);
weights all in pinned host memory, activations on the GPU (the #25 grid's kind). Each lane's mean event (ms, and
MB a KV load) is recorded beside the pass table, and the file is written after every policy (a run killed for
memory keeps the ones before it).
"""
from __future__ import annotations

import argparse

from bench.common import print_table, write_results
from bench.setup import add_bench_args, model_config


def parse_policy(spec: str) -> dict:
    """'16x2:25/75/0' (or '16x2:25/75/0+ca') -> the fields `bench.flexgen.make_policy` takes."""
    ca = spec.endswith("+ca")
    try:
        size, kv = spec.removesuffix("+ca").split(":")
        bs, nb = (int(x) for x in size.lower().split("x"))
        g, c, d = (float(x) for x in kv.split("/"))
    except ValueError:
        raise SystemExit(f"--policies: BSxNB:GPU/CPU/DISK[+ca] (e.g. 16x2:25/75/0), got {spec!r}") from None
    return dict(gpu_batch_size=bs, num_gpu_batches=nb, weights=(0, 100, 0), cache=(g, c, d),
                activations=(100, 0, 0), cpu_attention=ca)


def lane_means(events: list[dict]) -> dict:
    """Each lane's event count and mean ms (a CPU-attended step's two programs are two compute events)."""
    out: dict = {}
    for e in events:
        n, ms = out.get(e["lane"], (0, 0.0))
        out[e["lane"]] = (n + 1, ms + e["end_ms"] - e["start_ms"])
    return {lane: {"events": n, "mean_ms": ms / n} for lane, (n, ms) in out.items()}


def pass_stats(events: list[dict], per_pass: int) -> list[dict]:
    """Each pass (`per_pass` compute events), from the end of the pass before (the first: from the first event):
    its wall ms and every lane's busy ms within it (the union of its spans: concurrent I/O threads count once)."""
    comp = [e for e in events if e["lane"] == "compute" and "unpack" not in e["label"]
            and not e["label"].endswith(" pre")]             # one event a (layer, batch) step
    ends = [min(e["start_ms"] for e in events)] + [comp[i * per_pass - 1]["end_ms"] for i in range(1, len(comp) // per_pass + 1)]
    out = []
    for a, b in zip(ends, ends[1:]):
        row = {"wall_ms": b - a}
        for lane in sorted({e["lane"] for e in events}):
            spans = sorted((max(a, e["start_ms"]), min(b, e["end_ms"])) for e in events
                           if e["lane"] == lane and e["end_ms"] > a and e["start_ms"] < b)
            busy, cur = 0.0, None
            for s, t in spans:                    # the union's length
                if cur is None or s > cur[1]:
                    busy += 0.0 if cur is None else cur[1] - cur[0]
                    cur = [s, t]
                else:
                    cur[1] = max(cur[1], t)
            busy += 0.0 if cur is None else cur[1] - cur[0]
            row[f"{lane.replace(' ', '_')}_ms"] = busy
        out.append(row)
    return out


def main(argv=None) -> int:
    from bench import flexgen as fg
    from bench import flexgen_model as fm
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(p, shape="opt-30b")
    p.set_defaults(gpu_memory_gb=16.0)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--policies", default="16x2:25/75/0,4x8:35.2/52.6/12.2")
    p.add_argument("--hardware", default=None, help="a profile (or a result file holding one) to predict with")
    p.add_argument("--name", default="offload_pass_trace")
    args = p.parse_args(argv)
    from nfjax import pinned_pool
    from nfjax.offload.budget import host_cap_gb
    pinned_pool.size_for(host_cap_gb(args.cpu_memory_gb), log=print)
    cfg = model_config(args)
    hw = fm.profile(cfg, args, log=lambda m: print(f"[{m}]", flush=True))
    rows, data = [], {}
    for spec in [s.strip() for s in args.policies.split(",") if s.strip()]:
        pol = fg.make_policy(parse_policy(spec), args)
        res = fg.run_policy(cfg, pol, args, trace=True, label=spec)
        pred = fm.predicted(cfg, res["policy"], args, hw)
        events = res.pop("events")
        stats = pass_stats(events, cfg.num_layers * pol.num_gpu_batches)
        data[spec] = {"run": res, "passes": stats, "predicted": pred, "lane_means": lane_means(events),
                      "events": events}
        for i, st in enumerate(stats):
            phase = "prefill" if i == 0 else "decode"
            lanes = pred["predicted_lanes"][phase]
            rows.append({"policy": spec, "pass": i, "wall ms/L": st["wall_ms"] / cfg.num_layers,
                         "model ms/L": 1e3 * max(lanes.values()),
                         **{k[:-3] + " ms/L": v / cfg.num_layers for k, v in st.items() if k != "wall_ms"},
                         **{f"model {k}": 1e3 * v for k, v in lanes.items() if v}})
        summary = {f"{r['policy']}_pass{r['pass']}_wall_ms_per_layer": r["wall ms/L"] for r in rows}
        path = write_results(args.name, summary, {"hardware": hw.to_json(), "runs": data})
        print(f"[{spec}: {data[spec]['lane_means']}; peak RSS {res.get('host_peak_rss_gb')} GB, "
              f"{res.get('host_rss_parts_gb')}]", flush=True)
    heads = list(dict.fromkeys(k for r in rows for k in r))
    print_table(heads, [[r.get(h, "") for h in heads] for r in rows])
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
