"""CUDA decode scoring kernels for SM90 (``csrc/scoring.cu``): ``paged_mqa_logits`` and
``paged_sparse_mqa_logits`` on MXFP4 caches (and FP8 when enabled: see ``CONFIG_OVERRIDES``), up to 64 heads,
D 64 or 128.

One warpgroup per program (a query row x a run of 64-column tiles); each tile is one ``wgmma m64nNk32`` per 32
of D with the K tile as the register operand: each thread copies its own bytes of two tokens (``cp.async``,
several tiles in flight) and converts them straight into its operand registers, no barrier per tile. MXFP4 group
scales are folded into the e4m3 operands where that is exact, with a per-group pass for the programs where it is
not (design: ``csrc/README.md``; measurements: ``benchmarks/NOTES.md``, "CUDA decode scoring"). The prebuilt library ``torch_sparse_indexer/_C/
libsparse_indexer_scoring.so`` (``pip install .`` or ``csrc/build.sh``) is loaded with :mod:`ctypes`: the calls
never synchronize, never allocate and never compile, so they can be captured in CUDA graphs. Inputs are
validated by :mod:`torch_sparse_indexer.ops` first; ``supports_*`` only decline what the kernels cannot take
(device, capability, heads, layout, alignment), and the Triton kernels serve those calls.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from .. import backends, formats
from . import _cudalib
from .grid import cdiv, row_tiles

LIB_NAME = "libsparse_indexer_scoring.so"
_LOGITS_CODE = {torch.float32: 0, torch.bfloat16: 1}

# Benchmarks may force the tiles per program ("row_tiles") to compare grids; the default sizes the grid from
# the shapes and the occupancy (never from timing). "fp8": True lets this backend take FP8 caches, which it
# declines by default: at the decode targets the Triton FP8 kernels measured faster on the H200 (sparse 90.4 vs
# 93.9 us; dense within 1%), while for MXFP4 this one is (sparse 84.1 vs 118.5 us, dense 573-595 vs 826 us;
# benchmarks/NOTES.md, runs 69-70).
CONFIG_OVERRIDES: dict = {}


def _declare(lib: ctypes.CDLL) -> None:
    vp, ll, i32, up = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_size_t
    lib.tsi_paged_scores.argtypes = [vp, vp, vp, ll, i32, vp, ll, i32, i32, vp, vp, ll, i32, i32, vp, vp, i32, i32,
                                     vp, ll, i32, i32, i32, i32, i32, i32, i32, up]
    lib.tsi_scoring_ctas_per_sm.argtypes = [i32, i32, i32, i32]
    lib.tsi_scoring_set_depth.argtypes = [i32]
    for f in (lib.tsi_paged_scores, lib.tsi_scoring_ctas_per_sm, lib.tsi_scoring_set_depth, lib.tsi_scoring_version,
              lib.tsi_scoring_max_heads, lib.tsi_scoring_max_tiles, lib.tsi_scoring_tile, lib.tsi_scoring_emulated):
        f.restype = ctypes.c_int
    lib.tsi_scoring_error_string.argtypes = [ctypes.c_int]
    lib.tsi_scoring_error_string.restype = ctypes.c_char_p


_LIB = _cudalib.Library(LIB_NAME, "TORCH_SPARSE_INDEXER_SCORING_LIB", _declare)


def available() -> bool:
    """True when the library is built and loaded (loads it on first call)."""
    return _LIB.available()


def emulated() -> bool:
    """True when the loaded library is the CPU emulation build (``csrc/emu/build_emu.sh`` with
    ``CSRC=scoring.cu``, loaded through ``TORCH_SPARSE_INDEXER_SCORING_LIB``): it takes CPU tensors, not CUDA
    ones, and runs the kernels' logic on threads (for tests; not a performance model)."""
    return available() and bool(_LIB.lib.tsi_scoring_emulated())


def set_depth(depth: int = 0) -> int:
    """Tiles in flight per 64-head program (3, 4 or 6; 0 = the default, 4). Returns the previous
    setting. For benchmarks that compare depths; results are identical, bit for bit."""
    _ctas_per_sm.cache_clear()
    return int(_LIB.lib.tsi_scoring_set_depth(depth)) if available() else 0


@functools.lru_cache(maxsize=None)
def _ctas_per_sm(D: int, fp4: bool, H: int, sparse: bool) -> int:
    v = int(_LIB.lib.tsi_scoring_ctas_per_sm(D, int(fp4), H, int(sparse)))
    return max(1, v)


def program_tiles(rows: int, width: int, D: int, fp4: bool, H: int, sparse: bool, device) -> int:
    """64-column tiles per program: the wave-filling count of :func:`grid.row_tiles` for the variant's CTAs per SM
    (the occupancy calculator), or ``CONFIG_OVERRIDES["row_tiles"]``."""
    max_tiles = int(_LIB.lib.tsi_scoring_max_tiles())
    if "row_tiles" in CONFIG_OVERRIDES:
        return max(1, min(max_tiles, int(CONFIG_OVERRIDES["row_tiles"])))
    slots = _ctas_per_sm(D, fp4, H, sparse) * _cudalib.num_sms(device)
    return row_tiles(rows, width, 64, max_tiles, slots)


