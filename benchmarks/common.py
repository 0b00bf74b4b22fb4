"""Shared benchmark machinery: environment record, timing, floors, CSV/PNG output.

Every row a suite returns is a dict; ``record()`` adds the hardware and software conditions so each number
says where it came from (gpt-fast's rule). Times are medians of CUDA-graph replays (or of CUDA-event timed
calls) with the L2 flushed between repetitions: by ``triton.testing.do_bench`` semantics (a write of 256 MB) or,
with ``TSI_BENCH_FLUSH=read``, by a read of 256 MB (see ``FLUSH``); every row records which (``env_l2_flush``).
"""
from __future__ import annotations

import csv
import os
import platform
import subprocess
from typing import Callable, Iterable

import torch

from torch_sparse_indexer import testing

# Ceilings measured on the project's H200 (ANCHORS.md section 7): use these for the floors.
COPY_BW = 4.27e12          # bytes/s, device-to-device copy (read + write)
FP8_RATE = 1281e12         # flop/s, torch._scaled_mm fp8 8192^3
BF16_RATE = 695e12

# How the L2 is flushed between timed repetitions: "write" (the default: do_bench's zero_() of 256 MB, which leaves
# the L2 full of dirty lines that are written back while the timed kernel reads) or "read" (a reduction over 256 MB,
# which leaves it full of clean lines: the L2 state of rotated inputs, the other allowed method).
FLUSH = os.environ.get("TSI_BENCH_FLUSH", "write")


def floor_us(bytes_moved: float = 0.0, flops: float = 0.0, flop_rate: float = FP8_RATE) -> float:
    """max(bytes / copy bandwidth, flops / rate) in microseconds."""
    return max(bytes_moved / COPY_BW, flops / flop_rate) * 1e6


def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda or "",
           "gpu": "", "sms": "", "clocks": "", "l2_flush": FLUSH}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = ""
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = p.name
        env["sms"] = p.multi_processor_count
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout
            env["clocks"] = out.strip().replace(",", " /")
        except Exception:
            pass
    try:
        import deep_gemm
        env["deep_gemm"] = getattr(deep_gemm, "__version__", "?")
    except Exception:
        env["deep_gemm"] = ""
    return env


_ENV: dict | None = None


def record(**row) -> dict:
    global _ENV
    if _ENV is None:
        _ENV = environment()
    out = dict(row)
    out.update({f"env_{k}": v for k, v in _ENV.items()})
    return out


_FLUSH_STATE: dict = {}


def flush_l2() -> None:
    """Evicts the L2 before a timed repetition, the ``FLUSH`` way: "write" zeroes 256 MB (as do_bench does),
    "read" sums 256 MB in a kernel named ``_l2_flush_read`` (the profiler-based timings leave it out by name)."""
    if "buf" not in _FLUSH_STATE:
        _FLUSH_STATE["buf"] = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    buf = _FLUSH_STATE["buf"]
    if FLUSH != "read":
        buf.zero_()
        return
    if "kernel" not in _FLUSH_STATE:
        import triton
        import triton.language as tl

        @triton.jit
        def _l2_flush_read(x_ptr, out_ptr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            v = tl.load(x_ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
            tl.store(out_ptr + pid, tl.sum(v, axis=0))

        words = buf.view(torch.int32)
        block = 8192
        out = torch.empty(words.numel() // block, dtype=torch.int32, device="cuda")
        _FLUSH_STATE["kernel"] = lambda: _l2_flush_read[(out.numel(),)](words, out, BLOCK=block)
    _FLUSH_STATE["kernel"]()


def _median_flushed_us(run: Callable[[], None], reps: int = 100) -> float:
    times = []
    for _ in range(reps):
        flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def time_us(fn: Callable[[], None], graph: bool = True, warmup: int = 3, rep_ms: int = 200) -> float:
    """Median time of ``fn`` in microseconds. ``graph``: capture ``fn`` once and time replays (what a
    serving engine sees); otherwise time eager calls. L2 is flushed between repetitions (see ``FLUSH``)."""
    import triton.testing

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = testing.capture_graph(fn).replay if graph else fn
    if FLUSH == "read":
        return _median_flushed_us(run)
    ms = triton.testing.do_bench(run, warmup=25, rep=rep_ms, return_mode="median")
    return ms * 1e3


def kernel_us(fn: Callable[[], None], reps: int = 20) -> float:
    """Mean GPU duration, in microseconds, of the kernels one call of ``fn`` launches, from a torch.profiler
    (kineto) trace with the L2 flushed before each call (DeepGEMM's ``bench_kineto`` method): launch and
    CUDA-graph overheads excluded, unlike ``time_us``. NaN where the profiler records no kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    flush_l2()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                flush_l2()
                fn()
            torch.cuda.synchronize()
        total = sum(e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA
                    and not any(f in e.name for f in ("Fill", "Memset", "memset", "_l2_flush_read")))  # the flush
    except Exception as e:  # no CUPTI, or an event API this torch lacks
        print(f"kernel_us: profiler unavailable ({type(e).__name__}: {e})")
        return float("nan")
    return total / reps if total > 0 else float("nan")


def replay_us(fn: Callable[[], None], reps: int = 50) -> float:
    """Median of ``reps`` CUDA-graph replays of ``fn`` (L2 flushed before each), a fixed count: ranks of a
    process group that each time a step with collectives this way stay paired."""
    fn()
    torch.cuda.synchronize()
    return _median_flushed_us(testing.capture_graph(fn).replay, reps)


def write_csv(rows: Iterable[dict], path: str) -> None:
    rows = list(rows)
    if not rows:
        return
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)
