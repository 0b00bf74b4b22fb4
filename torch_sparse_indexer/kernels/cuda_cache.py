"""CUDA ``write_k_cache`` for MXFP4 caches (``csrc/cache_kernels.cuh``, in the library :mod:`.cuda_topk` loads).

The Triton kernel (:mod:`.triton_cache`) stays the backend for FP8 caches, for fp16 keys and for GPUs below SM90;
this one takes MXFP4 writes of bf16 or fp32 keys, where the Triton kernel is ALU-bound (benchmarks/NOTES.md).
Byte-identical to :func:`torch_sparse_indexer.formats.quantize_mxfp4_rows` + the reference scatter. No sync, no
allocation, no compilation: capturable in CUDA graphs like the top-k kernels.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import formats
from . import cuda_topk as _ct


def supports_write(k, slot_mapping, kv_cache, fmt, pow2_scale) -> Optional[str]:
    if fmt != "mxfp4":
        return "FP8 caches take the Triton kernel"
    if not k.is_cuda:
        return f"needs CUDA tensors, got {k.device}"
    if not _ct.available():
        return _ct._load_error or "library not loaded"
    if not hasattr(_ct._lib, "tsi_write_k_cache_mxfp4"):
        return "the loaded library predates tsi_write_k_cache_mxfp4 (rebuild csrc/)"
    if torch.cuda.get_device_capability(k.device) < (9, 0):
        return f"needs compute capability >= 9.0, got {torch.cuda.get_device_capability(k.device)}"
    if k.dtype not in (torch.bfloat16, torch.float32):
        return f"k dtype bfloat16 or float32 expected, got {k.dtype}"
    if k.data_ptr() % 16 != 0:
        return "k must start 16-byte aligned"
    kv = formats.as_3d_cache(kv_cache)
    if kv.data_ptr() % 16 != 0 or (kv.shape[0] > 1 and kv.stride(0) % 16 != 0):
        return "kv_cache pages must start 16-byte aligned (page stride % 16 == 0)"
    return None


def write_k_cache(k: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor, fmt: str,
                  pow2_scale: bool) -> None:
    """``k [T, D]`` bf16/fp32 (D = 64 or 128, contiguous), ``slot_mapping int64/int32 [T]`` -> MXFP4 values and
    scale words of slot ``slot_mapping[t]`` in ``kv_cache uint8 [NB, BS, D / 2 + 4]`` (slots < 0 or past the
    cache skipped). ``pow2_scale`` has no effect (MXFP4 scales are powers of two)."""
    kv = formats.as_3d_cache(kv_cache)
    nb, bs, bpt = kv.shape
    T, D = k.shape
    stride = kv.stride(0) if nb > 1 else bs * bpt
    code = _ct._lib.tsi_write_k_cache_mxfp4(k.data_ptr(), T, D, int(k.dtype == torch.bfloat16),
                                            slot_mapping.data_ptr(), int(slot_mapping.dtype == torch.int64),
                                            kv.data_ptr(), nb * bs, formats.log2_block_size(bs), stride,
                                            _ct._stream(k))
    _ct._check(code, "write_k_cache")


def register() -> None:
    from .. import backends

    backends.register("write_k_cache", "cuda", write_k_cache, supports=supports_write, priority=20)
