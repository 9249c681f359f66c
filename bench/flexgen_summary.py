"""bench/flexgen.py's summary: the headline keys per kind of run, the row-by-row baselines' keys, the parts of a
split run merged, the table and the result file."""
from __future__ import annotations

from bench.common import merged_parts, print_table, write_results


def _summary(args, runs: dict) -> dict:
    """The headline keys, each from its own kind of run and absent where no run is of that kind: the best policy
    with uncompressed weights (4-bit KV allowed: KV compression is a policy field, FlexGen's §5), the best with
    4-bit weights (`_int4`), the best with 4-bit KV and uncompressed weights (`_kv4`), the best with no compression
    at all (`_nocompress`); `flexgen_best_policy_any` is the fastest run of all."""
    kinds = {"": lambda p: not p["compress_weights"],
             "_int4": lambda p: p["compress_weights"],
             "_kv4": lambda p: p["compress_cache"] and not p["compress_weights"],
             "_nocompress": lambda p: not (p["compress_weights"] or p["compress_cache"])}
    tag = f"{args.shape.replace('-', '')}_{args.gpu_memory_gb:g}gb"
    summary = {"flexgen_best_policy_any": max(runs, key=lambda k: runs[k]["out_tok_s"])}
    for suffix, pick in kinds.items():
        group = [k for k, v in runs.items() if pick(v["policy"])]
        if group:
            best = max(group, key=lambda k: runs[k]["out_tok_s"])
            summary.update({f"flexgen_out_tok_s_{tag}{suffix}": runs[best]["out_tok_s"],
                            f"flexgen_best_policy{suffix}": best})
    if "flexgen_best_policy" in summary:
        summary["flexgen_best_extrapolated"] = bool(runs[summary["flexgen_best_policy"]].get("extrapolated", False))
    return summary


def _baseline_summary(runs: dict, base: dict, summary: dict, data: dict) -> None:
    """The baselines' keys, and FlexGen's best over each. `flexgen_vs_rowbyrow` is over the pinned baseline: the
    zig-zag runs load their host weights from pinned memory too, so the two differ only in the schedule
    (docs/design.md 11); `_numpy` is over the pageable one (Accelerate's offload)."""
    if not base:
        return
    data["rowbyrow"] = base
    head = "pinned" if "pinned" in base else next(iter(base))
    summary["flexgen_rowbyrow_basis"] = head
    summary["flexgen_rowbyrow_batch"] = base[head]["policy"]["gpu_batch_size"]
    summary["flexgen_rowbyrow_extrapolated"] = bool(base[head].get("extrapolated", False))
    summary["flexgen_rowbyrow_out_tok_s"] = base[head]["out_tok_s"]
    for mem, r in base.items():
        summary[f"flexgen_rowbyrow_out_tok_s_{mem}"] = r["out_tok_s"]
        if "predicted_err_pct" in r:           # the cost model's serial sum for the baseline (not in the mean error)
            summary[f"cost_model_rowbyrow_err_pct_{mem}"] = r["predicted_err_pct"]
    if runs and "flexgen_best_policy" in summary:
        best = runs[summary["flexgen_best_policy"]]
        summary["flexgen_vs_rowbyrow"] = best["out_tok_s"] / base[head]["out_tok_s"]
        for mem, r in base.items():
            summary[f"flexgen_vs_rowbyrow_{mem}"] = best["out_tok_s"] / r["out_tok_s"]
    for kind in ("int4", "kv4", "nocompress"):          # each kind of FlexGen run over the same (uncompressed) baseline
        if f"flexgen_best_policy_{kind}" in summary:
            summary[f"flexgen_vs_rowbyrow_{kind}"] = (runs[summary[f"flexgen_best_policy_{kind}"]]["out_tok_s"]
                                                      / base[head]["out_tok_s"])


def _finish(args, summary: dict, data: dict) -> None:
    """The GPU's peak memory, the table, the result file."""
    stats = {}
    if not args.merge_only:
        import jax
        stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:                      # what the engine really took of the GPU, all runs
        summary["flexgen_gpu_peak_gb"] = stats["peak_bytes_in_use"] / 1e9
    rows = {**data.get("runs", {}), **{f"row-by-row {m}": r for m, r in data.get("rowbyrow", {}).items()}}
    print_table(["policy", "block", "out tok/s", "predicted", "s", "prefill pass s", "decode pass s",
                 "weights gpu/cpu/disk MB"],
                [[k + (" *" if v.get("extrapolated") else ""), v["block"], v["out_tok_s"], v.get("predicted_tok_s", ""),
                  v["seconds"], v.get("prefill_pass_s") or "", v.get("decode_pass_mean_s") or "",
                  "/".join(f"{x / 1e6:.1f}" for x in v["weight_bytes"].values())]
                 for k, v in rows.items()])
    if any(v.get("extrapolated") for v in rows.values()):
        print(f"* extrapolated to {data.get('gen_len')} tokens a sequence: the measured setup + prefill pass + "
              "(gen-len - 1) x the mean measured decode pass (each pass's times in the JSON, `pass_s`)", flush=True)
    write_results(args.name, summary, data, args.out_dir)


def _merge(paths: str, runs: dict) -> dict:
    """Runs of earlier parts' result files added to `runs` (this invocation's win on a name clash); returns their
    LP and CPU-attention records and their baselines (`rowbyrow`: host memory kind -> run)."""
    out: dict = {}
    for _, data in merged_parts(paths, "bench.flexgen"):
        for k, v in data.get("runs", {}).items():
            runs.setdefault(k, v)
        for k in ("lp", "cpu_attention_ab"):
            if isinstance(data.get(k), dict):
                out.setdefault(k, data[k])
        base = data.get("rowbyrow")
        if isinstance(base, dict) and "policy" in base:            # an older file: one baseline run
            base = {base["policy"].get("host_memory", "pinned"): base}
        for mem, r in (base or {}).items():
            out.setdefault("rowbyrow", {}).setdefault(mem, r)
    return out
