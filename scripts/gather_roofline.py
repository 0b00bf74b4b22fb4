"""Read-only roofline of the paged sparse decode access pattern (development; no scoring):
    python3 scripts/gather_roofline.py
Reads exactly the bytes ``paged_sparse_mqa_logits`` reads at the target shape (128 rows x 2048 candidate blocks
of 8 tokens, page 64: FP8 1 KB / MXFP4 512 B of values + 32 B of scales per block, pages in random order) and
sums them with the plain load-and-sum kernel of benchmarks/suite_scoring.py (``read_same_bytes``, also a row of
that suite), then the same byte count read contiguously, with 4 and 8 warps. Times as in the benchmarks (CUDA-graph
replays, L2 flushed, median)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import suite_scoring as ss  # noqa: E402


def main():
    B, ctx, nbk = 128, 131072, 2048
    cand = ss._cands(B, ctx // ss.CBS, nbk)
    for fmt in ("fp8", "mxfp4"):
        cache, bt, lens, qs = ss._decode_setup(B, ctx, fmt)
        for name, contig in (("gathered blocks (the decode pattern)", False), ("contiguous", True)):
            for warps in (4, 8):
                fn, nbytes = ss.read_same_bytes(cache, bt, cand, contig, warps, fmt)
                t = ss._t(fn)
                print(f"{fmt:5s} {name:38s} warps {warps}: {t:7.1f} us, {nbytes / t / 1e6:5.2f} TB/s "
                      f"({nbytes / 1e6:.0f} MB; floor at 4.27 TB/s {nbytes / 4.27e6:.1f} us)", flush=True)


if __name__ == "__main__":
    main()
