"""Backend registry and dispatch.

Every op has an ordered list of backends (fastest first). A backend declares, per call, whether it
supports the inputs (``supports(*args) -> None`` or a reason string, the xformers
``not_supported_reasons`` idea); dispatch takes the first that does. A backend may also *defer*
(``defer(*args) -> None`` or a reason): automatic dispatch then passes it over for a later one that is
faster on that call (DeepGEMM's SM90 decode entries do), while forcing it still runs it. Only static
facts (device, capability, dtypes, shapes, static ints) may decide, so a captured graph always replays
the backend it recorded. The choice is logged once per (op, backend).

Force a backend globally with ``set_backend("reference")`` or ``TORCH_SPARSE_INDEXER_BACKEND``, for a
region with ``with use_backend("triton"): ...``, or disable one with ``disable_backend("deepgemm")``.
Forcing a backend that the op has but that does not support a call raises ``NotImplementedError`` with
its reason; ops that have no backend of that name dispatch automatically.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger("torch_sparse_indexer")

BACKEND_NAMES = ("deepgemm", "cuda", "triton", "reference")


@dataclass
class Backend:
    name: str
    fn: Callable
    supports: Callable[..., Optional[str]]
    priority: int
    defer: Optional[Callable[..., Optional[str]]] = None


_REGISTRY: dict[str, list[Backend]] = {}
_state = threading.local()
_global_forced: Optional[str] = os.environ.get("TORCH_SPARSE_INDEXER_BACKEND") or None
_disabled: set[str] = set(filter(None, os.environ.get("TORCH_SPARSE_INDEXER_DISABLE", "").split(",")))
_logged: set[tuple[str, str]] = set()


def register(op: str, name: str, fn: Callable, supports: Callable[..., Optional[str]] | None = None,
             priority: int = 0, defer: Callable[..., Optional[str]] | None = None) -> None:
    """Add ``fn`` as backend ``name`` of ``op`` (higher ``priority`` is tried first). ``defer(*args)``, given a
    call ``supports`` accepts, returns why automatic dispatch should leave that call to a later backend (or
    None); it must only name a reason when a later backend does run the call."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"name: expected one of {BACKEND_NAMES}, got {name!r}")
    lst = _REGISTRY.setdefault(op, [])
    lst[:] = [b for b in lst if b.name != name]
    lst.append(Backend(name, fn, supports or (lambda *a: None), priority, defer))
    lst.sort(key=lambda b: -b.priority)


def _check_name(name: Optional[str]) -> None:
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {BACKEND_NAMES} or None, got {name!r}")


def set_backend(name: Optional[str]) -> None:
    """Force ``name`` for every op globally (``None``: automatic)."""
    global _global_forced
    _check_name(name)
    _global_forced = name


def disable_backend(name: str, disabled: bool = True) -> None:
    _check_name(name)
    (_disabled.add if disabled else _disabled.discard)(name)


@contextlib.contextmanager
def use_backend(name: Optional[str]):
    """Force ``name`` inside the ``with`` block (this thread only)."""
    _check_name(name)
    prev = getattr(_state, "forced", None)
    _state.forced = name
    try:
        yield
    finally:
        _state.forced = prev


@contextlib.contextmanager
def registry_scope(*clear: str):
    """Backends registered or replaced inside the block are undone at its end, so a test module that
    registers stand-ins (e.g. the Triton kernels for CPU tensors under the interpreter) leaves every other
    module the registry it found. The ops named in ``clear`` start the block with no backend at all, so a test
    of the dispatch rules sees only its own stand-ins, whichever real backends this machine registered."""
    saved = {op: list(lst) for op, lst in _REGISTRY.items()}
    for op in clear:
        _REGISTRY.pop(op, None)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def forced() -> Optional[str]:
    return getattr(_state, "forced", None) or _global_forced


def disabled() -> set[str]:
    """The backends ``disable_backend`` (or ``TORCH_SPARSE_INDEXER_DISABLE``) took out of automatic dispatch."""
    return set(_disabled)


def candidates(op: str) -> list[Backend]:
    return list(_REGISTRY.get(op, []))


def select(op: str, *args) -> Backend:
    """The backend that will run ``op`` on ``args``."""
    want = forced()
    lst = _REGISTRY.get(op, [])
    if want is not None and all(b.name != want for b in lst):
        want = None  # the op has no such backend at all (e.g. top-k under "deepgemm"): automatic
    reasons = []
    for b in lst:
        if want is not None and b.name != want:
            continue
        if want is None and b.name in _disabled:
            continue
        why = b.supports(*args)
        if why is None and want is None and b.defer is not None:
            why = b.defer(*args)
        if why is None:
            if (op, b.name) not in _logged:
                _logged.add((op, b.name))
                log.info("sparse_indexer.%s: using backend %r", op, b.name)
            return b
        reasons.append(f"{b.name}: {why}")
    detail = "; ".join(reasons) or "no backend registered"
    if want is not None:
        raise NotImplementedError(f"sparse_indexer.{op}: forced backend {want!r} cannot run this call ({detail})")
    raise NotImplementedError(f"sparse_indexer.{op}: no backend supports this call ({detail})")


_recorders: list[list] = []


@contextlib.contextmanager
def record_dispatch():
    """Collect ``(op, backend name)`` for every dispatch inside the block (debugging which backend ran
    where, e.g. eager vs a compiled step); yields the list it appends to."""
    rec: list = []
    _recorders.append(rec)
    try:
        yield rec
    finally:
        _recorders.remove(rec)


def dispatch(op: str, *args):
    b = select(op, *args)
    for rec in _recorders:
        rec.append((op, b.name))
    return b.fn(*args)
