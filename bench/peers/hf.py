"""Peer: HF transformers continuous batching (paged attention) on a random-weight model of the same shape, same
workload, same device. Prints one JSON line (always: a run cut off by --time-limit prints what it finished).

API path (recorded as "api"): the continuous-batching manager (`init_continuous_batching` with the workload's
hints, `warmup()`, `start()`, one `add_request(ids, max_new_tokens=L, eos_token_id=-1)` per request, results
from `get_result`): every request gets its own output length, and the manager's creation, cache allocation and
warm-up stay outside the timed region, as the engine's compilation does. `generate_batch` (one max_new_tokens for
all) is used only where the manager path is missing or fails, and then records the tokens it over-generated.

Why a ShareGPT-shaped run takes long: the longest of 16 requests (seed 1) wants 1445 tokens, so the run lasts at
least 1445 decode steps, and HF's steps at 8B cost tens of ms each. --time-limit (seconds since start) stops the
manager there (a hard stop fails open requests, which return the tokens they have) and reports `partial` numbers.

usage: python -m bench.peers.hf --shape llama3-8b --workload sharegpt --num-requests 16 --time-limit 200
CPU:   python -m bench.peers.hf --shape smoke --workload sharegpt --num-requests 8
"""
from __future__ import annotations

import argparse
import inspect
import json
import time

T_START = time.perf_counter()


def hf_config(c):
    import transformers
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
              num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, head_dim=c.head_dim,
              num_key_value_heads=c.num_kv_heads, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
              max_position_embeddings=c.max_position_embeddings, attn_implementation="sdpa")
    if c.model_type == "mixtral":
        return transformers.MixtralConfig(**{**kw, "intermediate_size": c.moe_intermediate_size},
                                          num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                                          sliding_window=None)
    return transformers.LlamaConfig(**kw)


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def run_manager(model, work, gc, device: str, deadline: float, res: dict, gen_limit: float | None = None) -> dict:
    """Per-request output lengths through the continuous-batching manager: {seconds, complete, outputs by input
    index}. Setup (manager, cache, warm-up) is outside the timed region; a cut-off run is timed up to the cut."""
    kw = {}
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        kw["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p, _ in work),
                                             max_generated_length=max(o for _, o in work), num_requests=len(work))
    except ImportError:
        res["workload_hints"] = "unavailable"
    t = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gc, **kw)
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    res["attn_impl"] = model.config._attn_implementation
    cfg = getattr(manager, "continuous_batching_config", None)
    res["cb_config"] = {k: repr(getattr(cfg, k)) for k in ("block_size", "page_size", "num_blocks", "max_batch_tokens",
                        "max_requests_per_batch", "max_blocks_per_request", "use_cuda_graph", "use_async_batching")
                        if hasattr(cfg, k)}
    try:
        # warm-up requests through the running loop (first kernels, allocator), then the timed run
        wait_all(manager, [manager.add_request(p[:16], max_new_tokens=4, eos_token_id=-1) for p, _ in work[:2]],
                 deadline)
        res["setup_s"] = time.perf_counter() - t
        _sync(device)
        t0 = time.perf_counter()
        ids = {manager.add_request(p, max_new_tokens=o, eos_token_id=-1): i for i, (p, o) in enumerate(work)}
        got = wait_all(manager, list(ids), min(deadline, t0 + (gen_limit or float("inf"))))
        finished = all(r is not None and r.is_finished() and r.error is None for r in got.values()) and \
            len(got) == len(ids)
        _sync(device)
        dt = time.perf_counter() - t0     # a cut-off run: up to the stop (a step's tokens may land after it)
        if not finished:          # the deadline: stop now; open requests come back failed, with their tokens
            manager.stop(block=True, timeout=30, hard_stop=True)
            drain(manager, got, ids)
        err = getattr(getattr(manager, "background_thread_status", None), "fatal_error", None)
        if err is not None:
            res["manager_fatal_error"] = repr(err)[:500]
    finally:
        if manager.is_running():
            manager.stop(block=True, timeout=30)
    done = {ids[k]: r for k, r in got.items() if k in ids}
    return {"seconds": dt, "complete": finished, "outputs": done}


def wait_all(manager, request_ids: list, deadline: float) -> dict:
    want, got = set(request_ids), {}
    while want - set(got):
        if time.perf_counter() > deadline:
            break
        r = manager.get_result(timeout=0.5)
        if r is None:
            if not manager.is_running():
                break
            continue
        if r.request_id in want and r.is_finished():
            got[r.request_id] = r
    return got


