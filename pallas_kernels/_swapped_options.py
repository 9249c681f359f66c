"""The swapped decode kernel's options (paged_decode_swapped.py): the measured defaults, and one resolver of a call's
options that the kernel and the fused attention + GEMM kernel (attention_beside_gemm.py) both use."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._compat import num_sms
from pallas_kernels._kv_dequant import cache_format

# A quantized cache's dequantizing warpgroups when a call names none, per format: None = 2 over an even number of
# stages, else 1; 0 = the consumer dequantizes (the first version). H100, decode at 4k context, batch 64 / 256, of
# the copy rate on the bytes read (attention_kv-v2-20261124.json against attention_kv-v1): int4 0.24 / 0.29 with
# two dequantizers against 0.16 / 0.17 in the consumer. fp8 depends on the batch (kv_fp8_wgs-repeat-20261125.json,
# three repeats in one process): one dequantizer 1.03-1.05 ms against the consumer's 1.33-1.38 at batch 256, but
# 0.80-1.11 against 0.53-0.58 at batch 64 (not understood); so fp8 takes one from FP8_DEQUANT_MIN_WORK work items
# (sequences x KV heads; batch 256 at 8 KV heads) and the consumer's path below. int8 (not measured yet) takes int4's
# choice: its dequantizing is int4's integer ops and FMA, a group at a time; its stages (fp8's size) fit two deep.
DEQUANT_WGS: dict[str, int | None] = {"fp8": 0, "int8": None, "int4": None}
FP8_DEQUANT_MIN_WORK = 2048


# K dequantized by the consumer into wgmma's register operand (the dequantizers do V alone), for the formats whose
# two dequantizers bound the kernel: batch 256, 4k context, 16-position pages on an H200, best of two, int8 1.45 ->
# 1.11 ms (4 stages; 1.16 at 2), int4 1.43 -> 1.24; fp8 0.93 -> 1.00 (its one dequantizer is not the bound). Reading
# the page ids before the stage wait: fp8 0.93 -> 0.91, int8 1.45 -> 1.42 (bench/results/dequant_kic-20261128.json).
K_IN_CONSUMER = ("int8", "int4")
# fp8's K read by fp8 wgmmas against the query's two e4m3 parts, undequantized (`attention_kernel`'s fp8_mma), with
# one dequantizer for V: H200, context 1,280, kernel ms against the dequantizing path's default, batch 64 0.074 vs
# 0.109, batch 256 0.256 vs 0.288 (0.69 of copy against 0.61), error against the reference 0.0029 vs 0.0054 /
# 0.0019 (bench/results/fp8mma-fix-20261129.json); fp8 at 1024/512 end to end 24,755 tok/s against 23,202.
FP8_MMA = True
# int8's K codes read by int8 wgmmas against the query's int8 parts (`attention_kernel`'s int8_mma), V by two
# dequantizers: H200, context 1,280, kernel ms against K dequantized in the consumer, batch 256 0.279 vs 0.356 (0.63
# of copy against 0.49), batch 64 0.078 vs 0.099; error against the reference 0.0018 vs 0.0017 (one dequantizer:
# 0.296 / 0.083; bench/results/int8mma-20261129.json).
INT8_MMA = True
# int4's K codes the same way, unpacked into int8 registers (head_dim 128: int8 register operands need 64-byte
# swizzled query tiles), V by two dequantizers: H200, context 4,096, kernel ms against K dequantized in the consumer,
# batch 256 0.757 vs 1.187 (0.39 of copy against 0.25), batch 64 0.204 vs 0.305 (one dequantizer: 0.866 / 0.228);
# error against the reference unchanged, 0.0017 (bench/results/int4mma-20261129.json).
INT4_MMA = True
INT8_MMA_FORMATS = ("int8", "int4")
# int4's two score wgmmas (one a half of D, a group each) into two accumulators against the query's parts without
# zero blocks (`attention_kernel`'s `group_accs`): half the query's int8 bytes and half the score wgmmas' columns,
# but slower: H200, 4k context, pages of 16, kernel ms 0.748 -> 1.00 at batch 256, 0.199 -> 0.260 at batch 64
# (three repeats alike; bench/results/dequant_sass-group_accs-20261130.json). Kept for comparison, off.
GROUP_ACCS = False
# Each block's score wgmmas issued behind the block before's P V^T (`attention_kernel`'s `pipeline`), off: H200,
# batch 256, 4k context, kernel ms shipped -> pipelined, pages of 16: int4 0.755 -> 1.01, int8 0.779 -> 0.777, fp8
# 0.684 -> 0.677, bf16 (wgmma row sums) 0.968 -> 1.13; pages of 64 the same standing (int4 0.733 -> 0.977, fp8
# 0.632 -> 0.624); batch 64 no better (bench/results/pipe16-, pipe64-20261129.json).
PIPELINE = False


def default_dequant_wgs(fmt: str, work_items: int) -> int | None:
    """The dequantizing warpgroups of a call that names none (see DEQUANT_WGS)."""
    if fmt == "fp8" and work_items >= FP8_DEQUANT_MIN_WORK:
        return 1
    return DEQUANT_WGS.get(fmt)



@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How `attention_kernel` reads a cache, resolved from a call's options (None: the defaults above)."""
    fmt: str
    num_stages: int
    row_sums: str
    dequant_wgs: int
    prefetch_pages: bool
    k_in_consumer: bool
    fp8_mma: bool
    int8_mma: bool
    pipeline: bool
    group_accs: bool = False

    @property
    def query_parts(self) -> bool:
        """The query goes in as parts with their scales, one more input after the cache's (`prepare`)."""
        return self.fp8_mma or self.int8_mma

    def prepare_kwargs(self) -> dict:
        return dict(num_stages=self.num_stages, dequant_wgs=self.dequant_wgs, k_in_consumer=self.k_in_consumer,
                    fp8_mma=self.fp8_mma, int8_mma=self.int8_mma, group_accs=self.group_accs)

    def kernel_kwargs(self) -> dict:
        return dict(row_sums=self.row_sums, kv_format=self.fmt, dequant_wgs=self.dequant_wgs,
                    prefetch_pages=self.prefetch_pages, k_in_consumer=self.k_in_consumer, fp8_mma=self.fp8_mma,
                    int8_mma=self.int8_mma, pipeline=self.pipeline, group_accs=self.group_accs)


