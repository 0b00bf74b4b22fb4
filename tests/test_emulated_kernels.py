"""The GPU kernels' logic on a CPU, inside the normal test run (so CI, which has no GPU, runs it too):

* the Triton scoring and cache tests (``test_triton_kernels.py``) under triton's interpreter on small shapes,
  every kernel against the reference (issue 4 asks CI to run them there);
* a part of the CUDA top-k tests (``test_topk_cuda.py``) against the CPU emulation build of ``csrc/``
  (``csrc/emu``: the same kernel source with small tuning constants, so small rows reach every path);
* the CUDA decode scoring kernels (``csrc/scoring.cu``) against their CPU emulation build (``wgmma`` and
  ``cp.async`` emulated): ``test_cuda_scoring.py`` and the paged tests of ``test_triton_kernels.py`` on the
  ``cuda`` backend (edge cases, MTP rows, views, bf16, the MXFP4 fold and per-group paths).

Each runs in a subprocess because the interpreter and the emulator are chosen when those modules are imported.
Skipped where triton (interpreter) or g++ (emulator) is missing, and with ``TSI_SKIP_EMULATED=1`` (together they add
a few minutes). The whole emulated top-k file takes 20-30 minutes on two cores; run it by hand with
``TSI_TOPK_EMU=lib.so pytest tests/test_topk_cuda.py`` (``csrc/README.md``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TSI_SKIP_EMULATED") == "1", reason="TSI_SKIP_EMULATED=1")]

# Emulated top-k tests run here (about half the file): every row path (shared-memory rows with the bitmap
# selection and the old refinement, streamed rows sampled and two-pass, overflowing threshold bins, cluster
# slices, the wide-CTA kernels, the three-CTA kernel, the split kernel at each cluster size), the value patterns
# (ties, NaN, -inf, signed zeros, ...) on shared-memory rows, sparse and block variants, tiny and empty rows.
TOPK_SUBSET = ("test_topk_random or (test_topk_patterns and 1023) or test_topk_overflowing "
               "or test_topk_cluster_slices or test_topk_wide or test_topk_empty_and_tiny or test_sparse_topk "
               "or test_block_topk or test_topk_tri or test_tri_ or test_topk_split_mode "
               "or (test_topk_split and split4 and sampled and not seams and not unrepresentative) "
               "or (test_topk_split_seams and split8 and 8192) or (test_topk_split_unrepresentative and split2)")


def _pytest(args, env_extra, timeout):
    env = dict(os.environ)
    for k in ("TSI_TOPK_EMU", "TRITON_INTERPRET", "TSI_TEST_DEVICE", "TORCH_SPARSE_INDEXER_SCORING_LIB", "TSI_EMU_SMS"):
        env.pop(k, None)
    env.update(env_extra)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-40:])
    assert p.returncode == 0, tail
    assert " passed" in tail.splitlines()[-1], tail
    return tail


def _skip_if_interpreter_too_old():
    """Triton's interpreter before 3.7 holds a kernel's scalars as 1-element NumPy arrays and turns loop bounds into
    ints with ``int()``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars":
    the device image's Triton 3.6, session 40). Triton 3.7 to 3.9 run the tests with NumPy 2.4; so does 3.6 with
    NumPy 2.3. The GPU runs the same kernels compiled."""
    triton = pytest.importorskip("triton")
    import numpy
    from torch_sparse_indexer.kernels.deepgemm import _version_tuple
    if _version_tuple(triton.__version__) < (3, 7) and _version_tuple(numpy.__version__) >= (2, 4):
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot take NumPy {numpy.__version__}'s scalars "
                    "as loop bounds (needs triton >= 3.7 or numpy < 2.4)")


def test_triton_kernels_under_interpreter():
    _skip_if_interpreter_too_old()
    _pytest(["tests/test_triton_kernels.py"], {"TRITON_INTERPRET": "1", "TSI_TEST_DEVICE": "cpu"}, timeout=2400)


# With the emulator's default 2 SMs, the test batches (about 12 rows) take the two-CTA-per-SM kernel; with 8 they take
# the one-CTA-per-SM kernel, which serves batches of fewer rows than twice the SMs on the GPU (decode). Its own
# tuning (tiles per batch in flight) runs these rows again there.
TOPK_SUBSET_ONE_CTA = ("test_topk_random or (test_topk_patterns and not 1023) or test_topk_unrepresentative "
                       "or test_bitwise_repeatable")


@pytest.fixture(scope="module")
def topk_emu_lib(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ for the emulation build")
    lib = str(tmp_path_factory.mktemp("emu") / "topk_emu.so")
    b = subprocess.run(["bash", os.path.join(ROOT, "csrc", "emu", "build_emu.sh"), lib], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stderr[-4000:]
    return lib


def test_topk_kernels_under_emulator(topk_emu_lib):
    _pytest(["tests/test_topk_cuda.py", "-k", TOPK_SUBSET], {"TSI_TOPK_EMU": topk_emu_lib}, timeout=3600)


def test_topk_one_cta_kernel_under_emulator(topk_emu_lib):
    _pytest(["tests/test_topk_cuda.py", "-k", TOPK_SUBSET_ONE_CTA], {"TSI_TOPK_EMU": topk_emu_lib, "TSI_EMU_SMS": "8"},
            timeout=3600)


def test_cuda_scoring_kernels_under_emulator(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ for the emulation build")
    lib = str(tmp_path / "scoring_emu.so")
    b = subprocess.run(["bash", os.path.join(ROOT, "csrc", "emu", "build_emu.sh"), lib], cwd=ROOT,
                       env={**os.environ, "CSRC": "scoring.cu"}, capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stderr[-4000:]
    _pytest(["tests/test_cuda_scoring.py"], {"TORCH_SPARSE_INDEXER_SCORING_LIB": lib}, timeout=1800)
    pytest.importorskip("triton")  # the cuda subset launches no Triton kernel: any interpreter collects it
    _pytest(["tests/test_triton_kernels.py", "-k", "cuda"],
            {"TORCH_SPARSE_INDEXER_SCORING_LIB": lib, "TRITON_INTERPRET": "1", "TSI_TEST_DEVICE": "cpu"}, timeout=1800)
