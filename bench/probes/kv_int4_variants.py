"""Which KV format holds SmolLM2's accuracy at about 4-5 bits a value (issue #21): K and V schemes applied by fake
quantization (the cache holds K/V exactly, in float32; attention quantizes and dequantizes them as it reads each
block), scored with bench/kv_accuracy.py's text, windows, lockstep teacher-forced loop and metric against a
bfloat16 cache.

How: one baseline engine (`--base-dtype` weights, bfloat16-format cache) runs the windows once and its logits are
kept; then every variant builds its own engine and runs the same steps. A variant's engine is kv_accuracy's fp8
slot with its values stored in float32 (`kv_quant.value_dtype`/`quantize_kv` patched) and the CPU attention path
(`nfjax.kv.attention._reference`) replaced by the blocked loop of nfjax/kv/blocked_attention.py with a fake
quantizer on each block's K and V. Quantizing at read time is exact for per-token schemes (the same values
every read); for per-page schemes a page is quantized once it is complete (all its positions written, from its
own values: a write-time quantizer that waits for the page to fill) and a page still filling is read exactly
(KIVI's full-precision residual; pages of 16 are filled by every chunk of 16, so at --chunk 16 they never wait).

A variant is comma-separated parts: `k:SCHEME,v:SCHEME`, or `real:FORMAT` (the engine's own kv_dtype, no fake),
or `model:float32` (an engine with float32 weights and a float32 cache: bf16's own noise against the baseline);
`rt:bf16` added to a k/v variant rounds the queries and outputs through the shipped int4's rotation as
nfjax.kv.attention does (rotate_queries / rotate_outputs in the model's dtype), K and V quantized as named;
`rt:o` the outputs only (a format with V rotated and K not).
A per-page scheme's pages still filling are read exactly, or through `kiviP/SCHEME` or `fp8pP/SCHEME` (e.g.
kivi64/rot64: the page's positions held in a per-token format until it is complete).
Schemes (D = head_dim; P a page of P positions, any divisor of the blocked loop's 256 positions):
  exact | bf16           as stored / rounded to bfloat16
  rotN | plainN          int4 groups of N along D, center and scale per group (kv_quant.quantize_int4's
                         arithmetic), after the Hadamard rotation (rot) or not; `rotNbB`: B bits instead of 4
  kiviP | rkiviP         int4 per channel along a page of P positions (KIVI's K): center and scale per channel,
                         page and kv head; rkivi rotated first
  pcP+rotN | pcP+plainN  each channel minus its mean over the page (bfloat16, one row a page and kv head), then
                         rotN / plainN, the mean added back
  cal+rotN | cal+plainN  each channel minus a calibrated mean per layer, kv head and channel (from the baseline's
                         cache over --calib-text, not the held-out text): exact for K with no correction, since
                         softmax ignores a constant q.mean added to every score of a query
  cals+rotN | cals+plainN  as cal+, each channel also divided by its calibrated std (multiplied back after):
                         the same as quantizing K / std and taking queries times std; calsNN: std ** 0.NN
  cal+fp8 | cals+fp8     fp8 per token after the calibrated centering (and scaling); cal+rfp8 also rotated (as
                         rfp8) after the centering
  fp8 | fp8e5            float8 e4m3 / e5m2, one scale per token and kv head (kv_quant's rule: amax / max,
                         rounded up to bfloat16)
  rfp8 | rfp8e5          the same after the Hadamard rotation along D (int4's: q.k and the outputs unchanged),
                         rotated back after
  fp8pP | fp8e5pP        the same with one scale per page of P and kv head (from the complete page's amax)
  SCHEME@rP              SCHEME on the complete pages of P positions, the page still filling read exactly (a
                         full-precision residual of up to P - 1 positions, as the per-page schemes have)
  SCHEME@sN              SCHEME past the first N positions of each sequence, those kept in bfloat16 (the
                         attention sink: the rows every query attends to most)

usage: python -m bench.probes.kv_int4_variants k:rot64,v:rot64 k:kivi16,v:rot64 [...] [--windows 2]
       [--base-dtype float32] [--name kv_int4_variants-v2]
Prints one JSON line a variant (ppl change, top-1 agreement, KL, effective bits of K and V at this head_dim and
at 128) and, with --name, writes bench/results/<name>-<date>.json. A probe: its patches live in this process.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

import numpy as np

SPEC = {"k": None, "v": None, "traced": 0}        # the variant being built (read when its engine traces)
CAL_MEAN = None                                   # ([L, KH, D], [L, KH, D]) f32: the calibrated K channel means, stds
FP8_FORMATS = {"fp8": ("float8_e4m3fn", 448.0), "fp8e5": ("float8_e5m2", 57344.0)}


# ---- schemes -------------------------------------------------------------------------------------------------
def parse_scheme(s: str) -> dict:
    m = re.fullmatch(r"(.+)@s(\d+)", s)
    if m:
        return {"kind": "sink", "n": int(m[2]), "inner": parse_scheme(m[1])}
    m = re.fullmatch(r"(.+)@r(\d+)", s)
    if m:
        return {"kind": "res", "page": int(m[2]), "inner": parse_scheme(m[1]), "partial": None}
    if s in ("exact", "bf16"):
        return {"kind": s}
    m = re.fullmatch(r"(rot|plain)(\d+)(?:b(\d+))?", s)
    if m:
        return {"kind": "group", "rot": m[1] == "rot", "group": int(m[2]), "bits": int(m[3] or 4)}
    m = re.fullmatch(r"(r?)kivi(\d+)(?:/(.+))?", s)
    if m:
        return {"kind": "kivi", "rot": m[1] == "r", "page": int(m[2]), "bits": 4,
                "partial": parse_scheme(m[3]) if m[3] else None}
    m = re.fullmatch(r"(pc(\d+)|cal|cals(\d*))\+(rot|plain)(\d+)", s)
    if m:
        return {"kind": "pc" if m[2] else "cal", "page": int(m[2]) if m[2] else None, "rot": m[4] == "rot",
                "group": int(m[5]), "bits": 4, "alpha": _alpha(m[1], m[3])}
    m = re.fullmatch(r"(cal|cals(\d*))\+(r?)(fp8|fp8e5)", s)
    if m:
        return {"kind": "calfp8", "fmt": m[4], "rot": m[3] == "r", "alpha": _alpha(m[1], m[2])}
    m = re.fullmatch(r"(r?)(fp8|fp8e5)(?:p(\d+))?(?:/(.+))?", s)
    if m and (m[3] or not m[4]) and not (m[1] and m[3]):
        return {"kind": "fp8", "fmt": m[2], "rot": m[1] == "r", "page": int(m[3]) if m[3] else None,
                "partial": parse_scheme(m[4]) if m[4] else None}
    raise SystemExit(f"scheme {s!r}: want exact|bf16|rotN|plainN[bB]|[r]kiviP|pcP+rotN|cal+rotN|fp8[e5][pP]|rfp8[e5]")


def _alpha(name: str, digits: str | None) -> float:
    """cal: no channel scale (0); cals: each channel divided by its calibrated std (1); calsNN: by std ** 0.NN."""
    if name == "cal":
        return 0.0
    return int(digits) / 100 if digits else 1.0


def bits(spec: dict | None, d: int) -> float:
    """Stored bits a value (scales, centers and means in bfloat16; before padding aux rows to 16 bytes)."""
    if spec is None or spec["kind"] in ("exact", "bf16"):
        return 16.0
    k = spec["kind"]
    if k in ("res", "sink"):         # the sink's first positions not counted (a few rows a sequence)
        return bits(spec["inner"], d)
    if k == "group":
        return spec["bits"] + 32 / min(spec["group"], d)
    if k == "kivi":          # the partial page's format not counted (one page a sequence)
        return spec["bits"] + 32 / spec["page"]
    if k == "pc":
        return spec["bits"] + 32 / min(spec["group"], d) + 16 / spec["page"]
    if k == "cal":
        return spec["bits"] + 32 / min(spec["group"], d)
    if k == "calfp8":
        return 8 + 16 / d
    if k == "fp8":
        return 8 + (16 / d if spec["page"] is None else 16 / (d * spec["page"]))
    raise ValueError(k)


def _int_round(x, lo, hi, nbits):
    """x through 2**nbits levels spanning [lo, hi] (kv_quant.quantize_int4's arithmetic: a bfloat16 center, a
    scale rounded up to bfloat16)."""
    import jax.numpy as jnp
    from pallas_kernels import kv_quant as kq
    half = (2 ** nbits - 1) / 2
    c = ((lo + hi) * 0.5).astype(jnp.bfloat16).astype(jnp.float32)
    s = jnp.maximum(kq._bf16_up(jnp.maximum(hi - c, c - lo) / half), 1e-30)
    return (jnp.clip(jnp.round((x - c) / s + half), 0, 2 * half) - half) * s + c


def _groups(x, group, nbits):
    *lead, d = x.shape
    g = min(group, d)
    xg = x.reshape(*lead, d // g, g)
    return _int_round(xg, xg.min(-1, keepdims=True), xg.max(-1, keepdims=True), nbits).reshape(x.shape)


def _fp8(x, fmt, amax):
    import jax.numpy as jnp
    from pallas_kernels import kv_quant as kq
    dt, mx = FP8_FORMATS[fmt]
    s = jnp.maximum(kq._bf16_up(amax / mx), 1e-30)
    return jnp.clip(x / s, -mx, mx).astype(getattr(jnp, dt)).astype(jnp.float32) * s


def fake(x, spec: dict | None, pos0, seq_lens, mean=None):
    """x [S, W, KH, D] f32: positions pos0 .. pos0 + W of every sequence -> x through the scheme."""
    import jax.numpy as jnp
    from pallas_kernels import kv_quant as kq
    if spec is None or spec["kind"] == "exact":
        return x
    k = spec["kind"]
    if k == "bf16":
        return x.astype(jnp.bfloat16).astype(jnp.float32)
    if k == "sink":                  # the first n positions of every sequence kept in bfloat16
        pos = pos0 + jnp.arange(x.shape[1])
        keep = x.astype(jnp.bfloat16).astype(jnp.float32)
        return jnp.where((pos < spec["n"])[None, :, None, None], keep, fake(x, spec["inner"], pos0, seq_lens, mean))
    rot = (lambda a: kq.rotate(a, jnp.float32)) if spec.get("rot") else (lambda a: a)
    if k == "group":
        return rot(_groups(rot(x), spec["group"], spec["bits"]))
    if k == "cal":
        mu, sd = mean[0], mean[1] ** spec["alpha"]
        return rot(_groups(rot((x - mu) / sd), spec["group"], spec["bits"])) * sd + mu
    if k == "calfp8":
        mu, sd = mean[0], mean[1] ** spec["alpha"]
        y = rot((x - mu) / sd)
        return rot(_fp8(y, spec["fmt"], jnp.max(jnp.abs(y), -1, keepdims=True))) * sd + mu
    if k == "fp8" and spec["page"] is None:
        xr = rot(x)
        return rot(_fp8(xr, spec["fmt"], jnp.max(jnp.abs(xr), -1, keepdims=True)))
    # per-page schemes: [S, W / P, P, KH, D]; a page is quantized once complete, read exactly before
    s, w, kh, d = x.shape
    p = spec["page"]
    assert w % p == 0, (w, p)
    xp = x.reshape(s, w // p, p, kh, d)
    start = pos0 + p * jnp.arange(w // p)
    done = (start[None, :] + p <= seq_lens[:, None])[:, :, None, None, None]
    if k == "kivi":
        xr = rot(xp)
        y = rot(_int_round(xr, xr.min(2, keepdims=True), xr.max(2, keepdims=True), spec["bits"]))
    elif k == "pc":
        mu = xp.mean(2, keepdims=True).astype(jnp.bfloat16).astype(jnp.float32)
        y = rot(_groups(rot(xp - mu), spec["group"], spec["bits"])) + mu
    elif k == "fp8":
        y = _fp8(xp, spec["fmt"], jnp.max(jnp.abs(xp), (2, 4), keepdims=True))
    elif k == "res":
        y = fake(x, spec["inner"], pos0, seq_lens, mean).reshape(xp.shape)
    else:
        raise ValueError(k)
    partial = fake(x, spec.get("partial"), pos0, seq_lens, mean).reshape(xp.shape)
    return jnp.where(done, y, partial).reshape(x.shape)


# ---- the patched engine --------------------------------------------------------------------------------------
def fake_blocked_attention(q, k_pages, v_pages, positions, token_seq, page_table, seq_lens, scale, layer):
    """nfjax/kv/blocked_attention.py's loop with `fake` applied to each block's K and V (and `rt`'s rotations
    rounded as the shipped int4 rounds them)."""
    import jax.numpy as jnp
    from nfjax.kv.blocked_attention import blocked_paged_attention
    from pallas_kernels import kv_quant as kq
    rt_dtype = q.dtype
    _, ps, kh, d = k_pages.shape
    s = page_table.shape[0]
    rt = SPEC.get("rt")
    if rt == "bf16":   # the shipped int4's query rotation, rounded to the model's dtype: (q H) rounded, times H
        q = kq.rotate(kq.rotate(q, q.dtype), jnp.float32)
    # the calibrated K channel means and stds of this layer (cal+ schemes)
    mean = None if CAL_MEAN is None else (jnp.asarray(CAL_MEAN[0])[layer], jnp.asarray(CAL_MEAN[1])[layer])
    ks, vs = SPEC["k"], SPEC["v"]
    SPEC["traced"] += 1

    def read_block(pages, start):
        width = pages.shape[1] * ps
        return tuple(fake(x[pages].reshape(s, width, kh, d).astype(jnp.float32), spec, start, seq_lens, mean)
                     for x, spec in ((k_pages, ks), (v_pages, vs)))

    out = blocked_paged_attention(q.astype(jnp.float32), k_pages, v_pages, positions, token_seq, page_table,
                                  seq_lens, scale, read_block=read_block)
    if rt:          # and its output rotation: the rotated output rounded, rotated back, rounded
        out = kq.rotate(kq.rotate(out, jnp.float32).astype(rt_dtype), jnp.float32)
    return out.astype(rt_dtype)


def install() -> None:
    """While SPEC["k"/"v"] are set (`fake_on`), an fp8 engine is the fake one: float32 values, no aux in use."""
    import jax.numpy as jnp
    import nfjax.kv.attention as attn
    from pallas_kernels import kv_quant as kq
    value_dtype, quantize_kv, reference = kq.value_dtype, kq.quantize_kv, attn._reference

    def value_dtype_(fmt, model_dtype):
        return jnp.dtype(jnp.float32) if fmt == "fp8" and SPEC.get("on") else value_dtype(fmt, model_dtype)

    def quantize_kv_(fmt, k, v):
        if fmt == "fp8" and SPEC.get("on"):
            return k.astype(jnp.float32), v.astype(jnp.float32), jnp.zeros(k.shape[:-1] + (8,), jnp.bfloat16)
        return quantize_kv(fmt, k, v)

    def reference_(q, kv, layer, meta, scale):
        if kv.kv_dtype == "fp8" and kv.k.dtype == jnp.float32:
            t = q.shape[0]
            k, v, _ = kv.layer_pages(layer)
            return fake_blocked_attention(q, k, v, meta.positions[:t], meta.token_seq[:t], meta.page_table,
                                          meta.seq_lens, scale, layer)
        return reference(q, kv, layer, meta, scale)
    kq.value_dtype, kq.quantize_kv, attn._reference = value_dtype_, quantize_kv_, reference_


# ---- the lockstep loop -------------------------------------------------------------------------------------
class Setup:
    """kv_accuracy.run_model's windows, cache shape and step metadata, built once for every engine."""

    def __init__(self, model: str, window: int, chunk: int, page_size: int, max_windows: int | None):
        from bench import kv_accuracy as ka
        from nfjax.checkpoint.models import resolve
        from nfjax.engine.engine import TINY_MODEL
        from nfjax.tokenizer import load_tokenizer
        self.path = resolve(ka.MODELS[model]) or TINY_MODEL
        self.tok = load_tokenizer(self.path)
        ids = self.tok.encode(open(ka.TEXT, encoding="utf-8").read(), add_special_tokens=False)
        wins = ka.windows(ids, window)[:max_windows]
        s, w = wins.shape
        if w % chunk:
            wins, w = wins[:, :w - w % chunk], w - w % chunk
        self.wins, self.s, self.w, self.chunk, self.page_size = wins, s, w, chunk, page_size
        self.per_seq = -(-w // page_size)
        self.overrides = {"cache": {"page_size": page_size, "num_pages": s * self.per_seq + 1,
                                    "max_pages_per_seq": self.per_seq},
                          "batcher": {"token_buckets": [s * chunk], "max_seqs": s}}
        self.pages = [list(range(1 + i * self.per_seq, 1 + (i + 1) * self.per_seq)) for i in range(s)]

    def calib_windows(self, text_path: str) -> np.ndarray:
        """--calib-text cut to the held-out windows' shape (repeated if short)."""
        ids = self.tok.encode(open(text_path, encoding="utf-8").read(), add_special_tokens=False)
        need = self.s * self.w
        ids = (ids * (-(-need // len(ids))))[:need]
        return np.asarray(ids, np.int32).reshape(self.s, self.w)

    def engine(self, kv_dtype: str, dtype: str):
        from nfjax.engine.builder import build_engine
        return build_engine(self.path, {**self.overrides, "cache": {**self.overrides["cache"], "kv_dtype": kv_dtype}},
                            dtype=dtype)

    def steps(self, wins):
        """(metadata, tokens, targets, positions) of each step."""
        import jax.numpy as jnp
        from nfjax.kv.metadata import build_metadata
        s, w, chunk = self.s, self.w, self.chunk
        for j in range(0, w, chunk):
            meta = build_metadata([(self.pages[i], j, chunk) for i in range(s)], s * chunk, s, self.per_seq,
                                  self.page_size, num_decode=s if chunk == 1 else 0).to_device()
            pos = np.arange(j, j + chunk)
            yield (meta, jnp.asarray(wins[:, j:j + chunk].reshape(-1)),
                   jnp.asarray(wins[:, np.minimum(pos + 1, w - 1)].reshape(-1)), pos)


def run_base(setup: Setup, dtype: str, calib_text: str | None):
    """The baseline's logits of every step (and, with calib_text, K's mean per layer, kv head and channel over the
    baseline's cache after a pass over that text)."""
    from bench.kv_accuracy import make_forward
    e = setup.engine("bfloat16", dtype)
    fwd, kv = make_forward(e.runner), e.runner.kv
    mean = None
    if calib_text:
        for meta, tokens, _, _ in setup.steps(setup.calib_windows(calib_text)):
            _, kv = fwd(kv, tokens, meta)
        k = np.asarray(kv.k.astype("float32"))                     # [L, N, PS, KH, D]
        used = np.concatenate([np.asarray(p) for p in setup.pages])
        kk = k[:, used].reshape(k.shape[0], -1, *k.shape[3:])       # [L, s * per_seq * PS, KH, D]
        slot = np.concatenate([np.arange(setup.per_seq * setup.page_size)] * setup.s)
        kw = kk[:, slot < setup.w]                                  # written positions only
        mean = (kw.mean(1), np.maximum(kw.std(1), 1e-6))
    logits = []
    for meta, tokens, _, _ in setup.steps(setup.wins):
        lg, kv = fwd(kv, tokens, meta)
        logits.append(np.asarray(lg.astype("float32")))
    return logits, mean


MARGINS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, math.inf)        # baseline top-1 - top-2 logit gap buckets


def run_variant(setup: Setup, base_logits, parts: dict, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp
    from bench.kv_accuracy import _metrics, make_forward
    if "real" in parts:
        SPEC.update(on=False, k=None, v=None)
        e = setup.engine(parts["real"], dtype)
    elif "model" in parts:
        SPEC.update(on=False, k=None, v=None)
        e = setup.engine("bfloat16", parts["model"])
    else:
        SPEC.update(on=True, k=parts["k"], v=parts["v"], rt=parts.get("rt", False), traced=0)
        e = setup.engine("fp8", dtype)
    fwd, kv = make_forward(e.runner), e.runner.kv
    metric = _metrics()

    @jax.jit
    def margin(ref):
        top2 = jax.lax.top_k(ref, 2)[0]
        return top2[:, 0] - top2[:, 1]
    s, chunk, w = setup.s, setup.chunk, setup.w
    nll_sum = agree = kl_sum = count = 0.0
    buckets = np.zeros((len(MARGINS) - 1, 2))                     # [positions, disagreements] per margin bucket
    t0 = time.perf_counter()
    for n, (meta, tokens, targets, pos) in enumerate(setup.steps(setup.wins)):
        lg, kv = fwd(kv, tokens, meta)
        if n == 0 and "k" in parts and not SPEC["traced"]:
            raise SystemExit("the fake attention was not traced into this engine (a cached trace?)")
        ref = jnp.asarray(base_logits[n])
        nll, arg, kl = (np.asarray(a).reshape(s, chunk) for a in metric(ref, lg.astype(jnp.float32), targets))
        ref_arg = np.asarray(jnp.argmax(ref, -1)).reshape(s, chunk)
        mg = np.asarray(margin(ref)).reshape(s, chunk)
        keep = pos < w - 1
        nll_sum += nll[:, keep].sum()
        agree += (arg == ref_arg)[:, keep].sum()
        kl_sum += kl[:, keep].sum()
        count += s * keep.sum()
        b = np.digitize(mg[:, keep], MARGINS[1:-1])
        np.add.at(buckets, (b, 0), 1)
        np.add.at(buckets, (b, 1), (arg != ref_arg)[:, keep])
    return {"nll": nll_sum / count, "top1_agree": agree / count, "kl_mean": kl_sum / count, "predicted": int(count),
            "flips_by_margin": {f"[{MARGINS[i]},{MARGINS[i + 1]})": [int(buckets[i, 0]), int(buckets[i, 1])]
                                for i in range(len(MARGINS) - 1)},
            "seconds": round(time.perf_counter() - t0, 1)}


def parse_variant(variant: str) -> dict:
    out = {}
    for part in variant.split(","):
        who, how = part.split(":")
        if who in ("real", "model"):
            out[who] = how
        elif who == "rt":
            if how not in ("bf16", "o"):
                raise SystemExit(f"variant part {part!r}: rt:bf16 (queries and outputs) or rt:o (outputs only)")
            out[who] = how
        elif who in ("k", "v"):
            out[who] = parse_scheme(how)
        else:
            raise SystemExit(f"variant part {part!r}: want k:SCHEME, v:SCHEME, real:FORMAT or model:DTYPE")
    if not ({"k", "v"} == set(out) - {"rt"} or set(out) in ({"real"}, {"model"})):
        raise SystemExit(f"variant {variant!r}: name k and v, or real, or model")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--windows", type=int, default=2, help="the first N windows of the held-out text")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--base-dtype", default="bfloat16", help="weights of the baseline and variant engines")
    ap.add_argument("--calib-text", default=os.path.join(os.path.dirname(__file__), "..", "..", "docs", "design.md"),
                    help="text for the cal+ schemes' K means (not the held-out text)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--name", default=None, help="write bench/results/<name>-<date>.json (else print only)")
    args = ap.parse_args()
    global CAL_MEAN
    parts = [parse_variant(v) for v in args.variants]
    install()
    setup = Setup(args.model, args.window, args.chunk, args.page_size, args.windows)
    need_cal = any(p.get(x, {}) and p[x]["kind"] in ("cal", "calfp8") for p in parts for x in ("k", "v"))
    t0 = time.perf_counter()
    base_logits, CAL_MEAN = run_base(setup, args.base_dtype, args.calib_text if need_cal else None)
    base_nll = None
    results = {}
    for variant, p in zip(args.variants, parts):
        r = run_variant(setup, base_logits, p, args.base_dtype)
        if base_nll is None:
            base_nll = _base_nll(setup, base_logits)
        d = _head_dim(setup)
        r.update(variant=variant, model=args.model, windows=setup.s, base_dtype=args.base_dtype,
                 ppl_delta_pct=100.0 * (math.exp(r["nll"] - base_nll) - 1.0),
                 bits_k=bits(p.get("k"), d), bits_v=bits(p.get("v"), d),
                 bits_k_d128=bits(p.get("k"), 128), bits_v_d128=bits(p.get("v"), 128))
        if "k" not in p:
            r["bits_k"] = r["bits_v"] = r["bits_k_d128"] = r["bits_v_d128"] = None
        else:
            r["bits_avg"] = (r["bits_k"] + r["bits_v"]) / 2
        results[variant] = r
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                          if k != "flips_by_margin"}), flush=True)
        if args.name:
            _write(args, setup, results, base_nll, time.perf_counter() - t0)


