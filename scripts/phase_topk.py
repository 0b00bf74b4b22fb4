"""Per-phase cycle counts of the top-k kernels' block 0, and the spread of all CTAs' start and end times
(development; needs a library built with ``-DTSI_PHASE_TIMING``, given as TORCH_SPARSE_INDEXER_TOPK_LIB).
Prints, per shape, the cycles between the recorded points (sampled mode: 0 start, 1 sample loaded,
2 threshold, 3 pass done, 4 exact threshold, 5 selection marked in the bitmaps, 6 output; shared-memory mode:
10 start, 11 row loaded + histogram, 12 coarse bin, 13 exact threshold, 15 selection staged (bitmap path),
14 output written (sparse_topk rows: positions from the candidate ids and the order check); inside phases: 20 buffer
histogram, 21 its bin, 22 warp_select's gather, 23-25 sample_tau's steps, 26 the three-CTA kernel's gather of the
threshold bin's keys from L2), in time order, then from %globaltimer:
the kernel's span (first CTA start to last CTA end), the spread of CTA starts, and CTA durations
(median, max). L2 is flushed before each launch. Every shape runs with the wide CTAs off; decode shapes (fewer rows
than 2 x SMs) once more on them (``cuda_topk.set_wide_mode("always")``), labelled ``wide``; 16K and sparse shapes
once more on the three-CTA kernel (``cuda_topk.set_tri_mode("always")``), labelled ``tri``; PHASE_SMEM_ONLY=1:
only 4096 x 16K and the sparse shape, default kernels. Usage: python
scripts/phase_topk.py  (on the GPU machine)."""
import ctypes
import os
import statistics

import torch

from torch_sparse_indexer.kernels import cuda_topk as ct

SHAPES = [(1, 131072), (64, 131072), (128, 131072), (4096, 131072), (4096, 16384),
          ("sparse", 4096, 2048, 8)]  # sparse_topk as in the benchmark: 2048 ascending blocks of 8 per row
SMEM_ONLY = os.environ.get("PHASE_SMEM_ONLY") == "1"  # only the shared-memory rows (16K, sparse), default kernels
if SMEM_ONLY:
    SHAPES = [(4096, 16384), ("sparse", 4096, 2048, 8)]
MHZ = 1980  # SM clock of the H200 under these loads (nvidia-smi in the same run's env.txt)
ct.set_cluster_mode("off")
lib = ct._LIB.lib
lib.tsi_topk_phase_cycles.argtypes = [ctypes.c_void_p]
lib.tsi_topk_phase_spans.argtypes = [ctypes.c_void_p, ctypes.c_int]
g = torch.Generator().manual_seed(0)
scrub = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count
RUNS = [(s, "off", "off") for s in SHAPES] if SMEM_ONLY else ([(s, "off", "off") for s in SHAPES]
        + [(s, "always", "off") for s in SHAPES if s[0] != "sparse" and s[0] < 2 * SMS]
        + [(s, "off", "always") for s in SHAPES if s[0] == "sparse" or s[1] <= ct.tuning()["smem_keys"]])
for shape, wide, tri in RUNS:
    ct.set_wide_mode(wide)
    ct.set_tri_mode(tri)
    sparse = shape[0] == "sparse"
    R, W = (shape[1], shape[2] * shape[3]) if sparse else shape
    x = torch.randn(R, W, generator=g).cuda()
    lens = torch.full((R,), W, dtype=torch.int32, device="cuda")
    out = torch.empty(R, 2048, dtype=torch.int32, device="cuda")
    if sparse:
        nb, cbs = shape[2], shape[3]
        blocks = torch.sort(torch.randperm(16 * nb, generator=g)[:nb]).values.to(torch.int32)
        blocks = blocks[None].expand(R, nb).contiguous().cuda()
        lens.fill_(16 * nb * cbs)
    buf = (ctypes.c_ulonglong * 32)()
    n = min(R, 4096)
    spans = (ctypes.c_ulonglong * (2 * n))()
    for _ in range(3):
        lib.tsi_topk_phase_cycles(ctypes.addressof(buf))  # clears the previous launch's points
        lib.tsi_topk_phase_spans(ctypes.addressof(spans), n)
        scrub.zero_()  # L2 flushed, as in the benchmarks
        if sparse:
            ct.sparse_topk(x, blocks, cbs, lens, 2048, out)
        else:
            ct.topk(x, lens, 2048, out)
        torch.cuda.synchronize()
    rc = lib.tsi_topk_phase_cycles(ctypes.addressof(buf))
    rs = lib.tsi_topk_phase_spans(ctypes.addressof(spans), n)
    v = list(buf)
    pts = [i for i in range(32) if v[i]]
    pts.sort(key=lambda i: v[i])  # in time order (points inside phases have numbers >= 20)
    steps = [f"{a}->{b}: {(v[b] - v[a]) / MHZ:.2f} us" for a, b in zip(pts, pts[1:])]
    label = ("sparse " if sparse else "") + ("wide " if wide == "always" else "") + ("tri " if tri == "always" else "")
    print(f"{label}{R}x{W}: rc={rc} points={pts} " + ", ".join(steps), flush=True)
    s = list(spans)
    starts, ends = s[0::2], s[1::2]
    if rs == 0 and all(starts) and all(ends):
        t0 = min(starts)
        dur = [e - b for b, e in zip(starts, ends)]
        print(f"  spans: kernel {(max(ends) - t0) / 1e3:.1f} us, starts spread {(max(starts) - t0) / 1e3:.1f} us, "
              f"CTA median {statistics.median(dur) / 1e3:.1f} us, max {max(dur) / 1e3:.1f} us, "
              f"ends spread {(max(ends) - min(ends)) / 1e3:.1f} us", flush=True)
    torch.cuda.synchronize()
