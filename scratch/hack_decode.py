# Throwaway: timing potential of MXFP4 sparse decode without the per-(head, group) query scale multiply (inexact).
import os, sys
import torch
sys.path.insert(0, "benchmarks")
import common
import suite_scoring as ss
from torch_sparse_indexer import testing
from torch_sparse_indexer.kernels import triton_scoring as ts
fn, out = ss.decode_call("sparse", "mxfp4", 128, 131072, 2048)
fn(); torch.cuda.synchronize(); base = out.clone()
for name, ov in [("default", {}), ("hack", {"hack": True}), ("hack ctas3", {"hack": True, "rows": (64, 4, 3, 64, False, True, None, 3)}),
                 ("hack r128 ctas4", {"hack": True, "rows": (64, 4, 3, 64, False, True, 128, 4)}),
                 ("hack 4stages ctas3", {"hack": True, "rows": (64, 4, 4, 64, False, True, None, 3)}),
                 ("default again", {})]:
    ts.CONFIG_OVERRIDES.clear(); ts.CONFIG_OVERRIDES.update(ov)
    fn(); torch.cuda.synchronize()
    d = testing.calc_diff(out, base)
    print(name, "time_us", round(common.time_us(fn), 1), "calc_diff vs default", d, flush=True)
