"""One warm-up launch, then one launch of the CUDA MXFP4 cache write, for Nsight Compute (development):
    ncu --clock-control none --set full -k regex:write_mxfp4 --launch-skip 1 --launch-count 1 \\
        python3 scripts/ncu_cache.py
The input of benchmarks/suite_scoring.py's write_k_cache rows: 1M bf16 tokens of D = 128 to random slots of
64-token pages."""
import torch

from torch_sparse_indexer import formats
from torch_sparse_indexer.kernels import cuda_cache as cc

T, D, PAGE = 1 << 20, 128, 64
nb = T // PAGE + 8
cache = formats.allocate_k_cache(nb, PAGE, D, "mxfp4", "cuda")
k = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
slot = torch.randperm(nb * PAGE, device="cuda")[:T]
for _ in range(2):
    cc.write_k_cache(k, slot, cache, "mxfp4", True)
torch.cuda.synchronize()
