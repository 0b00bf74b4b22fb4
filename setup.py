"""Build step for the CUDA libraries (metadata lives in pyproject.toml).

``pip install .`` runs ``nvcc`` on ``csrc/topk.cu`` (top-k) and ``csrc/scoring.cu`` (SM90 decode scoring) when
an ``nvcc`` is found (``PATH``, ``$CUDA_HOME/bin``) and writes ``torch_sparse_indexer/_C/libsparse_indexer_*.so``
into the wheel (or into the source tree for editable installs). Without ``nvcc``, or with ``TORCH_SPARSE_INDEXER_NO_CUDA=1``, the step does nothing and
the install still succeeds (the Triton or reference backends serve). A failing compile is reported and skipped
unless ``TORCH_SPARSE_INDEXER_REQUIRE_CUDA=1``. The libraries need no CUDA torch to build: they have a C ABI
over raw pointers, so one build serves every torch version.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
# (source, library) pairs
LIBS = [(os.path.join("csrc", "topk.cu"), os.path.join("torch_sparse_indexer", "_C", "libsparse_indexer_topk.so")),
        (os.path.join("csrc", "scoring.cu"),
         os.path.join("torch_sparse_indexer", "_C", "libsparse_indexer_scoring.so"))]
# Same flags as csrc/build.sh.
NVCC_FLAGS = ["-O3", "-std=c++20", "--shared", "-Xcompiler", "-fPIC", "-cudart", "static", "--threads", "0",
              "-gencode", "arch=compute_90a,code=sm_90a",
              "-gencode", "arch=compute_100a,code=sm_100a",
              "-gencode", "arch=compute_90,code=compute_90"]


def _nvcc():
    if os.environ.get("TORCH_SPARSE_INDEXER_NO_CUDA", "0") == "1":
        return None
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cand = os.path.join(home, "bin", "nvcc") if home else ""
    return cand if cand and os.path.exists(cand) else None


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        nvcc = _nvcc()
        if nvcc is None:
            return
        base = ROOT if getattr(self, "editable_mode", False) else self.build_lib
        for src, lib in LIBS:
            if os.path.exists(os.path.join(ROOT, src)):
                self._build_one(nvcc, src, os.path.join(base, lib))

    @staticmethod
    def _build_one(nvcc, src, out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = [nvcc, *NVCC_FLAGS, os.path.join(ROOT, src), "-o", out]
        print(f"building {os.path.basename(out)}:", " ".join(cmd), file=sys.stderr)
        try:
            subprocess.run(cmd, check=True)
        except (subprocess.CalledProcessError, OSError) as e:
            if os.environ.get("TORCH_SPARSE_INDEXER_REQUIRE_CUDA", "0") == "1":
                raise
            print(f"warning: {os.path.basename(out)} not built ({e}); the Triton or reference backends will serve",
                  file=sys.stderr)


class BinaryDistribution(Distribution):
    """Platform wheel whenever the CUDA library is built into it."""

    def has_ext_modules(self):
        return _nvcc() is not None


setup(cmdclass={"build_py": BuildPyWithCuda}, distclass=BinaryDistribution)
