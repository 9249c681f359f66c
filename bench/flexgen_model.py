"""bench.flexgen's cost-model half (issue #25): this machine's hardware profile, a grid of feasible policies spread
over the cost model's predictions, the LP's policy, and the predicted-vs-measured comparison.

The generated grid (`--grid auto`): every combination of GPU batch size, batches per block, weights and KV cache
percentages on the GPU (the rest in host memory) and CPU attention on/off that fits the caps (`budget.check`),
ranked by predicted throughput and sampled evenly over that ranking (the top predicted included), so the grid's
best measured policy is a fair bar for the LP's.
"""
from __future__ import annotations

import itertools

GRID_BS = (1, 2, 4, 8, 16, 32, 64)
GRID_NB = (1, 2, 4, 8, 16, 32)
GRID_W_GPU = (0, 25, 50, 75, 100)
GRID_KV_GPU = (0, 10, 25, 50, 100)


def profile(cfg, args, log=print):
    """This machine's hardware profile (measured, or its cache), or the one `--hardware FILE` names: a profile
    JSON or a bench.flexgen result holding one (the parts of a split grid then rank the same policies)."""
    import jax

    from nfjax.offload.hardware import HardwareProfile, measure
    from nfjax.offload.engine import default_offload_dir
    if getattr(args, "hardware", None):
        import json
        try:
            doc = json.load(open(args.hardware))
            doc = doc.get("data", {}).get("hardware", doc)
            prof = HardwareProfile.from_json(doc)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise SystemExit(f"--hardware {args.hardware}: not a hardware profile ({e!r})") from None
        log(f"{prof.line()} [from {args.hardware}]")
        return prof
    return measure(jax.devices()[0], cfg.dtype, args.offload_dir or default_offload_dir(),
                   remeasure=bool(getattr(args, "remeasure_hardware", False)), log=log)


def workload(args):
    from nfjax.offload.cost_model import Workload
    return Workload(args.prompt_len, args.gen_len, args.prompt_len + args.gen_len)


def caps(args):
    import jax

    from nfjax.offload import Policy
    from nfjax.offload.engine import default_offload_dir
    from nfjax.offload.search import machine_caps
    base = Policy(gpu_memory_gb=args.gpu_memory_gb, cpu_memory_gb=args.cpu_memory_gb, disk_gb=args.disk_gb)
    return machine_caps(base, jax.devices()[0], args.offload_dir or default_offload_dir())


def auto_grid(cfg, args, hw, limits, n: int, make_policy) -> dict:
    """`n` feasible policies (name -> Policy) spread over the cost model's ranking, at most `--max-block`
    sequences a block."""
    from nfjax.offload import PolicyError, Split, budget
    from nfjax.offload.cost_model import predict
    wl = workload(args)
    scored = []
    for bs, nb, wg, cg, ca in itertools.product(GRID_BS, GRID_NB, GRID_W_GPU, GRID_KV_GPU, (False, True)):
        if bs * nb > args.max_block or (ca and cg == 100):
            continue
        pol = make_policy(dict(gpu_batch_size=bs, num_gpu_batches=nb, weights=Split(wg, 100 - wg, 0),
                               cache=Split(cg, 100 - cg, 0), cpu_attention=ca), args)
        try:
            budget.check(cfg, pol, wl.context, limits)
        except PolicyError:
            continue
        name = f"{'ca-' if ca else ''}w{wg}-kv{cg}-{bs}x{nb}"
        scored.append((predict(cfg, pol, wl, hw).out_tok_s, name, pol))
    scored.sort(key=lambda x: -x[0])
    if len(scored) <= n:
        return {name: pol for _, name, pol in scored}
    picks = sorted({round(i * (len(scored) - 1) / max(1, n - 1)) for i in range(n)})     # n = 1: the top one
    return {scored[i][1]: scored[i][2] for i in picks}


def lp_policy(cfg, args, hw, limits, make_policy, log=print):
    from nfjax.offload.search import search
    res = search(cfg, workload(args), hw, limits, base=make_policy({}, args), max_block=args.max_block, log=log)
    return res


def predicted(cfg, policy_json: dict, args, hw) -> dict:
    """The cost model's numbers for a run's policy."""
    from nfjax.offload import Policy
    from nfjax.offload.cost_model import predict
    p = predict(cfg, Policy.from_json(policy_json), workload(args), hw)
    return {"predicted_tok_s": p.out_tok_s, "predicted_prefill_layer_s": p.prefill_layer_s,
            "predicted_decode_layer_s": p.decode_layer_s, "predicted_lanes": p.lanes}


def error_pct(run: dict) -> float:
    return 100 * (run["predicted_tok_s"] - run["out_tok_s"]) / run["out_tok_s"]


def run_seconds(cfg, policy, args, hw) -> float:
    """The cost model's seconds for bench.flexgen's run of a policy: the warm-up's prefill and decode pass, then the
    timed prefill and its decode passes (`--policy-gen-len`, else all of `--gen-len`'s); placing not counted."""
    from nfjax.offload.cost_model import predict
    p = predict(cfg, policy, workload(args), hw)
    passes = min(args.policy_gen_len or args.gen_len, args.gen_len)
    prefill = cfg.num_layers * p.prefill_layer_s
    decode = (p.seconds - prefill) / max(1, args.gen_len - 1)
    return 2 * prefill + passes * decode
