"""Top-k selection on the GPU: the CUDA kernels (``csrc/topk.cu``) vs ``torch.topk`` in one process
(``python benchmarks/bench.py --suite topk``).

Rows (fp32 unless the shape says bf16; lengths per row drawn in ``[W - 1000, W]``):

* ``topk`` decode: 128 x 128K at k = 512 / 1024 / 2048, plus 1 x 128K, 64 x 128K, 64 x 1M at k = 2048.
* ``topk`` prefill: 4096 x 16K and 4096 x 128K (fp32 and bf16), k = 2048.
* ``sparse_topk`` prefill: 4096 rows of 2048 candidate blocks of 8 (16K columns), k = 2048.
* ``block_topk``: 4096 x 128K -> 2048 blocks of 8.

Impls: ``cuda`` (ours, through the op's backend function), ``torch.topk+mask`` (what a caller must do for
per-row lengths: ``masked_fill`` then ``torch.topk``; for ``block_topk`` a masked ``amax`` over blocks then
``torch.topk``), ``torch.topk`` (no lengths at all: a lower bound for torch) and ``amax`` (one read of the
scores: the measured floor). Rows longer than the shared-memory limit are also timed on each path the
library can take for them: ``cuda cluster`` / ``cuda one-CTA`` (cluster mode forced on / off) and
``cuda two-pass`` (one CTA, sampled threshold off: the row read twice); rows of at most ``smem_keys`` columns
also on ``cuda three-CTA`` and ``cuda two-CTA`` (``cuda_topk.set_tri_mode`` "always" / "off").
``floor_us`` = score bytes / copy bandwidth; ``x_torch`` = torch.topk+mask time / ours; ``x_read`` = our time /
amax time. Times: median of CUDA-graph replays, L2 flushed; ``kernel_us`` (ours and ``amax``) = the kernels' own
GPU time from a profiler trace, L2 flushed, without launch and graph overheads. ``check``: our output equals
``reference.py`` on the first rows. ``--quick`` shrinks the shapes.
``TSI_BENCH_TOPK_TARGETS=1``: the issue's target shapes only, ours and ``amax`` only (to compare builds of
the library, picked with ``TORCH_SPARSE_INDEXER_TOPK_LIB``, in one device call); ``TSI_BENCH_TOPK_DECODE=1`` as
well: the decode shape (128 x 128K) only.

Public baseline: where FlashInfer's top-k is built (``benchmarks/baselines/build_flashinfer_topk.sh``; loaded
from ``$TSI_FLASHINFER_TOPK_LIB`` or ``.deps/flashinfer_topk/libtsi_fi_topk.so``), the fp32 ``topk`` rows also
time its ragged transform with the same per-row lengths: ``flashinfer`` (its default, non-deterministic),
``flashinfer exact`` (``deterministic``, ties to the lower position: our contract) and, for rows over 32K
columns, ``flashinfer multi-CTA`` (its radix path forced). ``check`` compares the selected sets with the
reference (FlashInfer's output order is not ours: both sides sorted). ``TSI_BENCH_FLASHINFER=0`` leaves them out.
"""
from __future__ import annotations

import ctypes
import os

import torch

import common
from torch_sparse_indexer import reference
from torch_sparse_indexer.kernels import cuda_topk as ct

COLUMNS = ["op", "shape", "k", "impl", "time_us", "kernel_us", "floor_us", "x_read", "x_torch", "check"]
DEV = "cuda"
CHECK_ROWS = 8
TARGETS_ONLY = os.environ.get("TSI_BENCH_TOPK_TARGETS", "0") == "1"
DECODE_ONLY = TARGETS_ONLY and os.environ.get("TSI_BENCH_TOPK_DECODE", "0") == "1"
# Only the shared-memory rows' targets (4096 x 16K and sparse_topk), for comparing builds of that path.
SMEM_ONLY = TARGETS_ONLY and os.environ.get("TSI_BENCH_TOPK_SMEM", "0") == "1"
# Only the small decode batches (1 .. 64 rows of 128K), on every path (the split kernel's range).
SMALL_ONLY = os.environ.get("TSI_BENCH_TOPK_SMALL", "0") == "1"