def drain(manager, got: dict, ids: dict) -> None:
    while True:
        r = manager.get_result(timeout=0.5)
        if r is None:
            return
        if r.request_id in ids and r.request_id not in got:
            got[r.request_id] = r


def run_generate_batch(model, work, gc, device: str, res: dict) -> dict:
    """Fallback: one max_new_tokens for every request (the longest asked); over-generation is recorded."""
    kw = {"progress_bar": False} if "progress_bar" in inspect.signature(model.generate_batch).parameters else {}
    from transformers import GenerationConfig
    warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=[p[:16] for p, _ in work[:2]], generation_config=warm, **kw)
    res["attn_impl"] = model.config._attn_implementation
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=[p for p, _ in work], generation_config=gc, **kw)
    _sync(device)
    dt = time.perf_counter() - t0
    outs = {int(k.split("_")[1]): r for k, r in out.items() if k.split("_")[-1].isdigit()}   # "req_<input index>"
    return {"seconds": dt, "complete": len(outs) == len(work), "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--workload", default="1024x512")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--api", choices=["auto", "manager", "generate_batch"], default="auto")
    ap.add_argument("--time-limit", type=float, default=120.0,
                    help="seconds from start; the timed run stops there and reports partial numbers")
    ap.add_argument("--gen-limit", type=float, default=None, help="also stop the timed run this long after it starts")
    args = ap.parse_args()
    res = {"peer": "hf-transformers continuous batching", "workload": args.workload, "n": args.num_requests,
           "time_limit_s": args.time_limit}
    try:
        measure(args, res)
    except Exception as e:  # noqa: BLE001 - the caller reads one JSON line whatever happens
        res["error"] = f"{type(e).__name__}: {e}"[:1500]
    res["wall_s"] = time.perf_counter() - T_START
    print(json.dumps(res), flush=True)


def measure(args, res: dict) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaForCausalLM

    from bench.workloads import parse
    from nfjax.models.random_init import SHAPES
    c = SHAPES[args.shape]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res.update(transformers=transformers.__version__, torch=torch.__version__, device=device, dtype=c.dtype)
    torch.set_default_dtype(getattr(torch, c.dtype))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config(c)).eval()
    res["init_s"] = time.perf_counter() - T_START
    work = parse(args.workload, args.num_requests, c.vocab_size, seed=1)
    longest = max(o for _, o in work)
    gc = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0)
    deadline = T_START + args.time_limit
    run = None
    if args.api in ("auto", "manager"):
        try:
            with torch.no_grad():
                run = run_manager(model, work, gc, device, deadline, res, args.gen_limit)
            res["api"] = "init_continuous_batching+add_request(max_new_tokens per request)"
        except Exception as e:  # noqa: BLE001 - fall back to generate_batch, and say why
            if args.api == "manager":
                raise
            res["manager_error"] = f"{type(e).__name__}: {e}"[:500]
    if run is None:
        run = run_generate_batch(model, work, gc, device, res)
        res["api"] = "generate_batch(max_new_tokens=max over requests)"
    outs = run["outputs"]
    gen_all = {i: len(r.generated_tokens) for i, r in outs.items()}
    needed = {i: min(n, work[i][1]) for i, n in gen_all.items()}     # tokens each request asked for
    started = [i for i, n in gen_all.items() if n > 0]
    prompt = sum(len(work[i][0]) for i in started)
    gen = sum(needed.values())
    dt = run["seconds"]
    res.update(seconds=dt, complete=run["complete"], requests_finished=sum(
        1 for i, r in outs.items() if r.error is None and gen_all[i] >= work[i][1]),
        prompt_tokens=prompt, generated=gen, generated_all=sum(gen_all.values()),
        over_generated=sum(gen_all.values()) - gen, asked_tokens=sum(o for _, o in work),
        asked_prompt_tokens=sum(len(p) for p, _ in work), longest_output=longest)
    if run["complete"]:
        res["total_tok_s"] = (prompt + gen) / dt
    else:   # cut off: the rate over the window run, tail excluded (which favours the peer); not the headline
        res["partial"] = True
        res["partial_total_tok_s"] = (prompt + gen) / dt


if __name__ == "__main__":
    main()
