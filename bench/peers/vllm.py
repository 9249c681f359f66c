"""Peer: vLLM (0.26) on a dummy-weight model of the nfjax shape, run in a process of its own. Prints one JSON
line at the end (`{"error": ...}` on failure; in offline mode also one after each workload, so a run cut off
keeps what it finished).

offline: the workloads the nfjax side wrote (bench/peers/workload_io.py: exact prompt ids and output lengths),
    one engine start, a warm-up `generate` on fresh prompts, then ONE timed `llm.generate` over all requests of
    each workload (greedy, ignore_eos, max_tokens per request). Total (prompt + output) and output tokens/s.
latency: light load at each batch size, on fresh random prompts each call (prefix caching would otherwise
    serve a repeated prompt's first token): TTFT and TPOT per request from `RequestOutput.metrics`
    (RequestStateStats: first_token_latency, first_token_ts, last_token_ts; filled when log stats are on) and,
    as a cross-check, from wall time: (t(max_tokens=N) - t(max_tokens=1)) / (N - 1).

vLLM is imported only here, after VLLM_USE_FLASHINFER_SAMPLER=0 (FlashInfer is not carried) and with --vsite
(where bench/peers/prepare_vllm.sh's parts install it; README "Benchmarks") on the path.

usage: python -m bench.peers.vllm --mode offline --model-config M.json --workload 1024x512=W.json
       python -m bench.peers.vllm --mode latency --model-config M.json --batch-sizes 1,64
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

for k, v in {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}.items():
    os.environ.setdefault(k, v)

from bench.common import median_run
from bench.peers.workload_io import hf_config, read_workload, requests_work, stats, vllm_requests

T_START = time.perf_counter()


def use_vsite(path: str) -> None:
    """Put the vLLM install ahead of the installed packages for this process and the processes vLLM starts:
    first on PYTHONPATH, this process started again with it there (before vLLM is imported)."""
    if not os.path.isdir(path):
        return
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "bench.peers.vllm", *sys.argv[1:]])


def write_model_dir(path: str, model: dict) -> None:
    """config.json and generation_config.json for the shape, plus a word-level tokenizer of the full vocabulary
    (unused with skip_tokenizer_init; there so the folder also loads with a tokenizer) when `tokenizers` is
    installed."""
    os.makedirs(path, exist_ok=True)
    cfg = hf_config(model)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": cfg["eos_token_id"], "bos_token_id": cfg["bos_token_id"]}, f)
    tok_path = os.path.join(path, "tokenizer.json")
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        return
    if not os.path.exists(tok_path):
        tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(model["vocab_size"])}, unk_token="<0>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(tok_path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<0>",
                   "model_max_length": model["max_position_embeddings"]}, f)


def make_llm(args, model: dict, res: dict, log_stats: bool):
    import torch
    import vllm
    from vllm import LLM
    kw = dict(model=args.model_dir, load_format="dummy", dtype=model["dtype"], skip_tokenizer_init=True,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0, enforce_eager=False,
              disable_log_stats=not log_stats)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    res.update(vllm=vllm.__version__, torch=torch.__version__, llm_kwargs=kw)
    t = time.perf_counter()
    llm = LLM(**kw)
    res["init_s"] = time.perf_counter() - t
    try:                                     # the values vLLM chose where we left its defaults
        vc = llm.llm_engine.vllm_config
        res["engine"] = {"max_num_seqs": vc.scheduler_config.max_num_seqs,
                         "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
                         "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
                         "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
                         "block_size": vc.cache_config.block_size, "max_model_len": vc.model_config.max_model_len}
    except AttributeError as e:              # another vLLM version: the run goes on without them
        res["engine"] = {"error": repr(e)}
    res["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return llm


def generate(llm, reqs: list[tuple[dict, int]]):
    """One timed `llm.generate` of `reqs` (greedy, ignore_eos): (seconds, outputs)."""
    from vllm import SamplingParams
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], sps, use_tqdm=False)
    return time.perf_counter() - t, outs


def fresh(n: int, prompt_len: int, output_len: int, vocab: int, seed: int):
    """`n` random prompts never seen before in this process (a new seed per call)."""
    from bench.workloads import fixed
    return vllm_requests(fixed(n, prompt_len, output_len, vocab, seed=seed))


def run_offline(args, model: dict, res: dict) -> None:
    works = {}
    for spec in args.workload:
        name, _, path = spec.partition("=")
        reqs = vllm_requests(read_workload(path))
        works[name] = reqs
        res["workloads"][name] = stats(requests_work(reqs))        # what is sent, for the caller to compare
    write_model_dir(args.model_dir, model)
    llm = make_llm(args, model, res, log_stats=False)
    dt, _ = generate(llm, fresh(16, 256, 32, model["vocab_size"], seed=12345))
    res["warmup_s"] = dt
    for name, reqs in works.items():
        dt, outs = generate(llm, reqs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
        res["results"][name] = {"requests": len(outs), "prompt_tokens": n_in, "output_tokens": n_out,
                                "asked_output_tokens": sum(n for _, n in reqs), "seconds": dt,
                                "total_tok_s": (n_in + n_out) / dt, "output_tok_s": n_out / dt}
        print(f"[vllm {name}] {len(outs)} requests in {dt:.2f}s: {(n_in + n_out) / dt:,.0f} total tok/s, "
              f"{n_out / dt:,.0f} output tok/s", flush=True)
        print(json.dumps(res), flush=True)          # a cumulative line: kept if a later workload runs out of time


def per_request(outs) -> dict:
    """Mean TTFT and TPOT (ms) from each RequestOutput's metrics (RequestStateStats), where vLLM filled them."""
    ttft, tpot = [], []
    for o in outs:
        m = getattr(o, "metrics", None)
        n = len(o.outputs[0].token_ids)
        if m is None or not getattr(m, "first_token_ts", 0.0):
            continue
        ttft.append(m.first_token_latency * 1e3)
        if n > 1:
            tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1) * 1e3)
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return {"ttft_ms": mean(ttft), "tpot_ms": mean(tpot), "requests_with_metrics": len(ttft)}


