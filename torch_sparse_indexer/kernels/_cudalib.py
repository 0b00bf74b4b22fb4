"""Loading of the prebuilt CUDA libraries (``torch_sparse_indexer/_C/*.so``, built by ``pip install .`` or
``csrc/build.sh``): C ABIs over raw device pointers, loaded with :mod:`ctypes` only when present; importing
never compiles. Shared by :mod:`.cuda_topk` and :mod:`.cuda_scoring`; the device facts below serve the Triton
kernels too."""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable, Optional

import torch

_capability: dict[int, tuple[int, int]] = {}


class Library:
    """One shared library: ``name`` under ``_C/`` (``env_var`` overrides the path); ``declare(lib)`` sets the
    ctypes signatures after loading."""

    def __init__(self, name: str, env_var: str, declare: Callable[[ctypes.CDLL], None]):
        self.name, self.env_var, self._declare = name, env_var, declare
        self.lib: Optional[ctypes.CDLL] = None
        self.load_error: Optional[str] = None

    def path(self) -> str:
        env = os.environ.get(self.env_var)
        if env:
            return env
        return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_C", self.name)

    def load(self, path: Optional[str] = None) -> ctypes.CDLL:
        lib = ctypes.CDLL(path or self.path())
        self._declare(lib)
        self.lib = lib
        return lib

    def available(self) -> bool:
        """True when the library is built and loaded (loads it on first call)."""
        if self.lib is not None:
            return True
        if self.load_error is not None:
            return False
        path = self.path()
        if not os.path.exists(path):
            self.load_error = f"{path} not built (pip install . on a machine with nvcc, or csrc/build.sh)"
            return False
        try:
            self.load(path)
        except OSError as e:
            self.load_error = f"cannot load {path}: {e}"
            return False
        except AttributeError as e:  # a build older than this package (a function it declares is missing)
            self.load_error = f"stale build {path} ({e}): rebuild (pip install . or csrc/build.sh)"
            return False
        return True


def on_device(fn: Callable) -> Callable:
    """Decorator for ``fn(device, ...)``: runs it with ``device`` current where that is a CUDA device, so that what
    it compiles and launches (Triton, the CUDA libraries and DeepGEMM all use the current device) lands there,
    not on whichever device the caller had current (the ops get the same guard in ``ops.py``)."""
    @functools.wraps(fn)
    def wrapper(device, *args, **kwargs):
        device = torch.device(device)
        if device.type != "cuda":
            return fn(device, *args, **kwargs)
        with torch.cuda.device(device):
            return fn(device, *args, **kwargs)
    return wrapper


def stream(t: torch.Tensor) -> int:
    """The current CUDA stream of ``t``'s device as an integer (0 for CPU tensors)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def capability(t: torch.Tensor) -> tuple[int, int]:
    """Compute capability of ``t``'s device (cached per device)."""
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    cap = _capability.get(dev)
    if cap is None:
        cap = _capability[dev] = torch.cuda.get_device_capability(dev)
    return cap


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached per device; 4 for a CPU device, the Triton interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
