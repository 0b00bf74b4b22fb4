"""Developer tool: run ``examples/two_level_indexer.py`` on the CPU through the GPU kernels' own logic, the
Triton scoring/cache kernels under triton's interpreter and the CUDA top-k through its CPU emulation build,
so a GPU-only disagreement can be split into "kernel logic" (reproduces here) and "device, compile or graph
capture" (does not). Slow (minutes for the example's default sizes); logic only, not numerics of the GPU.

    bash csrc/emu/build_emu.sh /tmp/emu.so
    TSI_TOPK_EMU=/tmp/emu.so python scripts/emulated_gpu_example.py [example flags, e.g. --no-compile]

Needs triton installed (any version whose interpreter runs the kernels; 3.9 did, 3.6's did not).
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from torch_sparse_indexer.kernels import cuda_topk as ct  # noqa: E402
from torch_sparse_indexer.kernels import triton_cache as tc  # noqa: E402
from torch_sparse_indexer.kernels import triton_scoring as ts  # noqa: E402


def _register_for_cpu():
    # The backends decline CPU tensors in their support checks; accept them here (and nothing else changes).
    ts._common_supports = lambda q, tensors: None
    for name in ("_supports_write", "_supports_gather", "_supports_quantize_q"):
        setattr(tc, name, lambda *a: None)
    ct.load(os.environ["TSI_TOPK_EMU"])
    ct._common_reason = lambda logits, kk: (None if logits.dtype in ct._DTYPE_CODE and kk <= ct.max_k()
                                            else "dtype or k")
    ts.register()
    tc.register()
    ct.register()


if __name__ == "__main__":
    _register_for_cpu()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import two_level_indexer

    raise SystemExit(two_level_indexer.main(sys.argv[1:]))
