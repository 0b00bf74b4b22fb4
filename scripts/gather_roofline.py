"""Read-only roofline of the paged sparse decode access pattern (development; no scoring):
    python3 scripts/gather_roofline.py
Reads exactly the bytes ``paged_sparse_mqa_logits`` reads at the target shape (128 rows x 2048 candidate blocks
of 8 tokens, FP8 cache, page 64: 1 KB of values + 32 B of scales per block, pages in random order) and sums
them, with a plain load-and-reduce Triton kernel; then the same byte count read contiguously. Times as in the
benchmarks (CUDA-graph replays, L2 flushed, median); prints both rates, so the scoring kernel's time can be
read against what this access pattern allows on this GPU rather than only against copy bandwidth."""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402
import suite_scoring as ss  # noqa: E402


@triton.jit
def _gather_sum(cache_ptr, bt_ptr, cand_ptr, out_ptr, NCAND, BT_STRIDE, PS, NB: tl.constexpr,
                CONTIG: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = chunk * NB + tl.arange(0, NB)
    w = tl.arange(0, 256)  # 1 KB of values as int32 words
    if CONTIG:
        base = (row.to(tl.int64) * NCAND + b) * 1056  # 1 KB + 32 B per block, back to back
        vals = tl.load(cache_ptr.to(tl.pointer_type(tl.int32)) + (base // 4)[:, None] + w[None, :])
        sc = tl.load(cache_ptr.to(tl.pointer_type(tl.int32)) + (base // 4 + 256)[:, None] + tl.arange(0, 8)[None, :])
    else:
        blk = tl.load(cand_ptr + row.to(tl.int64) * NCAND + b)
        page = tl.load(bt_ptr + row.to(tl.int64) * BT_STRIDE + (blk >> 3)).to(tl.int64)
        off = (blk & 7).to(tl.int64)
        vbase = (page * (PS // 16) + off * 64) * 4  # in int32 words (page stride % 16 == 0)
        vals = tl.load(cache_ptr.to(tl.pointer_type(tl.int32)) + vbase[:, None] + w[None, :])
        sbase = page * (PS // 4) + 64 * 32 + off * 8
        sc = tl.load(cache_ptr.to(tl.pointer_type(tl.int32)) + sbase[:, None] + tl.arange(0, 8)[None, :])
    tl.store(out_ptr + row * tl.num_programs(1) + chunk, tl.sum(tl.sum(vals, 1) ^ tl.sum(sc, 1), 0))


def main():
    B, ctx, nbk, NB = 128, 131072, 2048, 32
    cache, bt, lens, qs = ss._decode_setup(B, ctx, "fp8")
    cand = ss._cands(B, ctx // ss.CBS, nbk)
    out = torch.empty(B * (nbk // NB), dtype=torch.int32, device="cuda")
    flat = torch.empty(B * nbk * 1056, dtype=torch.uint8, device="cuda")
    nbytes = B * nbk * 1056
    ps = cache.stride(0)
    for name, contig in (("gathered blocks (the decode pattern)", False), ("contiguous", True)):
        src = flat if contig else cache
        for warps in (4, 8):
            fn = lambda: _gather_sum[(B, nbk // NB)](src, bt, cand, out, nbk, bt.stride(0), ps, NB=NB,  # noqa: E731
                                                     CONTIG=contig, num_warps=warps)
            t = common.time_us(fn)
            print(f"{name:38s} warps {warps}: {t:7.1f} us, {nbytes / t / 1e6:5.2f} TB/s "
                  f"({nbytes / 1e6:.0f} MB; floor at 4.27 TB/s {nbytes / 4.27e6:.1f} us)", flush=True)


if __name__ == "__main__":
    main()