_HEAD_DIM = {}


def _head_dim(setup: Setup) -> int:
    if "d" not in _HEAD_DIM:
        from nfjax.checkpoint.orbax_io import load_config
        _HEAD_DIM["d"] = load_config(setup.path).head_dim
    return _HEAD_DIM["d"]


def _base_nll(setup: Setup, base_logits) -> float:
    """The baseline's mean NLL of the next true token (kv_accuracy's positions)."""
    import jax
    import jax.numpy as jnp
    f = jax.jit(lambda lg, t: -jnp.take_along_axis(jax.nn.log_softmax(lg, -1), t[:, None], -1)[:, 0])
    tot = cnt = 0.0
    for lg, (_, _, targets, pos) in zip(base_logits, setup.steps(setup.wins)):
        nll = np.asarray(f(jnp.asarray(lg), targets)).reshape(setup.s, setup.chunk)
        keep = pos < setup.w - 1
        tot += nll[:, keep].sum()
        cnt += setup.s * keep.sum()
    return tot / cnt


def _write(args, setup: Setup, results: dict, base_nll: float, secs: float) -> None:
    from bench.common import write_results
    summary = {"base_ppl": round(math.exp(base_nll), 5), "windows": setup.s, "base_dtype": args.base_dtype}
    for v, r in results.items():
        summary[f"ppl_delta_pct[{v}]"] = round(r["ppl_delta_pct"], 4)
        summary[f"top1_agree[{v}]"] = round(r["top1_agree"], 5)
    write_results(args.name, summary, {"args": vars(args), "results": results, "seconds": secs,
                                       "window_tokens": setup.w})


if __name__ == "__main__":
    main()
