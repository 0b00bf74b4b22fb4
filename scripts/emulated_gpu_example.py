"""Developer tool: run ``examples/two_level_indexer.py`` on the CPU through the GPU kernels' own logic, the
Triton scoring/cache kernels under triton's interpreter and the CUDA top-k through its CPU emulation build,
so a GPU-only disagreement can be split into "kernel logic" (reproduces here) and "device, compile or graph
capture" (does not). Slow (minutes for the example's default sizes); logic only, not numerics of the GPU.

    bash csrc/emu/build_emu.sh /tmp/emu.so
    TSI_TOPK_EMU=/tmp/emu.so python scripts/emulated_gpu_example.py [example flags, e.g. --no-compile]

Adding the CUDA decode scoring kernels' emulation build (``CSRC=scoring.cu bash csrc/emu/build_emu.sh
/tmp/semu.so``, then ``TORCH_SPARSE_INDEXER_SCORING_LIB=/tmp/semu.so``) sends MXFP4 paged decode scoring through
them, as on an H200 (``--fmt mxfp4 --no-compile``: 5024 rows exact against the reference in 12 minutes on two
cores, session 11).

Needs triton installed (any version whose interpreter runs the kernels; 3.9 did, 3.6's did not).
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from torch_sparse_indexer.testing import register_cpu_emulation  # noqa: E402

if __name__ == "__main__":
    register_cpu_emulation(os.environ["TSI_TOPK_EMU"])
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import two_level_indexer

    raise SystemExit(two_level_indexer.main(sys.argv[1:]))
