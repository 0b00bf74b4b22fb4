"""What this machine can run: ``python -m torch_sparse_indexer.info`` (paste its output into bug reports).

Versions, CUDA devices, each kernel family (registered, or why not) and each op's backends in the order
dispatch tries them, with any forced or disabled backend. Which backend takes a given *call* also depends on
its arguments (``backends.select(op, *args)`` says; ``backends.record_dispatch()`` collects it from a run).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
from typing import Optional

import torch

from . import backends
from .ops import SCHEMAS


def _version(module: str) -> Optional[str]:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception as e:  # noqa: BLE001  (a broken install is worth reporting, not raising)
        return f"import failed: {e}"


def _devices() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                    "memory_gib": round(p.total_memory / 2**30, 1)})
    return out


def _registered(op_names, backend: str) -> bool:
    return any(b.name == backend for op in op_names for b in backends.candidates(op))


def _library_family(module: str, ops: tuple[str, ...]) -> dict:
    """A prebuilt CUDA library's state: its path, and registered / loaded / why not."""
    mod = importlib.import_module(f"torch_sparse_indexer.kernels.{module}")
    lib = mod._LIB
    path = lib.path()
    info = {"path": path, "built": os.path.exists(path)}
    if _registered(ops, "cuda"):
        info["status"] = "registered" + (" (the CPU emulation build)" if getattr(mod, "emulated", lambda: False)()
                                         else "")
    elif not torch.cuda.is_available() and not lib.lib:
        info["status"] = "not registered: no CUDA device" + ("" if info["built"] else " (and not built)")
    elif lib.lib is None and lib.load_error is None:
        info["status"] = "not registered: not loaded"
    else:
        info["status"] = "not registered: " + (lib.load_error or "loaded, but serves no op here")
    return info


def collect() -> dict:
    """Everything ``main`` prints, as a dict (versions, devices, families, dispatch order per op)."""
    from . import __version__
    cuda = torch.cuda.is_available()
    fams = {}
    if _registered(("mqa_logits", "write_k_cache"), "triton"):
        fams["triton"] = {"status": "registered"}
    elif importlib.util.find_spec("triton") is None:
        fams["triton"] = {"status": "not registered: triton is not importable"}
    else:
        fams["triton"] = {"status": "not registered: " + ("no CUDA device" if not cuda else
                                                         "its import failed (see the log's warning)")}
    fams["cuda top-k (csrc/topk.cu)"] = _library_family("cuda_topk", ("topk", "sparse_topk", "block_topk"))
    fams["cuda decode scoring (csrc/scoring.cu)"] = _library_family(
        "cuda_scoring", ("paged_mqa_logits", "paged_sparse_mqa_logits"))
    if _registered(("mqa_logits", "paged_mqa_logits"), "deepgemm"):
        from .kernels import deepgemm
        why = deepgemm.unavailable_reason()
        fams["deepgemm"] = {"status": "registered" + (f", but cannot run: {why}" if why else "")}
    else:
        fams["deepgemm"] = {"status": "not registered: " + (
            "deep_gemm is not installed" if importlib.util.find_spec("deep_gemm") is None else
            "no CUDA device" if not cuda else "its registration failed (see the log's warning)")}
    return {
        "versions": {"torch_sparse_indexer": __version__, "python": platform.python_version(),
                     "torch": torch.__version__, "torch CUDA": torch.version.cuda, "triton": _version("triton"),
                     "deep_gemm": _version("deep_gemm")},
        "devices": _devices(),
        "families": fams,
        "forced": backends.forced(),
        "disabled": sorted(backends.disabled()),
        "ops": {op: [b.name for b in backends.candidates(op)] for op in SCHEMAS},
        "defers": {op: [b.name for b in backends.candidates(op) if b.defer is not None] for op in SCHEMAS},
    }


def format_info(info: dict) -> str:
    lines = ["torch_sparse_indexer " + info["versions"]["torch_sparse_indexer"]]
    for k, v in info["versions"].items():
        if k != "torch_sparse_indexer":
            none = "none (a CPU build of torch)" if k == "torch CUDA" else "not installed"
            lines.append(f"  {k}: {v if v is not None else none}")
    lines.append("devices:" + ("" if info["devices"] else " no CUDA device (the reference backend serves every op)"))
    for d in info["devices"]:
        lines.append(f"  cuda:{d['index']} {d['name']}, capability {d['capability']}, {d['sms']} SMs, "
                     f"{d['memory_gib']} GiB")
    lines.append("kernel families:")
    for name, f in info["families"].items():
        extra = f" ({f['path']}{'' if f['built'] else ', not built'})" if "path" in f else ""
        lines.append(f"  {name}: {f['status']}{extra}")
    lines.append(f"forced backend: {info['forced'] or 'none'}; disabled: {', '.join(info['disabled']) or 'none'}")
    lines.append("dispatch order per op (the first that supports a call runs it; * = passes some calls it supports "
                 "to a later, faster backend unless forced):")
    width = max(len(op) for op in info["ops"])
    for op, names in info["ops"].items():
        defers = info.get("defers", {}).get(op, ())
        lines.append(f"  {op:<{width}}  {' > '.join(n + '*' if n in defers else n for n in names)}")
    return "\n".join(lines)


def main() -> int:
    print(format_info(collect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
