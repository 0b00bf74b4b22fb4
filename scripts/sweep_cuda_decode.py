"""CUDA decode scoring kernels on the GPU (development): a check against the reference at a small shape, then
CUDA (each prefetch depth of the default build, and each library build given on the command line, e.g. a
``-DTSI_SCORING_MIN_BLOCKS=5`` variant) vs Triton at the decode target shapes (128 rows, context 128K, page 64;
sparse: 2048 candidate blocks of 8), in one process on the same inputs, outputs compared bitwise with the default
build's (the ablation builds of ``benchmarks/variants/scoring/ablate_*.flags`` differ on purpose), with each build's
CTAs per SM. CSV to ``$OUT/cuda_decode.csv``.
    python3 scripts/sweep_cuda_decode.py [variant.so ...]"""
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402
import suite_scoring as ss  # noqa: E402

from torch_sparse_indexer import reference, testing  # noqa: E402
from torch_sparse_indexer.kernels import _cudalib  # noqa: E402
from torch_sparse_indexer.kernels import cuda_scoring as cs  # noqa: E402
from torch_sparse_indexer.kernels import triton_scoring as ts  # noqa: E402

out_dir = os.environ.get("OUT", "/tmp")
print("available", cs.available(), cs._LIB.load_error)
res = []
for fmt in ("fp8", "mxfp4"):
    for sparse in (True, False):
        cache, bt, lens, qs = ss._decode_setup(4, 4096, fmt)
        cand = ss._cands(4, 4096 // 8, 64)
        L = 64 * 8 if sparse else 4096
        out = torch.full((4, L), float("nan"), device="cuda")
        ref = torch.empty_like(out)
        if sparse:
            cs.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand, 8, out)
            reference.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand, 8, ref)
        else:
            cs.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, out)
            reference.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, ref)
        torch.cuda.synchronize()
        res.append(testing.calc_diff(out, ref) if not torch.isnan(out).any() else float("nan"))
print(f"calc_diff vs reference: fp8 sparse/dense, mxfp4 sparse/dense = {res}", flush=True)

# Depths for the other builds (their default only, unless SWEEP_DEPTHS="0,3,6": e.g. whether the copies-only
# ablation follows the tiles in flight, i.e. is bound by latency x depth rather than by the memory system).
variant_depths = tuple(int(d) for d in os.environ.get("SWEEP_DEPTHS", "0").split(","))
libs = [("default", cs._LIB)] + [(os.path.basename(p), _cudalib.Library(os.path.basename(p), "-", cs._declare))
                                 for p in sys.argv[1:]]
for (name, lib), path in zip(libs[1:], sys.argv[1:]):
    lib.load(path)
rows = []
B, ctx, nbk = 128, 131072, 2048
for fmt in ("fp8", "mxfp4"):
    cache, bt, lens, qs = ss._decode_setup(B, ctx, fmt)
    cand = ss._cands(B, ctx // 8, nbk)
    bpt = 132 if fmt == "fp8" else 68
    for kind in ("sparse", "dense"):
        L = nbk * 8 if kind == "sparse" else ctx
        nbytes = B * L * bpt
        o_t = torch.empty(B, L, device="cuda")
        o_c = torch.empty_like(o_t)
        if kind == "sparse":
            ft = lambda: ts.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand, 8, o_t)  # noqa
            fc = lambda: cs.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand, 8, o_c)  # noqa
        else:
            ft = lambda: ts.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, o_t)  # noqa
            fc = lambda: cs.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, o_c)  # noqa
        ft()
        torch.cuda.synchronize()
        rows.append(dict(op=kind, fmt=fmt, impl="triton", time_us=common.time_us(ft, graph=True, rep_ms=200),
                         floor_us=nbytes / 4.27e6, check="", ctas_per_sm=""))
        print(rows[-1], flush=True)
        base = None
        for name, lib in libs:
            cs._LIB = lib
            for depth in (0, 3, 4, 6) if name == "default" else variant_depths:
                cs.set_depth(depth)
                fc()
                torch.cuda.synchronize()
                if base is None:
                    base = o_c.clone()
                    check = f"diff_vs_triton={testing.calc_diff(o_c, o_t):.2e}"
                else:
                    check = f"bitwise_same={bool(torch.equal(o_c, base))}"
                ctas = lib.lib.tsi_scoring_ctas_per_sm(128, int(fmt == "mxfp4"), 64, int(kind == "sparse"))
                rows.append(dict(op=kind, fmt=fmt, impl=f"cuda {name} depth{depth}",
                                 time_us=common.time_us(fc, graph=True, rep_ms=200), floor_us=nbytes / 4.27e6,
                                 check=check, ctas_per_sm=ctas))
                print(rows[-1], flush=True)
            cs.set_depth(0)
        cs._LIB = libs[0][1]
        cs._ctas_per_sm.cache_clear()
        del o_t, o_c
    del cache
    torch.cuda.empty_cache()
with open(os.path.join(out_dir, "cuda_decode.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerows(rows)