def _lengths(R, W, gen):
    return (W - torch.randint(0, 1001, (R,), generator=gen)).clamp(min=1).to(torch.int32).to(DEV)


def _mask(x, lens):
    col = torch.arange(x.shape[1], device=x.device)
    return x.masked_fill(col[None, :] >= lens[:, None].long(), float("-inf"))


def _expected(fn_ref, out, rows=CHECK_ROWS):
    """The reference's output for the first rows: fn_ref(e, rows) fills e, shaped like out[:rows]."""
    exp = torch.empty_like(out[:rows])
    fn_ref(exp, rows)
    return exp


def _check(out, exp):
    torch.cuda.synchronize()
    return "exact" if torch.equal(out[:exp.shape[0]], exp) else "MISMATCH"


def _rows(op, shape, k, x, ours, torch_masked, torch_plain, check):
    t_read = common.time_us(lambda: torch.amax(x, dim=1))
    floor = common.floor_us(x.numel() * x.element_size())
    t_ours = common.time_us(ours)
    k_read, k_ours = common.kernel_us(lambda: torch.amax(x, dim=1)), common.kernel_us(ours)
    t_tm = common.time_us(torch_masked) if torch_masked and not TARGETS_ONLY else float("nan")
    t_tp = common.time_us(torch_plain) if torch_plain and not TARGETS_ONLY else float("nan")
    base = dict(op=op, shape=shape, k=k, floor_us=floor)
    return [
        common.record(**base, impl="cuda", time_us=t_ours, kernel_us=k_ours, x_read=t_ours / t_read,
                      x_torch=t_tm / t_ours, check=check),
        common.record(**base, impl="torch.topk+mask", time_us=t_tm, x_read=t_tm / t_read, x_torch=1.0, check=""),
        common.record(**base, impl="torch.topk", time_us=t_tp, x_read=t_tp / t_read, x_torch=t_tm / t_tp, check=""),
        common.record(**base, impl="amax", time_us=t_read, kernel_us=k_read, x_read=1.0, x_torch=float("nan"),
                      check=""),
    ]


_FI = None  # the FlashInfer baseline: (ctypes library, row-state buffer), False where not built


