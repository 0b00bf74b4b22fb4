"""CUDA top-k kernels (``csrc/topk.cu``): exact, deterministic ``topk``, ``sparse_topk`` and ``block_topk``.

The kernels live in a standalone shared library, ``torch_sparse_indexer/_C/libsparse_indexer_topk.so``,
built ahead of time by ``pip install .`` (or ``csrc/build.sh``) with a plain ``nvcc``. It exposes a C ABI
over raw device pointers and takes the stream as an integer, so one build serves every torch version;
it is loaded with :mod:`ctypes` only when present and CUDA is available. Importing never compiles.

Calls pass ``tensor.data_ptr()`` and ``torch.cuda.current_stream().cuda_stream``: they never sync,
never allocate and need no workspace, so they can be captured in CUDA graphs. Inputs are validated by
:mod:`torch_sparse_indexer.ops` before any backend runs; the ``supports_*`` functions only decline
calls the library cannot take (device, capability, dtype, layout).

Out-of-contract device values follow :mod:`torch_sparse_indexer.reference` (lengths clamped, -1 blocks
skipped). One documented difference: for ``sparse_topk``, ties are broken by column order, which is
position order exactly when the valid block ids of a row are ascending and unique (the contract); for
unsorted or repeated ids the kernel still outputs ascending positions and the exact multiset of scores,
but among equal scores it may keep a different position than the reference.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import _cudalib

LIB_NAME = "libsparse_indexer_topk.so"
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


def _declare(lib: ctypes.CDLL) -> None:
    vp, ll, i32, up = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_size_t
    lib.tsi_topk.argtypes = [vp, ll, i32, i32, i32, vp, i32, vp, up]
    lib.tsi_sparse_topk.argtypes = [vp, ll, i32, i32, vp, i32, i32, vp, i32, vp, up]
    lib.tsi_block_topk.argtypes = [vp, ll, i32, i32, i32, vp, i32, vp, i32, up]
    for f in (lib.tsi_topk, lib.tsi_sparse_topk, lib.tsi_block_topk, lib.tsi_topk_version, lib.tsi_topk_max_k,
              lib.tsi_topk_smem_keys, lib.tsi_topk_cand_cap, lib.tsi_topk_cluster_max, lib.tsi_topk_set_cluster_mode,
              lib.tsi_topk_set_sampled, lib.tsi_topk_set_wide_mode, lib.tsi_topk_wide_threads,
              lib.tsi_topk_set_tri_mode, lib.tsi_topk_tri_max_k, lib.tsi_topk_tri_blocks_per_sm,
              lib.tsi_topk_tri_launches):
        f.restype = ctypes.c_int
    if hasattr(lib, "tsi_topk_set_split_mode"):  # (libraries before version 6, e.g. benchmarks' older builds, lack it)
        lib.tsi_topk_set_split_mode.argtypes = [i32]
        lib.tsi_topk_set_split_mode.restype = lib.tsi_topk_split_launches.restype = ctypes.c_int
    lib.tsi_topk_set_tri_mode.argtypes = [i32]
    lib.tsi_topk_set_cluster_mode.argtypes = [i32]
    lib.tsi_topk_set_wide_mode.argtypes = [i32]
    lib.tsi_topk_set_sampled.argtypes = [i32]
    lib.tsi_topk_error_string.argtypes = [ctypes.c_int]
    lib.tsi_topk_error_string.restype = ctypes.c_char_p


_LIB = _cudalib.Library(LIB_NAME, "TORCH_SPARSE_INDEXER_TOPK_LIB", _declare)


def library_path() -> str:
    """Where the library is looked up (``TORCH_SPARSE_INDEXER_TOPK_LIB`` overrides)."""
    return _LIB.path()


def load(path: Optional[str] = None) -> ctypes.CDLL:
    """Load the library (``path`` defaults to :func:`library_path`) and declare its C signatures."""
    return _LIB.load(path)


def available() -> bool:
    """True when the library is built and loaded (loads it on first call)."""
    return _LIB.available()


def max_k() -> int:
    """Largest ``k`` (and ``num_blocks`` for ``block_topk``) the library takes."""
    return int(_LIB.lib.tsi_topk_max_k()) if available() else 0


def tuning() -> dict:
    """The library's path thresholds: ``smem_keys`` (rows selected in shared memory), ``cand_cap`` and
    ``cluster_max`` (``topk`` rows of ``smem_keys < width <= cluster_max * smem_keys`` columns are split over
    a cluster of CTAs, each holding one slice in shared memory), ``wide_threads`` (the CTA size of the wide
    mode, :func:`set_wide_mode`), ``tri_max_k`` (the largest ``k`` of the three-CTA kernel, :func:`set_tri_mode`)."""
    if not available():
        return {}
    return {"smem_keys": int(_LIB.lib.tsi_topk_smem_keys()), "cand_cap": int(_LIB.lib.tsi_topk_cand_cap()),
            "cluster_max": int(_LIB.lib.tsi_topk_cluster_max()),
            "wide_threads": int(_LIB.lib.tsi_topk_wide_threads()),
            "tri_max_k": int(_LIB.lib.tsi_topk_tri_max_k())}


CLUSTER_MODES = ("off", "auto", "always")


def set_cluster_mode(mode: str) -> str:
    """How ``topk`` rows of ``smem_keys < width <= cluster_max * smem_keys`` columns run: ``"auto"`` (the
    default: split over a cluster of CTAs when rows x cluster size <= SMs),
    ``"always"`` or ``"off"`` (one CTA per row). Returns the previous mode. For benchmarks and tests that
    compare the paths."""
    if mode not in CLUSTER_MODES:
        raise ValueError(f"mode: expected one of {CLUSTER_MODES}, got {mode!r}")
    if not available():
        return "auto"
    return CLUSTER_MODES[_LIB.lib.tsi_topk_set_cluster_mode(CLUSTER_MODES.index(mode))]


SPLIT_MODES = ("off", "auto", "2", "4", "8")


def set_split_mode(mode: str) -> str:
    """Whether dense ``topk`` rows longer than ``smem_keys`` are streamed by a cluster of CTAs, each reading its
    slice of the row after a shared sample's threshold (one CTA then selects among every CTA's buffered
    candidates): ``"auto"`` (the default: batches of at most SMs / 4 rows, with the most CTAs per row, 8, 4 or 2,
    whose clusters all fit on the GPU at once, keeping slices of at least ``smem_keys`` columns), ``"off"``, or
    ``"2"`` / ``"4"`` / ``"8"`` CTAs per row for every such launch. Split rows take precedence over the cluster
    kernel. Results are identical in every mode. Returns the previous mode ("off" for a library without the
    kernel). For benchmarks and tests that compare the paths."""
    if mode not in SPLIT_MODES:
        raise ValueError(f"mode: expected one of {SPLIT_MODES}, got {mode!r}")
    if not available() or not hasattr(_LIB.lib, "tsi_topk_set_split_mode"):
        return "off"
    return SPLIT_MODES[_LIB.lib.tsi_topk_set_split_mode(SPLIT_MODES.index(mode))]


def split_launches() -> int:
    """Launches of the split kernel so far in this process (tests check that a mode reaches it)."""
    if not available() or not hasattr(_LIB.lib, "tsi_topk_split_launches"):
        return 0
    return int(_LIB.lib.tsi_topk_split_launches())


WIDE_MODES = ("off", "auto", "always")


def set_wide_mode(mode: str) -> str:
    """Whether dense ``topk`` rows that do not take the cluster kernel run one CTA of ``tuning()["wide_threads"]``
    threads per row instead of 512: ``"auto"`` (the default: rows longer than ``smem_keys`` in batches of at most
    SMs / 2 rows, which then stream with 32 warps per SM instead of 16: 6-7% faster at 32-64 x 128K on the H200),
    ``"off"`` or ``"always"``. Results are identical in every mode. Returns the previous mode. For benchmarks and
    tests that compare the paths."""
    if mode not in WIDE_MODES:
        raise ValueError(f"mode: expected one of {WIDE_MODES}, got {mode!r}")
    if not available():
        return "auto"
    return WIDE_MODES[_LIB.lib.tsi_topk_set_wide_mode(WIDE_MODES.index(mode))]


TRI_MODES = ("off", "auto", "always")


def set_tri_mode(mode: str) -> str:
    """Whether ``topk`` and ``sparse_topk`` rows that fit in shared memory run on the three-CTA kernel (16-bit keys in
    shared memory, three CTAs per SM instead of two): ``"off"`` (the default: on an H100 it was 5-14% slower than
    the two-CTA kernel at 4096 x 16K and for ``sparse_topk``, benchmarks/NOTES.md run 96), ``"auto"`` (batches of
    at least 2 x SMs rows) or ``"always"``. Only rows with 16-byte aligned starts and strides,
    ``width <= smem_keys`` and ``k <= tuning()["tri_max_k"]`` qualify (fp32 or bf16); others keep their kernel.
    Results are identical in every mode. Returns the previous mode. For benchmarks and tests that compare the
    paths."""
    if mode not in TRI_MODES:
        raise ValueError(f"mode: expected one of {TRI_MODES}, got {mode!r}")
    if not available():
        return "off"
    return TRI_MODES[_LIB.lib.tsi_topk_set_tri_mode(TRI_MODES.index(mode))]


def tri_blocks_per_sm() -> int:
    """CTAs per SM that the three-CTA kernel reaches on the current GPU (it is built for three); -1 where that
    cannot be queried (no GPU, emulation builds)."""
    return int(_LIB.lib.tsi_topk_tri_blocks_per_sm()) if available() else -1


def tri_launches() -> int:
    """Launches of the three-CTA kernel so far in this process (tests check that a mode reaches it)."""
    return int(_LIB.lib.tsi_topk_tri_launches()) if available() else 0


def set_sampled(on: bool) -> bool:
    """Whether rows longer than ``smem_keys`` (one CTA per row) first try a threshold taken from a sample
    of the row: one read of the row whenever it buffers between ``k`` and ``cand_cap`` elements, else the
    two-pass path (the default: on). Results are identical either way; only the time differs. Returns
    the previous setting. For benchmarks and tests that compare the paths."""
    if not available():
        return True
    return bool(_LIB.lib.tsi_topk_set_sampled(1 if on else 0))


_stream = _cudalib.stream


def _check(code: int, op: str) -> None:
    if code != 0:
        msg = _LIB.lib.tsi_topk_error_string(code).decode(errors="replace")
        raise RuntimeError(f"sparse_indexer.{op} (cuda backend): kernel launch failed with CUDA error {code}: {msg}")


def _row_stride(logits: torch.Tensor) -> int:
    R, W = logits.shape
    return logits.stride(0) if R > 1 else W


# ----------------------------------------------------------------------------------------------------
# supports(): static facts only (device, capability, dtype, layout, sizes)
# ----------------------------------------------------------------------------------------------------

def _common_reason(logits: torch.Tensor, kk: int) -> Optional[str]:
    if not logits.is_cuda:
        return f"needs CUDA tensors, got {logits.device}"
    if not available():
        return _LIB.load_error or "library not loaded"
    if _cudalib.capability(logits) < (9, 0):
        return f"needs compute capability >= 9.0, got {_cudalib.capability(logits)}"
    if logits.dtype not in _DTYPE_CODE:
        return f"logits dtype float32 or bfloat16 expected, got {logits.dtype}"
    R, W = logits.shape
    if W > 1 and logits.stride(1) != 1:
        return f"logits needs stride(1) == 1, got {logits.stride(1)}"
    if R > 1 and logits.stride(0) < W:
        return f"logits needs stride(0) >= width {W}, got {logits.stride(0)}"
    if W >= 2 ** 31 // 2 or R >= 2 ** 31:
        return f"logits shape {tuple(logits.shape)} too large for 32-bit indexing"
    if kk > max_k():
        return f"k (or num_blocks) <= {max_k()} expected, got {kk}"
    return None


def supports_topk(logits, lengths, k, indices) -> Optional[str]:
    return _common_reason(logits, k)


def supports_sparse_topk(logits, candidate_blocks, cbs, lengths, k, indices) -> Optional[str]:
    return _common_reason(logits, k)


def supports_block_topk(logits, lengths, cbs, candidate_blocks) -> Optional[str]:
    return _common_reason(logits, candidate_blocks.shape[1])


# ----------------------------------------------------------------------------------------------------
# Kernels (same signatures as the ops; outputs written in place)
# ----------------------------------------------------------------------------------------------------

def topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, indices: torch.Tensor) -> None:
    """``logits [R, W]`` f32/bf16, ``lengths int32 [R]`` -> ``indices int32 [R, k]`` (ascending, -1 padded)."""
    R, W = logits.shape
    code = _LIB.lib.tsi_topk(logits.data_ptr(), _row_stride(logits), R, W, _DTYPE_CODE[logits.dtype],
                         lengths.data_ptr(), k, indices.data_ptr(), _stream(logits))
    _check(code, "topk")


def sparse_topk(logits: torch.Tensor, candidate_blocks: torch.Tensor, cbs: int, lengths: torch.Tensor, k: int,
                indices: torch.Tensor) -> None:
    """``logits [R, nb * cbs]``, ``candidate_blocks int32 [R, nb]`` -> request-local positions ``[R, k]``."""
    R = logits.shape[0]
    nb = candidate_blocks.shape[1]
    code = _LIB.lib.tsi_sparse_topk(logits.data_ptr(), _row_stride(logits), R, _DTYPE_CODE[logits.dtype],
                                candidate_blocks.data_ptr(), nb, cbs, lengths.data_ptr(), k, indices.data_ptr(),
                                _stream(logits))
    _check(code, "sparse_topk")


def block_topk(logits: torch.Tensor, lengths: torch.Tensor, cbs: int, candidate_blocks: torch.Tensor) -> None:
    """``logits [R, W]`` -> the best ``num_blocks`` blocks of ``cbs`` columns, ``int32 [R, num_blocks]``."""
    R, W = logits.shape
    code = _LIB.lib.tsi_block_topk(logits.data_ptr(), _row_stride(logits), R, W, _DTYPE_CODE[logits.dtype],
                               lengths.data_ptr(), cbs, candidate_blocks.data_ptr(), candidate_blocks.shape[1],
                               _stream(logits))
    _check(code, "block_topk")


def register() -> None:
    from .. import backends

    backends.register("topk", "cuda", topk, supports=supports_topk, priority=20)
    backends.register("sparse_topk", "cuda", sparse_topk, supports=supports_sparse_topk, priority=20)
    backends.register("block_topk", "cuda", block_topk, supports=supports_block_topk, priority=20)
