"""CUDA decode scoring kernels on the GPU: a quick check against the reference, then CUDA (every prefetch depth
and some program sizes) vs Triton at the decode target shapes in the same process on the same inputs; CSV to
``$OUT/cuda_decode.csv``."""
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402
import suite_scoring as ss  # noqa: E402

from torch_sparse_indexer import reference, testing  # noqa: E402
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

rows = []
B, ctx, nbk = 128, 131072, 2048
for fmt in ("fp8", "mxfp4"):
    cache, bt, lens, qs = ss._decode_setup(B, ctx, fmt)
    cand = ss._cands(B, ctx // 8, nbk)
    kb = B * nbk * 8 * (132 if fmt == "fp8" else 68)
    o_t = torch.empty(B, nbk * 8, device="cuda")
    o_c = torch.empty_like(o_t)
    ft = lambda: ts.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand, 8, o_t)  # noqa
    fc = lambda: cs.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand, 8, o_c)  # noqa
    ft()
    fc()
    torch.cuda.synchronize()
    diff = testing.calc_diff(o_c, o_t)
    tt = common.time_us(ft, graph=True, rep_ms=200)
    rows.append(dict(op="sparse", fmt=fmt, impl="triton", time_us=tt, floor_us=kb / 4.27e6, diff=""))
    print(rows[-1], flush=True)
    base = o_c.clone()
    for depth, tiles in [(0, None), (0, 32), (3, None), (4, None), (6, None)]:
        cs.set_depth(depth)
        if tiles:
            cs.CONFIG_OVERRIDES["row_tiles"] = tiles
        fc()
        torch.cuda.synchronize()
        same = bool(torch.equal(o_c, base))
        tc = common.time_us(fc, graph=True, rep_ms=200)
        rows.append(dict(op="sparse", fmt=fmt, impl=f"cuda depth{depth} tiles{tiles}", time_us=tc,
                         floor_us=kb / 4.27e6, diff=f"{diff:.2e} bitwise_same={same}"))
        print(rows[-1], flush=True)
        cs.CONFIG_OVERRIDES.pop("row_tiles", None)
    cs.set_depth(0)
    del o_t, o_c
    od_t = torch.empty(B, ctx, device="cuda")
    od_c = torch.empty_like(od_t)
    fdt = lambda: ts.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, od_t)  # noqa
    fdc = lambda: cs.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, od_c)  # noqa
    fdt()
    fdc()
    torch.cuda.synchronize()
    diff = testing.calc_diff(od_c, od_t)
    db = B * ctx * (132 if fmt == "fp8" else 68)
    for impl, f in (("triton", fdt), ("cuda", fdc)):
        t = common.time_us(f, graph=True, rep_ms=200)
        rows.append(dict(op="dense", fmt=fmt, impl=impl, time_us=t, floor_us=db / 4.27e6, diff=f"{diff:.2e}"))
        print(rows[-1], flush=True)
    for depth in (3, 4, 6):
        cs.set_depth(depth)
        t = common.time_us(fdc, graph=True, rep_ms=200)
        rows.append(dict(op="dense", fmt=fmt, impl=f"cuda depth{depth}", time_us=t,
                         floor_us=db / 4.27e6, diff=""))
        print(rows[-1], flush=True)
    cs.set_depth(0)
    del od_t, od_c, cache
    torch.cuda.empty_cache()
with open(os.path.join(out_dir, "cuda_decode.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerows(rows)
