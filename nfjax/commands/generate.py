"""`nfjax generate PROMPT...`: stream one completion to the terminal, or run several prompts as a batch."""
from __future__ import annotations

import argparse
import sys
import time


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="generate text from prompts (default model: the shipped tiny model)")
    p.add_argument("prompts", nargs="+", help="prompt text; several prompts run as one batch")
    p.add_argument("--token-ids", action="store_true",
                   help="each prompt is token ids (\"1,2,3\" or \"1 2 3\"); prints the generated ids (works "
                        "without a tokenizer)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    from nfjax.engine.builder import add_engine_args
    add_engine_args(p)


def _token_ids(prompt: str) -> list[int]:
    from nfjax.errors import UserError
    try:
        ids = [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"--token-ids: prompt {prompt!r} is not a list of integers") from None
    if not ids:
        raise UserError("--token-ids: a prompt is empty")
    return ids


def _check_fits(ctx: int, tokenizer, prompts: list, max_tokens: int) -> None:
    """`--max-tokens` beyond what the context `ctx` leaves after a prompt is an error, not a silent clamp."""
    from nfjax.errors import UserError
    for i, p in enumerate(prompts):
        n = len(p) if isinstance(p, list) else len(tokenizer.encode(p))
        if n + max_tokens > ctx:
            raise UserError(f"--max-tokens {max_tokens}: prompt {i + 1} has {n} tokens and the context holds "
                            f"{ctx}, so at most {max(ctx - n, 0)} new tokens fit (--max-model-len sets the context, "
                            f"up to the model's)")


def run(args: argparse.Namespace) -> int:
    from nfjax import SamplingParams
    from nfjax.engine.builder import from_flags
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    ids = [_token_ids(p) for p in args.prompts] if args.token_ids else None
    t0 = time.perf_counter()
    engine = from_flags(args, progress=sys.stderr.isatty())
    print(f"[model loaded and compiled in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    _check_fits(engine.max_model_len, engine.tokenizer, ids if ids is not None else args.prompts, args.max_tokens)
    if ids is not None:
        for prompt, out in zip(args.prompts, engine.generate(ids, params)):
            print(" ".join(map(str, out.token_ids)))
            print(f"[{prompt!r}: {len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
        return 0
    if len(args.prompts) == 1:
        out = None
        sys.stdout.write(args.prompts[0])
        for out in engine.stream(args.prompts[0], params):
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if out is not None:
            print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
        return 0
    for prompt, out in zip(args.prompts, engine.generate(args.prompts, params)):
        print(f"--- {prompt!r} [{len(out.token_ids)} tokens, {out.finish_reason}]\n{prompt}{out.text}")
    return 0