def _flashinfer():
    global _FI
    if _FI is None:
        default = os.path.join(os.path.dirname(__file__), "..", ".deps", "flashinfer_topk", "libtsi_fi_topk.so")
        path = os.environ.get("TSI_FLASHINFER_TOPK_LIB", default)
        _FI = False
        if os.path.exists(path) and os.environ.get("TSI_BENCH_FLASHINFER", "1") != "0":
            lib = ctypes.CDLL(path)
            lib.tsi_fi_row_states_bytes.restype = ctypes.c_size_t
            lib.tsi_fi_topk_ragged.restype = ctypes.c_int
            lib.tsi_fi_topk_ragged.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_uint32] * 3 + [
                ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
            states = torch.zeros(lib.tsi_fi_row_states_bytes(), dtype=torch.uint8, device=DEV)
            _FI = (lib, states)
            print(f"[topk] FlashInfer baseline: {path}", flush=True)
    return _FI


def _flashinfer_rows(x, lens, k, shape, cuda_row, ref):
    """FlashInfer's ragged top-k on the same rows and lengths (see the module docstring)."""
    fi = _flashinfer()
    if not fi or x.dtype != torch.float32:
        return []
    lib, states = fi
    R, W = x.shape
    out = torch.empty(R, k, dtype=torch.int32, device=DEV)
    offsets = torch.zeros(R, dtype=torch.int32, device=DEV)
    lens_fi = lens.clone()  # its signature takes a mutable pointer

    def call(det):
        err = lib.tsi_fi_topk_ragged(x.data_ptr(), out.data_ptr(), offsets.data_ptr(), lens_fi.data_ptr(), R, W, k,
                                     states.data_ptr(), int(det), int(det), torch.cuda.current_stream().cuda_stream)
        if err != 0:
            raise RuntimeError(f"FlashInfer top-k: cudaError {err}")

    def check():
        torch.cuda.synchronize()
        got = out[:CHECK_ROWS].clone()
        big = torch.iinfo(torch.int32).max  # -1 padding sorts last on both sides
        a = torch.sort(torch.where(got < 0, big, got), dim=1).values
        b = torch.sort(torch.where(ref < 0, big, ref), dim=1).values
        return "exact" if torch.equal(a, b) else f"MISMATCH({int((a != b).any(dim=1).sum())} rows)"

    variants = [("flashinfer", None, False), ("flashinfer exact", None, True)]
    if W > 32768:
        variants.append(("flashinfer multi-CTA", "multi_cta", False))
    rows = []
    for impl, algo, det in variants:
        prev = os.environ.pop("FLASHINFER_TOPK_ALGO", None)
        if algo:
            os.environ["FLASHINFER_TOPK_ALGO"] = algo  # read when the call is made, so at graph capture
        try:
            fn = lambda: call(det)  # noqa: E731
            fn()
            chk = check()
            t = common.time_us(fn)
            k_us = common.kernel_us(fn)
        finally:
            os.environ.pop("FLASHINFER_TOPK_ALGO", None)
            if prev is not None:
                os.environ["FLASHINFER_TOPK_ALGO"] = prev
        rows.append(common.record(op="topk", shape=shape, k=k, floor_us=cuda_row["floor_us"], impl=impl,
                                  time_us=t, kernel_us=k_us, x_read=t / cuda_row["time_us"] * cuda_row["x_read"],
                                  x_torch=cuda_row["x_torch"] * cuda_row["time_us"] / t, check=chk))
    return rows


def _topk_case(R, W, k, dtype, gen, pattern=None):
    """Random rows, or rows that put most keys in one histogram bin: ``pattern="all_equal"`` (every score 0: one
    bin, ties at the threshold), ``"neg_inf_half"`` (the second half of each row -inf, as causal masking leaves
    prefill rows)."""
    x = torch.randn(R, W, generator=gen).to(dtype).to(DEV)
    if pattern == "all_equal":
        x.zero_()
    elif pattern == "neg_inf_half":
        x[:, W // 2:] = float("-inf")
    lens = _lengths(R, W, gen)
    out = torch.empty(R, k, dtype=torch.int32, device=DEV)
    ours = lambda: ct.topk(x, lens, k, out)  # noqa: E731
    ours()
    expected = _expected(lambda e, r: reference.topk(x[:r], lens[:r], k, e), out)
    check = _check(out, expected)
    shape = f"{R}x{W // 1024}K" + ("" if dtype == torch.float32 else " bf16") + (f" {pattern}" if pattern else "")
    rows = _rows("topk", shape, k, x, ours, lambda: torch.topk(_mask(x, lens), k, dim=1),
                 lambda: torch.topk(x, k, dim=1), check)
    t = ct.tuning()
    alts = []  # the same rows on each path: (impl, modes)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    if t["smem_keys"] < W <= t["cluster_max"] * t["smem_keys"]:
        alts += [("cuda cluster", dict(cluster="always", wide="off", split="off")),
                 ("cuda one-CTA", dict(cluster="off", wide="off", split="off"))]
    if W > t["smem_keys"]:
        alts.append(("cuda two-pass", dict(cluster="off", sampled=False, wide="off", split="off")))
    if W > t["smem_keys"] and R < 2 * sms:
        # the default ("auto") takes the wide CTAs for at most SMs / 2 rows: both CTA sizes on every decode batch
        alts += [("cuda 512 threads", dict(wide="off", split="off")),
                 (f"cuda {t['wide_threads']} threads", dict(wide="always", split="off"))]
    if W > t["smem_keys"] and R < sms:  # the split kernel at each cluster size, and the default without it
        alts += [("cuda no split", dict(split="off"))]
        alts += [(f"cuda split {c}", dict(split=str(c))) for c in (2, 4, 8) if R * c <= 2 * sms]
    alts += _tri_alts(W, k)
    cuda = rows[0]
    if pattern is None:  # target shapes too: the public baseline is part of what the issue asks to report
        rows += _flashinfer_rows(x, lens, k, shape, cuda, expected)
    for impl, modes in alts:
        rows.append(_alt_row("topk", shape, k, ours, out, expected, cuda, impl, modes))
    return rows


_SETTERS = {"cluster": ct.set_cluster_mode, "sampled": ct.set_sampled, "wide": ct.set_wide_mode,
            "tri": ct.set_tri_mode, "split": ct.set_split_mode}


def _tri_alts(W, k):
    """Rows the three-CTA kernel can take (``cuda_topk.set_tri_mode``; the suite's rows are 16-byte aligned): timed
    on it and on the two-CTA kernel, so that both show whichever is the default."""
    t = ct.tuning()
    if W > t["smem_keys"] or k > t["tri_max_k"]:
        return []
    return [("cuda three-CTA", dict(tri="always")), ("cuda two-CTA", dict(tri="off"))]


def _alt_row(op, shape, k, ours, out, expected, cuda, impl, modes):
    """ours() timed with the library's path modes set (``_SETTERS``; restored after), as a row against ``cuda``."""
    prev = {name: _SETTERS[name](value) for name, value in modes.items()}
    try:
        ours()
        chk = _check(out, expected)
        t_alt = common.time_us(ours)
        k_alt = common.kernel_us(ours)
    finally:
        for name, value in prev.items():
            _SETTERS[name](value)
    return common.record(op=op, shape=shape, k=k, floor_us=cuda["floor_us"], impl=impl, time_us=t_alt,
                         kernel_us=k_alt, x_read=t_alt / cuda["time_us"] * cuda["x_read"],
                         x_torch=cuda["x_torch"] * cuda["time_us"] / t_alt, check=chk)


def _sparse_case(R, nb, cbs, k, gen, short=False):
    """``short``: a 4099-token request (513 candidate blocks, the last cut), the rest of each list -1, and -inf
    in the invalid columns as the scorer writes them (the rows' fix-up of invalid columns)."""
    W = nb * cbs
    x = torch.randn(R, W, generator=gen).to(DEV)
    if short:
        ctx = 4096 + 3
        nv = -(-ctx // cbs)
        blocks = torch.cat([torch.arange(nv), torch.full((nb - nv,), -1)]).to(torch.int32)
        lens = torch.full((R,), ctx, dtype=torch.int32, device=DEV)
        x[:, ctx:] = float("-inf")
    else:
        # Neighbouring query rows see mostly the same blocks of one long request: ascending distinct ids.
        blocks = torch.sort(torch.randperm(16 * nb, generator=gen)[:nb]).values.to(torch.int32)
        lens = torch.full((R,), 16 * nb * cbs, dtype=torch.int32, device=DEV)
    blocks = blocks[None].expand(R, nb).contiguous().to(DEV)
    out = torch.empty(R, k, dtype=torch.int32, device=DEV)
    ours = lambda: ct.sparse_topk(x, blocks, cbs, lens, k, out)  # noqa: E731
    ours()
    expected = _expected(lambda e, r: reference.sparse_topk(x[:r], blocks[:r], cbs, lens[:r], k, e), out)
    check = _check(out, expected)
    valid = lens  # the valid columns are a prefix here: the masked topk is the fair torch equivalent
    shape = f"{R}x{nb}blk*{cbs}" + (" short" if short else "")
    rows = _rows("sparse_topk", shape, k, x, ours, lambda: torch.topk(_mask(x, valid), k, dim=1),
                 lambda: torch.topk(x, k, dim=1), check)
    for impl, modes in _tri_alts(W, k):
        rows.append(_alt_row("sparse_topk", shape, k, ours, out, expected, rows[0], impl, modes))
    return rows


def _block_case(R, W, cbs, nbk, gen):
    x = torch.randn(R, W, generator=gen).to(DEV)
    lens = _lengths(R, W, gen)
    out = torch.empty(R, nbk, dtype=torch.int32, device=DEV)
    ours = lambda: ct.block_topk(x, lens, cbs, out)  # noqa: E731
    ours()
    check = _check(out, _expected(lambda e, r: reference.block_topk(x[:r], lens[:r], cbs, e), out))

    def torch_masked():
        s = _mask(x, lens).view(R, W // cbs, cbs).amax(dim=2)
        return torch.topk(s, nbk, dim=1)

    def torch_plain():
        return torch.topk(x.view(R, W // cbs, cbs).amax(dim=2), nbk, dim=1)

    return _rows("block_topk", f"{R}x{W // 1024}K/{cbs}", nbk, x, ours, torch_masked, torch_plain, check)


def run(args) -> list[dict]:
    if not (torch.cuda.is_available() and ct.available()):
        print("[topk] skipped: needs a CUDA GPU and the built library (csrc/build.sh)")
        return []
    gen = torch.Generator().manual_seed(0)
    q = getattr(args, "quick", False)
    K128 = 16384 if q else 131072
    rows: list[dict] = []
    print(f"[topk] three-CTA kernel: {ct.tri_blocks_per_sm()} CTAs per SM", flush=True)
    if SMALL_ONLY:
        for R in (1, 2, 4, 8, 16, 32, 48, 64):
            rows += _topk_case(R, K128, 2048, torch.float32, gen)
        rows += _topk_case(16, 1 << 20, 2048, torch.float32, gen)
        return _print(rows)
    for k in (() if SMEM_ONLY else (2048,) if TARGETS_ONLY else (512, 1024, 2048)):
        rows += _topk_case(128, K128, k, torch.float32, gen)
    if not q and not TARGETS_ONLY:
        for R in (1, 8, 32, 64):  # small decode batches: the cluster kernel's range
            rows += _topk_case(R, K128, 2048, torch.float32, gen)
        rows += _topk_case(64, 1 << 20, 2048, torch.float32, gen)
    if not DECODE_ONLY:
        R = 512 if q else 4096
        rows += _topk_case(R, 16384, 2048, torch.float32, gen)
        for pattern in ("all_equal", "neg_inf_half"):
            rows += _topk_case(R, 16384, 2048, torch.float32, gen, pattern)
        rows += _sparse_case(R, 2048, 8, 2048, gen)
        rows += _sparse_case(R, 2048, 8, 2048, gen, short=True)
        if not SMEM_ONLY:
            rows += _topk_case(R, K128, 2048, torch.float32, gen)
            if not TARGETS_ONLY:
                rows += _topk_case(R, K128, 2048, torch.bfloat16, gen)
            rows += _block_case(R, K128, 8, 2048, gen)
    return _print(rows)


def _print(rows):
    for r in rows:
        if r["impl"].startswith("cuda"):
            alt = "" if r["impl"] == "cuda" else f" [{r['impl'][5:]}]"
            print(f"[topk] {r['op']} {r['shape']} k={r['k']}{alt}: {r['time_us']:.1f} us "
                  f"(kernel {r.get('kernel_us', float('nan')):.1f}), "
                  f"x_read {r['x_read']:.2f}, x_torch {r['x_torch']:.1f}, {r['check']}", flush=True)
    return rows