def _supports(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, candidate_blocks,
              logits) -> Optional[str]:
    if not q.is_cuda and not emulated():
        return f"needs CUDA tensors, got {q.device}"
    if not available():
        return _LIB.load_error or "library not loaded"
    if emulated():
        if q.is_cuda:
            return "the loaded scoring library is the CPU emulation build (it takes CPU tensors)"
    elif _cudalib.capability(q) != (9, 0):
        return f"needs compute capability 9.0 (sm_90a wgmma), got {_cudalib.capability(q)}"
    if q.dtype == formats.FP8_DTYPE and not CONFIG_OVERRIDES.get("fp8", False):
        return "FP8 caches go to the Triton kernel (faster on the H200; CONFIG_OVERRIDES['fp8'] enables this one)"
    H = q.shape[1]
    if H > int(_LIB.lib.tsi_scoring_max_heads()):
        return f"at most {int(_LIB.lib.tsi_scoring_max_heads())} heads, got {H}"
    if q.data_ptr() % 4 != 0:
        return "q must be 4-byte aligned"
    kv = formats.as_3d_cache(kv_cache)
    if kv.data_ptr() % 16 != 0 or (kv.shape[0] > 1 and kv.stride(0) % 16 != 0):
        return "kv_cache pages must start on 16-byte boundaries"
    if weights.dim() == 2 and weights.shape[1] > 1 and weights.stride(1) != 1:
        return "weights must have stride(-1) == 1"
    if block_table.shape[0] == 0 or block_table.shape[1] == 0:
        return "empty block_table"
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        return "block_table must have stride(-1) == 1"
    if candidate_blocks is not None and not candidate_blocks.is_contiguous():
        return "candidate_blocks must be contiguous"
    if logits.dtype not in _LOGITS_CODE or (logits.shape[1] > 1 and logits.stride(1) != 1):
        return "logits must be float32 or bfloat16 with stride(-1) == 1"
    L = logits.shape[1]
    if cdiv(L, 64 * int(_LIB.lib.tsi_scoring_max_tiles())) > 65535:
        return f"logits width {L} too large for the grid"
    return None


def supports_paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, logits):
    return _supports(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, None, logits)


def supports_paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                                     candidate_blocks, cbs, logits):
    return _supports(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, candidate_blocks, logits)


def _launch(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, candidate_blocks, cbs, logits):
    fp4 = q.dtype != formats.FP8_DTYPE
    R, H, dq = q.shape
    D = 2 * dq if fp4 else dq
    L = logits.shape[1]
    if R == 0 or L == 0:
        return
    kv = formats.as_3d_cache(kv_cache)
    nb, bs, bpt = kv.shape
    page_stride = kv.stride(0) if nb > 1 else bs * bpt
    sparse = candidate_blocks is not None
    tiles = program_tiles(R, L, D, fp4, H, sparse, q.device)
    code = _LIB.lib.tsi_paged_scores(
        q.data_ptr(), q_scale.data_ptr() if q_scale is not None else None, weights.data_ptr(),
        weights.stride(0) if R > 1 else H, int(weights.dtype == torch.bfloat16),
        kv.data_ptr(), page_stride, nb, bs, context_lens.data_ptr(), block_table.data_ptr(),
        block_table.stride(0) if block_table.shape[0] > 1 else block_table.shape[1], block_table.shape[0],
        block_table.shape[1], req_indices.data_ptr() if req_indices is not None else None,
        candidate_blocks.data_ptr() if sparse else None, candidate_blocks.shape[1] if sparse else 0,
        cbs if sparse else 1, logits.data_ptr(), logits.stride(0) if R > 1 else L, _LOGITS_CODE[logits.dtype], R, H,
        D, int(fp4), L, tiles, _cudalib.stream(logits))
    if code != 0:
        msg = _LIB.lib.tsi_scoring_error_string(code).decode(errors="replace")
        raise RuntimeError(f"sparse_indexer paged scoring (cuda backend): launch failed with CUDA error {code}: {msg}")


def paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, logits) -> None:
    """Dense decode scores ``logits [R, L]`` (f32/bf16; column = position) from ``q [R, H, D]`` e4m3 or ``[R, H, D/2]``
    e2m1 pairs (+ ``q_scale int32 [R, H]``), the paged ``kv_cache``, ``weights [R, H]``, ``context_lens int32 [R]``,
    ``block_table int32 [num_reqs, max_blocks]`` and ``req_indices int32 [R]`` or None."""
    _launch(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, None, 1, logits)


def paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, candidate_blocks,
                            cbs, logits) -> None:
    """Decode scores on candidate blocks: ``logits [R, num_blocks * cbs]``, column ``c`` = position
    ``candidate_blocks[r, c // cbs] * cbs + c % cbs`` (``candidate_blocks int32 [R, num_blocks]``); the rest as
    :func:`paged_mqa_logits`."""
    _launch(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, candidate_blocks, cbs, logits)


def register() -> None:
    backends.register("paged_mqa_logits", "cuda", paged_mqa_logits, supports=supports_paged_mqa_logits, priority=20)
    backends.register("paged_sparse_mqa_logits", "cuda", paged_sparse_mqa_logits,
                      supports=supports_paged_sparse_mqa_logits, priority=20)
