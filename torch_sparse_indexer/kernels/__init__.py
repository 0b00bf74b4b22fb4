"""GPU kernel backends. Each family registers itself with :mod:`torch_sparse_indexer.backends` when its
toolchain is importable; importing never compiles a kernel (``warmup()`` does, ahead of capture)."""

import importlib.util as _ilu
import logging as _logging
import os as _os

import torch as _torch

_log = _logging.getLogger("torch_sparse_indexer")


def _triton_usable() -> bool:
    # Only on a machine that can launch: triton imported, a CUDA device present. Never compiles here.
    return _ilu.find_spec("triton") is not None and _torch.cuda.is_available()


if _triton_usable():
    try:
        from . import triton_scoring, triton_cache  # noqa: F401

        triton_scoring.register()
        triton_cache.register()
    except Exception as _e:  # a broken triton install must not break the reference backend
        _log.warning("torch_sparse_indexer: triton kernels not registered (%s)", _e)

# DeepGEMM (optional): registered when the package can be found; deep_gemm itself is imported lazily by the
# backend's first support check, so machines without it never import it.
if _ilu.find_spec("deep_gemm") is not None and _torch.cuda.is_available():
    try:
        from . import deepgemm as _deepgemm

        _deepgemm.register()
    except Exception as _e:  # noqa: BLE001
        _log.warning("torch_sparse_indexer: DeepGEMM backend not registered (%s)", _e)

# CUDA libraries (top-k; SM90 decode scoring, ahead of the Triton kernels where it supports a call): prebuilt,
# loaded with ctypes (never compiled at import); an absent library or no GPU leaves those ops to the other backends.
if _torch.cuda.is_available():
    import importlib as _importlib

    for _name in ("cuda_topk", "cuda_scoring"):
        try:
            _mod = _importlib.import_module(f"{__name__}.{_name}")
            if _mod.available():
                _mod.register()
        except Exception as _e:  # a broken or foreign build must not break the other backends
            _log.warning("torch_sparse_indexer: %s kernels not registered (%s)", _name, _e)
elif _os.environ.get("TORCH_SPARSE_INDEXER_SCORING_LIB"):
    # Developer hook: the CPU emulation build of the scoring kernels (csrc/emu) named by that variable serves
    # CPU tensors (tests: the kernels' logic without a GPU).
    from . import cuda_scoring as _cs

    if _cs.emulated():
        _cs.register()
