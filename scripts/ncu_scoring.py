"""Warm-up launches, then one launch of a decode scoring kernel, for Nsight Compute (development):
    ncu --clock-control none --set full -k regex:_rows_kernel --launch-skip 2 --launch-count 1 \
        python3 scripts/ncu_scoring.py sparse fp8
``sparse|dense`` x ``fp8|mxfp4`` [``triton|cuda``; the CUDA kernels: ``-k regex:decode_kernel``]: the target shapes of benchmarks/suite_scoring.py (128 decode rows, context
128K, page 64; sparse: 2048 candidate blocks of 8), built by that suite's own helpers."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import suite_scoring as ss  # noqa: E402

run, _ = ss.decode_call(sys.argv[1], sys.argv[2], impl=sys.argv[3] if len(sys.argv) > 3 else "triton")
for _ in range(3):
    run()
torch.cuda.synchronize()