def kernel_options(q, k_cache, aux_cache, *, num_ctas: int, num_stages: int | None = None,
                   row_sums: str | None = None, dequant_wgs: int | None = None,
                   prefetch_pages: bool | None = None, k_in_consumer: bool | None = None,
                   fp8_mma: bool | None = None, int8_mma: bool | None = None,
                   pipeline: bool | None = None, group_accs: bool | None = None) -> KernelOptions:
    """`paged_decode_attention_swapped`'s options resolved (its docstring), for it and for the fused kernel that
    runs `attention_kernel` beside a GEMM (attention_beside_gemm.py)."""
    share = num_ctas <= 0.6 * num_sms()
    fmt = cache_format(k_cache, aux_cache)
    lets_kernel_choose = dequant_wgs != 0 and k_in_consumer is not False
    if fp8_mma is None:             # the default where the call leaves the dequantizing to the kernel
        fp8_mma = FP8_MMA and fmt == "fp8" and lets_kernel_choose
    if int8_mma is None:
        int8_mma = lets_kernel_choose and ((INT8_MMA and fmt == "int8") or (INT4_MMA and fmt == "int4"
                                                                           and q.shape[2] == 128))
    for name, on, want in (("fp8_mma", fp8_mma, ("fp8",)), ("int8_mma", int8_mma, INT8_MMA_FORMATS)):
        if on and (fmt not in want or not lets_kernel_choose):
            raise ValueError(f"{name} reads an {' or '.join(want)} cache with dequantizers for V and K in the "
                             f"consumer; got {fmt}, dequant_wgs={dequant_wgs}, k_in_consumer={k_in_consumer}")
    if int8_mma and fmt == "int4" and q.shape[2] != 128:
        raise ValueError(f"int8_mma on an int4 cache needs head_dim 128 (int8 register operands take 64-byte "
                         f"swizzled query tiles), got {q.shape[2]}")
    if group_accs is None:
        group_accs = GROUP_ACCS and int8_mma and fmt == "int4"
    if group_accs and not (int8_mma and fmt == "int4"):
        raise ValueError(f"group_accs splits int4's int8 score wgmmas by group: it needs int8_mma on an int4 cache, "
                         f"got {fmt} with int8_mma={int8_mma}")
    if fp8_mma or int8_mma:
        k_in_consumer = True
        # fp8's V takes one dequantizer; int8's and int4's two (int8mma-, int4mma-20261129.json) where the stages
        # pair up, so theirs is left to the stage count below
        dequant_wgs = dequant_wgs or (1 if fp8_mma else None)
    nd = default_dequant_wgs(fmt, q.shape[0] * k_cache.shape[3]) if dequant_wgs is None else dequant_wgs
    beside = aux_cache is not None and nd != 0
    if k_in_consumer is None:
        k_in_consumer = beside and fmt in K_IN_CONSUMER
    if prefetch_pages is None:
        prefetch_pages = aux_cache is not None
    if num_stages is None:
        # dequantizers: the f16 tiles take 128 KB of SMEM (64 KB with K in the consumer); int4's stages (18 KB at
        # head_dim 128) fit four deep
        num_stages = (4 if k_cache.dtype == jnp.uint8 or k_in_consumer else 2) if beside else 3 if share else 2
    if aux_cache is None:
        nd = 0
    elif nd is None:
        nd = 2 if num_stages % 2 == 0 else 1
    if row_sums is None:
        # with K read by wgmmas the consumer's chain bounds the rate on all SMs too (a fixed ~0.5 us a block, from
        # block_kv 64 against 128): fp8 at batch 256, context 1,280, H200, 0.254 -> 0.242 ms with the wgmma sums
        # (bench/results/fp8knobs-20261129.json)
        row_sums = "wgmma" if share or fp8_mma or int8_mma else "reduce"
    if pipeline is None:            # where `attention_kernel` takes it (its docstring)
        pipeline = PIPELINE and row_sums == "wgmma" and (nd == 0 or fmt == "bfloat16" or bool(k_in_consumer))
    return KernelOptions(fmt, num_stages, row_sums, nd, bool(prefetch_pages), bool(k_in_consumer), bool(fp8_mma),
                         bool(int8_mma), bool(pipeline), bool(group_accs))
