"""Per-phase cycle counts of the top-k kernels' block 0 (development; needs a library built with
``-DTSI_PHASE_TIMING``, given as TORCH_SPARSE_INDEXER_TOPK_LIB). Prints, per shape, the cycles between the
recorded points (sampled mode: 0 start, 1 sample loaded, 2 threshold, 3 pass done, 4 exact threshold, 5 output;
shared-memory mode: 10 start, 11 row loaded + histogram, 12 coarse bin, 13 exact threshold, 14 output).
Usage: python scripts/phase_topk.py  (on the GPU machine)."""
import ctypes

import torch

from torch_sparse_indexer.kernels import cuda_topk as ct

SHAPES = [(1, 131072), (64, 131072), (128, 131072), (4096, 131072), (4096, 16384)]
ct.set_cluster_mode("off")
lib = ct._LIB.lib
lib.tsi_topk_phase_cycles.argtypes = [ctypes.c_void_p]
g = torch.Generator().manual_seed(0)
for R, W in SHAPES:
    x = torch.randn(R, W, generator=g).cuda()
    lens = torch.full((R,), W, dtype=torch.int32, device="cuda")
    out = torch.empty(R, 2048, dtype=torch.int32, device="cuda")
    buf = (ctypes.c_ulonglong * 32)()
    for _ in range(3):
        lib.tsi_topk_phase_cycles(ctypes.addressof(buf))  # clears the previous launch's points
        ct.topk(x, lens, 2048, out)
        torch.cuda.synchronize()
    rc = lib.tsi_topk_phase_cycles(ctypes.addressof(buf))
    v = list(buf)
    pts = [i for i in range(32) if v[i]]
    steps = [f"{a}->{b}: {(v[b] - v[a]) / 1980:.1f} us" for a, b in zip(pts, pts[1:]) if v[b] >= v[a]]
    print(f"{R}x{W}: rc={rc} points={pts} " + ", ".join(steps), flush=True)
    torch.cuda.synchronize()
