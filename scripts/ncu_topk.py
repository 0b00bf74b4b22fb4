"""One warm-up launch, then one launch of the top-k kernel per shape, for Nsight Compute (development):
    ncu --clock-control none --set full -k regex:topk_kernel --launch-skip 1 --launch-count 1 \
        python3 scripts/ncu_topk.py dense 4096 16384
Shapes: ``dense R W`` (topk, k = 2048) or ``sparse R NBLK`` (sparse_topk, blocks of 8, k = 2048), the inputs of
benchmarks/suite_topk.py."""
import sys

import torch

from torch_sparse_indexer.kernels import cuda_topk as ct

kind, R, W = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ct.set_cluster_mode("off")
g = torch.Generator().manual_seed(0)
out = torch.empty(R, 2048, dtype=torch.int32, device="cuda")
if kind == "dense":
    x = torch.randn(R, W, generator=g).cuda()
    lens = torch.full((R,), W, dtype=torch.int32, device="cuda")
    run = lambda: ct.topk(x, lens, 2048, out)  # noqa: E731
else:
    x = torch.randn(R, W * 8, generator=g).cuda()
    blocks = torch.sort(torch.randperm(16 * W, generator=g)[:W]).values.to(torch.int32)
    blocks = blocks[None].expand(R, W).contiguous().cuda()
    lens = torch.full((R,), 16 * W * 8, dtype=torch.int32, device="cuda")
    run = lambda: ct.sparse_topk(x, blocks, 8, lens, 2048, out)  # noqa: E731
for _ in range(2):
    run()
torch.cuda.synchronize()
