"""Peer: HF transformers continuous batching (`generate_batch`, paged attention) on a random-weight model of
the same shape, same workload, same GPU. Prints one JSON line.

usage: python bench/hf_peer.py --shape llama3-8b --workload 1024x512 --num-requests 32
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--workload", default="1024x512")
    ap.add_argument("--num-requests", type=int, default=32)
    args = ap.parse_args()
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from bench.workloads import parse
    from nfjax.models.random_init import SHAPES
    c = SHAPES[args.shape]
    res = {"peer": "hf-transformers generate_batch", "transformers": transformers.__version__,
           "torch": torch.__version__, "workload": args.workload, "n": args.num_requests}
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, rope_theta=c.rope_theta,
                      max_position_embeddings=c.max_position_embeddings)
    torch.set_default_dtype(torch.bfloat16)
    for impl in ("sdpa_paged", "paged|sdpa", "paged_attention"):
        try:
            cfg._attn_implementation = impl
            with torch.device("cuda"):
                model = LlamaForCausalLM(cfg).eval()
            res["attn_impl"] = impl
            break
        except Exception as e:  # noqa: BLE001 - name differs across transformers versions
            res["attn_error"] = repr(e)[:200]
    else:
        print(json.dumps(res)); return
    work = parse(args.workload, args.num_requests, c.vocab_size, seed=1)
    kw = {"progress_bar": False} if "progress_bar" in inspect.signature(model.generate_batch).parameters else {}
    warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=[w[0] for w in work[:2]], generation_config=warm, **kw)
    torch.cuda.synchronize()
    t = time.perf_counter()
    if len({lout for _, lout in work}) == 1:
        gc = GenerationConfig(max_new_tokens=work[0][1], do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate_batch(inputs=[w[0] for w in work], generation_config=gc, **kw)
        gen = sum(len(v.generated_tokens) for v in out.values())
        res["api"] = "generate_batch"
    else:   # per-request output lengths: the continuous-batching manager takes max_new_tokens per request
        gc = GenerationConfig(max_new_tokens=max(w[1] for w in work), do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        manager = model.init_continuous_batching(generation_config=gc)
        manager.start()
        ids = [manager.add_request(w[0], max_new_tokens=w[1]) for w in work]
        gen, got = 0, 0
        while got < len(ids):
            r = manager.get_result(timeout=600)
            if r is None:
                break
            got += 1
            gen += len(r.generated_tokens)
        manager.stop(block=True)
        res["api"] = "init_continuous_batching"
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    prompt = sum(len(w[0]) for w in work)
    res.update(seconds=dt, prompt_tokens=prompt, generated=gen, total_tok_s=(prompt + gen) / dt)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
