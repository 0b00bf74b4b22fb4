"""Profiling driver for the top-k kernels (run under ncu): one launch per case after a warm-up."""
import sys

import torch

from torch_sparse_indexer.kernels import cuda_topk as ct

R = int(sys.argv[1]) if len(sys.argv) > 1 else 1
W = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
sampled = (sys.argv[3] if len(sys.argv) > 3 else "1") == "1"
ct.set_cluster_mode("off")
ct.set_sampled(sampled)
g = torch.Generator().manual_seed(0)
x = torch.randn(R, W, generator=g).cuda()
lens = torch.full((R,), W, dtype=torch.int32, device="cuda")
out = torch.empty(R, 2048, dtype=torch.int32, device="cuda")
for _ in range(3):
    ct.topk(x, lens, 2048, out)
torch.cuda.synchronize()