def run_latency(args, model: dict, res: dict) -> None:
    write_model_dir(args.model_dir, model)
    llm = make_llm(args, model, res, log_stats=True)
    vocab, seed = model["vocab_size"], 1000
    for bs in args.batch_sizes:
        seed += 3
        generate(llm, fresh(bs, args.prompt_len, 8, vocab, seed))                       # warm-up at this size
        t1, _ = generate(llm, fresh(bs, args.prompt_len, 1, vocab, seed + 1))
        runs = []
        for i in range(args.repeats):          # fresh prompts each: the median run by TPOT (bench.common)
            tn, outs = generate(llm, fresh(bs, args.prompt_len, args.output_len, vocab, seed + 2 + 7919 * i))
            r = {"batch": bs, "prompt_len": args.prompt_len, "output_len": args.output_len,
                 "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds_1": t1,
                 "seconds_n": tn, "tpot_ms_wall": (tn - t1) / (args.output_len - 1) * 1e3, **per_request(outs)}
            r["tpot_source"] = "metrics" if r["tpot_ms"] is not None else "wall"
            if r["tpot_ms"] is None:
                r["tpot_ms"] = r["tpot_ms_wall"]
            runs.append(r)
        r = median_run(runs)
        res["results"][str(bs)] = r
        print(f"[vllm bs={bs}] TPOT {r['tpot_ms']:.2f} ms ({r['tpot_source']}; wall {r['tpot_ms_wall']:.2f}), "
              f"TTFT {r['ttft_ms'] if r['ttft_ms'] is None else round(r['ttft_ms'], 2)} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["offline", "latency"], required=True)
    ap.add_argument("--model-config", required=True, help="the nfjax ModelConfig as JSON (ModelConfig.to_json())")
    ap.add_argument("--shape", default=None, help="the shape's name, recorded only")
    ap.add_argument("--model-dir", default=None, help="where config.json goes (default: a temporary folder)")
    ap.add_argument("--workload", action="append", default=[], help="NAME=FILE (offline; repeatable)")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="latency: measured runs of each batch size (median)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's (recorded in the result)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--vsite", default=os.environ.get("VSITE", "/tmp/vsite"))
    args = ap.parse_args()
    res = {"peer": "vllm", "mode": args.mode, "shape": args.shape, "complete": False, "workloads": {},
           "results": {}}
    try:
        if args.mode == "latency" and args.output_len < 2:
            raise ValueError("--output-len must be >= 2 (TPOT needs two tokens)")
        with open(args.model_config) as f:
            model = json.load(f)
        if args.model_dir is None:
            args.model_dir = tempfile.mkdtemp(prefix="nfjax-vllm-model-")
        use_vsite(args.vsite)
        (run_offline if args.mode == "offline" else run_latency)(args, model, res)
        res["complete"] = True
    except Exception as e:  # noqa: BLE001 - the caller reads one JSON line whatever happens
        res["error"] = f"{type(e).__name__}: {e}"[:1500]
    res["wall_s"] = time.perf_counter() - T_START
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
