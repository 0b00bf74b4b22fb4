"""DeepGEMM 2.8.2 backend behind our ops (``backends.register(op, "deepgemm", ...)``, priority 30).

What runs where (the support predicates are in :mod:`.deepgemm_translate`; ANCHORS.md section 2):

* SM90 (H100/H200): ``mqa_logits``, ``paged_mqa_logits`` and the end-to-end ``indexer_prefill`` /
  ``indexer_decode`` on DeepGEMM's ``fp8_fp4_mqa_logits`` / ``fp8_fp4_paged_mqa_logits``: fp8 only, 32 or 64
  heads, head dim 64/128, cache block size 64 (decode), fp32 weights (bf16 weights are widened, exactly).
* SM100 (untested on hardware here): the same dense ops for MXFP4 (DeepGEMM 2.8 SM100 takes only MX formats;
  our fp8 format has an fp32 per-token scale it does not accept), and the consumer level (``sparse_mqa_logits``,
  ``paged_sparse_mqa_logits``, ``sparse_indexer_prefill/decode``) on ``fp8_fp4_(paged_)sparse_mqa_logits``
  with our candidate lists translated to DeepGEMM's block-index contract. DeepGEMM 2.8 SM100 reduces heads in
  bf16 with bf16 weights and writes bf16 logits, so it is only chosen when the caller passes bf16 weights.

How our op contracts are kept:

* DeepGEMM allocates its own outputs (``torch::empty``, padded 1024-B rows, garbage outside each row's valid
  span). The scoring ops copy the valid span into the caller's ``logits`` (any row stride, fp32 or bf16) with
  one Triton pass that writes -inf everywhere else (an extra read + write of the logits, noted in the
  benchmarks). The end-to-end ops skip that copy: our ``topk`` / ``block_topk`` / ``sparse_topk`` run directly
  on DeepGEMM's padded buffer with per-row lengths (they never read past a row's length); only positions on
  out-of-range pages are patched to -inf in place (reference semantics).
* Out-of-contract device values are sanitized before DeepGEMM sees them (``ks/ke`` clamped, lengths clamped
  to the block table, page ids clamped into the cache, request ids clamped), then the affected positions are
  masked, exactly as :mod:`torch_sparse_indexer.reference` documents. No host reads a device value.
* Allocation: DeepGEMM's outputs, its schedule metadata and our small translation tensors are allocated per
  call; inside a captured CUDA graph they come from the graph's private pool (sized at capture, reused by
  every replay). DeepGEMM 2.8 has no ``out=`` for metadata, and the op consumes it at once, so copying it into
  a static buffer (what vLLM does to share it across layers) would only add a copy.
* JIT: DeepGEMM compiles each kernel on first use (and SM90's paged metadata kernel per ``align(rows, 32)``);
  compiling during capture fails (CUDA error 800). :func:`warmup` launches every configuration a layer can
  use, so capture never compiles.
"""
from __future__ import annotations

import inspect
import logging
from typing import Optional

import torch

from .. import backends, formats, workspace as ws_mod
from . import _cudalib, deepgemm_translate as tr

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (CPU machines without triton still import this module)
    triton = None
    tl = None

log = logging.getLogger("torch_sparse_indexer")
_ops = torch.ops.sparse_indexer

PRIORITY = 30
_MIN_VERSION = (2, 8)

_dg_mod = None
_dg_err: Optional[str] = None


def deep_gemm():
    """The ``deep_gemm`` module, imported lazily on first use (None when it cannot be imported)."""
    global _dg_mod, _dg_err
    if _dg_mod is None and _dg_err is None:
        try:
            import deep_gemm as m
            _dg_mod = m
            log.info("torch_sparse_indexer: deep_gemm %s imported", getattr(m, "__version__", "?"))
        except Exception as e:  # noqa: BLE001
            _dg_err = f"{type(e).__name__}: {e}"
    return _dg_mod


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for p in v.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def unavailable_reason() -> Optional[str]:
    """None when the backend can run here at all, else why not."""
    if triton is None:
        return "triton is not importable (the DeepGEMM backend's copy-back kernels need it)"
    m = deep_gemm()
    if m is None:
        return f"deep_gemm is not importable ({_dg_err})"
    v = getattr(m, "__version__", "0")
    if _version_tuple(v) < _MIN_VERSION:
        return f"deep_gemm >= 2.8 is needed (older signatures differ), got {v}"
    return None


_ARCH: dict = {}


def _arch(device: torch.device) -> Optional[str]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ARCH:
        _ARCH[idx] = tr.arch_family(torch.cuda.get_device_capability(idx))
    return _ARCH[idx]


def _fmt(q):
    return "fp8" if q.dtype == formats.FP8_DTYPE else "mxfp4"


def _head_dim(q):
    return q.shape[2] if q.dtype == formats.FP8_DTYPE else 2 * q.shape[2]


def _base_reason(q, **tensors) -> Optional[str]:
    if not q.is_cuda:
        return "needs CUDA tensors"
    why = unavailable_reason()
    if why:
        return why
    for name, t in {"q": q, **tensors}.items():
        if t is not None and t.numel() and t.data_ptr() % tr.TMA_ALIGN:
            return f"{name} must start {tr.TMA_ALIGN}-byte aligned (DeepGEMM loads it with TMA)"
    return None


def _page_stride(kv):
    return kv.stride(0) if kv.shape[0] > 1 else kv.shape[1] * kv.shape[2]


# ----------------------------------------------------------------------------------------------------
# Support checks (static facts only: device, arch, dtypes, shapes, static ints, host pointers' alignment)
# ----------------------------------------------------------------------------------------------------

def _supports_prefill(q, q_scale, k, k_scale, weights, width):
    why = _base_reason(q, k=k, k_scale=k_scale)
    if why:
        return why
    return tr.supports_dense(_arch(q.device), _fmt(q), q.shape[1], _head_dim(q), weights.dtype,
                             rows=q.shape[0], width=width, paged=False, num_kv=k.shape[0])


def _supports_decode(q, kv_cache, weights, width):
    kv = formats.as_3d_cache(kv_cache)
    why = _base_reason(q, kv_cache=kv)
    if why:
        return why
    return tr.supports_dense(_arch(q.device), _fmt(q), q.shape[1], _head_dim(q), weights.dtype,
                             rows=q.shape[0], width=width, paged=True, block_size=kv.shape[1],
                             page_stride_bytes=_page_stride(kv))


def _supports_sparse(q, weights, candidate_blocks, cbs, *, k=None, k_scale=None, kv_cache=None):
    if kv_cache is not None:
        kv = formats.as_3d_cache(kv_cache)
        why = _base_reason(q, kv_cache=kv)
    else:
        kv = None
        why = _base_reason(q, k=k, k_scale=k_scale)
    if why:
        return why
    return tr.supports_sparse(_arch(q.device), _fmt(q), q.shape[1], _head_dim(q), weights.dtype,
                              rows=q.shape[0], num_candidate_blocks=candidate_blocks.shape[1], cbs=cbs,
                              paged=kv is not None, block_size=None if kv is None else kv.shape[1],
                              page_stride_bytes=None if kv is None else _page_stride(kv),
                              num_kv=None if k is None else k.shape[0])


def supports_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, logits):
    return _supports_prefill(q, q_scale, k, k_scale, weights, logits.shape[1])


def supports_paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, logits):
    return _supports_decode(q, kv_cache, weights, logits.shape[1])


def supports_sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, logits):
    return _supports_sparse(q, weights, candidate_blocks, cbs, k=k, k_scale=k_scale)


def supports_paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                                     candidate_blocks, cbs, logits):
    return _supports_sparse(q, weights, candidate_blocks, cbs, kv_cache=kv_cache)


def supports_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, max_context, topk, cbs, workspace,
                             topk_indices, candidate_blocks):
    return _supports_prefill(q, q_scale, k, k_scale, weights, max_context)


def supports_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, max_context,
                            topk, cbs, workspace, topk_indices, candidate_blocks):
    return _supports_decode(q, kv_cache, weights, max_context)


def defer_decode(q, q_scale, kv_cache, weights, *rest) -> Optional[str]:
    """Why automatic dispatch leaves an SM90 dense decode call (``paged_mqa_logits``, ``indexer_decode``) to this
    library's Triton decode kernel, or None. Measured in one process on an H100 (run 117, ``benchmarks/NOTES.md``):
    our op 1.09-1.58x faster than it on DeepGEMM (the copy out of DeepGEMM's padded buffer included), and our
    composed decode step 1.08-1.51x faster than DeepGEMM's; on the H200, runs 3 and 103 agree (op, 128 rows of
    64K-128K). Prefill stays on DeepGEMM (its end-to-end step took up to 11% less time; the scoring ops alone were
    level, within 5% either way; runs 117-118), and so does SM100, where our kernels have not run."""
    if _arch(q.device) != "sm90" or "triton" in backends.disabled():
        return None
    for b in backends.candidates("paged_mqa_logits"):
        # The Triton backend's check reads only these four arguments (the op's logits are not at hand here).
        if b.name == "triton" and b.supports(q, q_scale, kv_cache, weights) is None:
            return "SM90 decode: this library's Triton kernel is faster (benchmarks/NOTES.md, run 117)"
    return None


def supports_sparse_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, topk,
                                    workspace, topk_indices):
    return _supports_sparse(q, weights, candidate_blocks, cbs, k=k, k_scale=k_scale)


def supports_sparse_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                                   candidate_blocks, cbs, topk, workspace, topk_indices):
    return _supports_sparse(q, weights, candidate_blocks, cbs, kv_cache=kv_cache)


# ----------------------------------------------------------------------------------------------------
# Copy-back / patch kernels (Triton). Integer arguments and pointer alignment are not specialized, so
# the variants a configuration launches are fixed by dtypes and constexprs alone (what warmup() covers).
# ----------------------------------------------------------------------------------------------------

def _jit(names):
    kw = {"do_not_specialize": names}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kw["do_not_specialize_on_alignment"] = names
    return triton.jit(**kw)


if triton is not None:
    _DENSE_ARGS = ["src_ptr", "src_stride", "dst_ptr", "dst_stride", "n_ptr", "L", "bt_ptr", "bt_stride",
                   "req_ptr", "MB", "NB"]

    @_jit(_DENSE_ARGS)
    def _dense_copy_kernel(src_ptr, src_stride, dst_ptr, dst_stride, n_ptr, L, bt_ptr, bt_stride, req_ptr, MB, NB,
                           BS: tl.constexpr, PAGED: tl.constexpr, BLOCK: tl.constexpr):
        """dst[r, c] = src[r, c] for c < n[r] (on a real page when PAGED), else -inf; c < L."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = cols < L
        n = tl.load(n_ptr + r)
        ok = inb & (cols < n)
        if PAGED:
            req = tl.load(req_ptr + r).to(tl.int64)
            bi = tl.minimum(cols // BS, MB - 1)
            page = tl.load(bt_ptr + req * bt_stride + bi, mask=ok, other=-1)
            ok = ok & (page >= 0) & (page < NB)
        v = tl.load(src_ptr + r * src_stride + cols, mask=ok, other=0.0).to(tl.float32)
        v = tl.where(ok, v, float("-inf"))
        tl.store(dst_ptr + r * dst_stride + cols, v.to(dst_ptr.dtype.element_ty), mask=inb)

    _PAGES_ARGS = ["buf_ptr", "stride", "n_ptr", "bt_ptr", "bt_stride", "req_ptr", "MB", "NB", "L"]

    @_jit(_PAGES_ARGS)
    def _bad_pages_kernel(buf_ptr, stride, n_ptr, bt_ptr, bt_stride, req_ptr, MB, NB, L,
                          BS: tl.constexpr, PB: tl.constexpr):
        """In place: -inf at positions < n[r] whose page id is outside [0, NB) (reads one id per page)."""
        r = tl.program_id(0).to(tl.int64)
        pg = tl.program_id(1).to(tl.int64) * PB + tl.arange(0, PB)
        n = tl.load(n_ptr + r)
        req = tl.load(req_ptr + r).to(tl.int64)
        inp = (pg < MB) & (pg * BS < n)
        page = tl.load(bt_ptr + req * bt_stride + pg, mask=inp, other=0)
        bad = inp & ((page < 0) | (page >= NB))
        cols = pg[:, None] * BS + tl.arange(0, BS)[None, :]
        m = bad[:, None] & (cols < n) & (cols < L)
        val = tl.full([PB, BS], float("-inf"), tl.float32).to(buf_ptr.dtype.element_ty)
        tl.store(buf_ptr + r * stride + cols, val, mask=m)

    _SPARSE_ARGS = ["src_ptr", "src_stride", "dst_ptr", "dst_stride", "slot_ptr", "cand_ptr", "NBK", "n_ptr",
                    "bt_ptr", "bt_stride", "req_ptr", "MB", "NB", "BS"]

    @_jit(_SPARSE_ARGS)
    def _sparse_copy_kernel(src_ptr, src_stride, dst_ptr, dst_stride, slot_ptr, cand_ptr, NBK, n_ptr,
                            bt_ptr, bt_stride, req_ptr, MB, NB, BS,
                            CBS: tl.constexpr, SBK: tl.constexpr, PAGED: tl.constexpr, BLOCK: tl.constexpr):
        """Our sparse layout from DeepGEMM's block prefix: dst[r, s*CBS+o] = src[r, slot[r,s]*SBK+o]."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = cols < NBK * CBS
        s = cols // CBS
        o = cols % CBS
        slot = tl.load(slot_ptr + r * NBK + s, mask=inb, other=-1).to(tl.int64)
        blk = tl.load(cand_ptr + r * NBK + s, mask=inb, other=-1).to(tl.int64)
        pos = blk * CBS + o
        n = tl.load(n_ptr + r)
        ok = inb & (slot >= 0) & (blk >= 0) & (pos < n)
        if PAGED:
            req = tl.load(req_ptr + r).to(tl.int64)
            bi = tl.minimum(pos // BS, MB - 1)
            page = tl.load(bt_ptr + req * bt_stride + bi, mask=ok, other=-1)
            ok = ok & (page >= 0) & (page < NB)
        v = tl.load(src_ptr + r * src_stride + slot * SBK + o, mask=ok, other=0.0).to(tl.float32)
        v = tl.where(ok, v, float("-inf"))
        tl.store(dst_ptr + r * dst_stride + cols, v.to(dst_ptr.dtype.element_ty), mask=inb)

    _SPAGES_ARGS = ["buf_ptr", "stride", "comp_ptr", "NBK", "bt_ptr", "bt_stride", "req_ptr", "MB", "NB", "BS"]

    @_jit(_SPAGES_ARGS)
    def _sparse_bad_pages_kernel(buf_ptr, stride, comp_ptr, NBK, bt_ptr, bt_stride, req_ptr, MB, NB, BS,
                                 CBS: tl.constexpr, QB: tl.constexpr):
        """In place on DeepGEMM's sparse buffer: -inf over its listed blocks (ids in ``comp``, blocks of CBS
        positions, -1 = not ours) that lie on out-of-range pages."""
        r = tl.program_id(0).to(tl.int64)
        q = tl.program_id(1).to(tl.int64) * QB + tl.arange(0, QB)
        inq = q < NBK
        blk = tl.load(comp_ptr + r * NBK + q, mask=inq, other=-1).to(tl.int64)
        has = inq & (blk >= 0)
        req = tl.load(req_ptr + r).to(tl.int64)
        bi = tl.minimum((blk * CBS) // BS, MB - 1)
        page = tl.load(bt_ptr + req * bt_stride + bi, mask=has, other=0)
        bad = has & ((page < 0) | (page >= NB))
        cols = q[:, None] * CBS + tl.arange(0, CBS)[None, :]
        val = tl.full([QB, CBS], float("-inf"), tl.float32).to(buf_ptr.dtype.element_ty)
        tl.store(buf_ptr + r * stride + cols, val, mask=bad[:, None])


_BLOCK = 1024


def _page_args(paged, n):
    """The copy kernels' page arguments ``(block_table, req, block_size, num_cache_blocks, table width, table row
    stride, PAGED)`` from ``paged = (block_table, req, block_size, num_cache_blocks)``, or placeholders (``n`` for
    the unused tensors) when the logits are not paged."""
    if paged is None:
        return n, n, 1, 1, 1, 0, False
    bt, req, bs, nb = paged
    return bt, req, bs, nb, bt.shape[1], bt.stride(0), True


def copy_dense(src, out, n, paged=None):
    """``out[r, c] = src[r, c]`` for ``c < n[r]`` (and on a real page: ``paged = (block_table, req, BS, NB)``),
    else -inf. ``src``: DeepGEMM's padded buffer (only its first ``out.shape[1]`` columns are read)."""
    R, L = out.shape
    if R == 0 or L == 0:
        return
    bt, req, bs, nb, mb, bts, flag = _page_args(paged, n)
    grid = (R, triton.cdiv(L, _BLOCK))
    _dense_copy_kernel[grid](src, src.stride(0), out, out.stride(0), n, L, bt, bts, req, mb, nb,
                             BS=bs, PAGED=flag, BLOCK=_BLOCK, num_warps=4)


def patch_bad_pages(buf, n, block_table, req, block_size, num_cache_blocks):
    """In place: -inf at positions ``< n[r]`` that lie on a page id outside ``[0, num_cache_blocks)``."""
    R, L = buf.shape
    mb = block_table.shape[1]
    if R == 0 or L == 0:
        return
    pb = max(1, min(64, 4096 // block_size))
    grid = (R, triton.cdiv(mb, pb))
    _bad_pages_kernel[grid](buf, buf.stride(0), n, block_table, block_table.stride(0), req, mb, num_cache_blocks, L,
                            BS=block_size, PB=pb, num_warps=4)


def copy_sparse(src, out, t, candidate_blocks, cbs, n, paged=None):
    """Our sparse layout from DeepGEMM's sparse output and its translation ``t`` (see
    ``deepgemm_translate.unpack_sparse``)."""
    R, W = out.shape
    nbk = candidate_blocks.shape[1]
    if R == 0 or W == 0:
        return
    bt, req, bs, nb, mb, bts, flag = _page_args(paged, n)
    grid = (R, triton.cdiv(W, _BLOCK))
    _sparse_copy_kernel[grid](src, src.stride(0), out, out.stride(0), t.slot_map, candidate_blocks, nbk, n,
                              bt, bts, req, mb, nb, bs, CBS=cbs, SBK=t.sbk, PAGED=flag, BLOCK=_BLOCK, num_warps=4)


def patch_sparse_bad_pages(buf, compact, cbs, block_table, req, block_size, num_cache_blocks):
    """In place on a sparse buffer whose slot j holds block ``compact[r, j]`` (of ``cbs`` positions; -1: skip):
    -inf over blocks on page ids outside ``[0, num_cache_blocks)``."""
    R = buf.shape[0]
    nbk = compact.shape[1]
    if R == 0:
        return
    qb = max(1, 1024 // cbs)
    grid = (R, triton.cdiv(nbk, qb))
    _sparse_bad_pages_kernel[grid](buf, buf.stride(0), compact, nbk, block_table, block_table.stride(0), req,
                                   block_table.shape[1], num_cache_blocks, block_size, CBS=cbs, QB=qb, num_warps=4)


# ----------------------------------------------------------------------------------------------------
# DeepGEMM calls
# ----------------------------------------------------------------------------------------------------

def _weights(weights, dtype):
    """Weights as DeepGEMM loads them by TMA: ``dtype``, ``stride(1) == 1``, 16-B aligned rows and base."""
    w = weights if weights.dtype == dtype else weights.to(dtype)
    es = w.element_size()
    T, H = w.shape
    if (T > 1 and (w.stride(0) * es) % tr.TMA_ALIGN) or (H > 1 and w.stride(1) != 1) or w.data_ptr() % tr.TMA_ALIGN:
        hp = (H * es + tr.TMA_ALIGN - 1) // tr.TMA_ALIGN * tr.TMA_ALIGN // es
        buf = torch.empty(T, hp, dtype=dtype, device=w.device)[:, :H]
        buf.copy_(w)
        w = buf
    return w


def _weights_dtype(arch):
    return torch.float32 if arch == "sm90" else torch.bfloat16


def _dg_prefill(dg, arch, q, q_scale, k, k_scale, w, ks, ke, width):
    if arch == "sm90":
        return dg.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, width)
    return dg.fp8_fp4_mqa_logits((q.view(torch.int8), q_scale), (k.view(torch.int8), k_scale), w, ks, ke, width)


def _dg_paged(dg, arch, q, q_scale, kv, w, rows, width):
    R, H = q.shape[0], q.shape[1]
    kv4 = kv.unsqueeze(2)  # DeepGEMM's [pages, page_kv, 1, bytes] view
    ctx = tr.context_lens_2d(rows.n)
    if arch == "sm90":
        meta = dg.get_paged_mqa_logits_metadata(ctx, kv.shape[1], dg.get_num_sms())
        return dg.fp8_fp4_paged_mqa_logits((q.view(R, 1, H, q.shape[2]), None), kv4, w, ctx, rows.block_table, meta,
                                           width)
    meta = dg.get_paged_mqa_logits_metadata(ctx, kv.shape[1], dg.get_num_sms(), rows.run_ids)
    qv = q.view(torch.int8).view(R, 1, H, q.shape[2])
    return dg.fp8_fp4_paged_mqa_logits((qv, q_scale.view(R, 1, H)), kv4, w, ctx, rows.block_table, meta, width,
                                       rows.run_ids)


def _dg_sparse_prefill(dg, q, q_scale, k, k_scale, w, ks, ke, candidate_blocks, cbs):
    t, ks_dg, ke_dg, n = tr.sparse_prefill_bounds(ks, ke, k.shape[0], candidate_blocks, cbs)
    sbk = t.sbk
    num_max = candidate_blocks.shape[1] * (cbs // sbk)
    # Our ks are arbitrary, so always the unaligned-ks convention (block b starts at b * sbk + ks % sbk).
    meta = dg.get_sparse_mqa_logits_metadata(ks_dg, ke_dg, k.shape[0], t.indices, torch.int8, sbk, True)
    out = dg.fp8_fp4_sparse_mqa_logits((q.view(torch.int8), q_scale), (k.view(torch.int8), k_scale), w, meta,
                                       num_max, sbk, True)
    return out, t, n


def _dg_sparse_paged(dg, q, q_scale, kv, w, rows, candidate_blocks, cbs):
    R, H = q.shape[0], q.shape[1]
    t = tr.translate_candidates(candidate_blocks, cbs, rows.n)
    sbk = t.sbk
    num_max = candidate_blocks.shape[1] * (cbs // sbk)
    meta = dg.get_paged_sparse_mqa_logits_metadata(rows.n, rows.block_table, rows.run_ids, kv.shape[1],
                                                   t.indices, torch.int8, sbk)
    qv = q.view(torch.int8).view(R, 1, H, q.shape[2])
    out = dg.fp8_fp4_paged_sparse_mqa_logits((qv, q_scale.view(R, 1, H)), kv.unsqueeze(2), w, meta, num_max, sbk)
    return out, t


# ----------------------------------------------------------------------------------------------------
# Op entry points (positional arguments in schema order; inputs already validated by ops.py)
# ----------------------------------------------------------------------------------------------------

def mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, logits):
    dg, arch = deep_gemm(), _arch(q.device)
    L = logits.shape[1]
    b = tr.prefill_bounds(ks, ke, k.shape[0], L)
    out = _dg_prefill(dg, arch, q, q_scale, k, k_scale, _weights(weights, _weights_dtype(arch)), b.ks, b.ke, L)
    copy_dense(out, logits, b.n)


def paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, logits):
    dg, arch = deep_gemm(), _arch(q.device)
    kv = formats.as_3d_cache(kv_cache)
    nb, bs = kv.shape[0], kv.shape[1]
    L = logits.shape[1]
    rows = tr.decode_rows(context_lens, block_table, req_indices, bs, nb, L)
    out = _dg_paged(dg, arch, q, q_scale, kv, _weights(weights, _weights_dtype(arch)), rows, L)
    copy_dense(out, logits, rows.n, paged=(block_table, rows.req, bs, nb))


def sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, logits):
    dg = deep_gemm()
    out, t, n = _dg_sparse_prefill(dg, q, q_scale, k, k_scale, _weights(weights, torch.bfloat16), ks, ke,
                                   candidate_blocks, cbs)
    copy_sparse(out, logits, t, candidate_blocks, cbs, n)


def paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                            candidate_blocks, cbs, logits):
    dg = deep_gemm()
    kv = formats.as_3d_cache(kv_cache)
    nb, bs = kv.shape[0], kv.shape[1]
    rows = tr.decode_rows(context_lens, block_table, req_indices, bs, nb)
    out, t = _dg_sparse_paged(dg, q, q_scale, kv, _weights(weights, torch.bfloat16), rows, candidate_blocks, cbs)
    copy_sparse(out, logits, t, candidate_blocks, cbs, rows.n, paged=(block_table, rows.req, bs, nb))


def _chunk_rows(total, workspace, width):
    # Same chunking as the composed ops (pipeline.py): DeepGEMM's per-chunk buffer is then about the size of
    # the workspace's logits region, so memory stays bounded by the caller's capacities.
    return max(1, min(total, ws_mod.rows_per_chunk(workspace.numel(), width)))


def indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, max_context, topk, cbs, workspace, topk_indices,
                    candidate_blocks):
    dg, arch = deep_gemm(), _arch(q.device)
    T = q.shape[0]
    w = _weights(weights, _weights_dtype(arch))
    rc = _chunk_rows(T, workspace, max_context)
    for r0 in range(0, T, rc):
        r1 = min(T, r0 + rc)
        b = tr.prefill_bounds(ks[r0:r1], ke[r0:r1], k.shape[0], max_context)
        qs = None if q_scale is None else q_scale[r0:r1]
        buf = _dg_prefill(dg, arch, q[r0:r1], qs, k, k_scale, w[r0:r1], b.ks, b.ke, max_context)
        # Our top-k reads only columns < n of DeepGEMM's padded rows: no copy, the garbage tail is never read.
        _ops.topk(buf, b.n, topk, topk_indices[r0:r1])
        if candidate_blocks is not None:
            _ops.block_topk(buf, b.n, cbs, candidate_blocks[r0:r1])


def indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, max_context, topk, cbs,
                   workspace, topk_indices, candidate_blocks):
    dg, arch = deep_gemm(), _arch(q.device)
    kv = formats.as_3d_cache(kv_cache)
    nb, bs = kv.shape[0], kv.shape[1]
    R = q.shape[0]
    w = _weights(weights, _weights_dtype(arch))
    rc = _chunk_rows(R, workspace, max_context)
    for r0 in range(0, R, rc):
        r1 = min(R, r0 + rc)
        ri = None if req_indices is None else req_indices[r0:r1]
        bt = block_table if ri is not None else block_table[r0:r1]
        rows = tr.decode_rows(context_lens[r0:r1], bt, ri, bs, nb, max_context)
        qs = None if q_scale is None else q_scale[r0:r1]
        buf = _dg_paged(dg, arch, q[r0:r1], qs, kv, w[r0:r1], rows, max_context)
        patch_bad_pages(buf, rows.n, bt, rows.req, bs, nb)
        _ops.topk(buf, rows.n, topk, topk_indices[r0:r1])
        if candidate_blocks is not None:
            _ops.block_topk(buf, rows.n, cbs, candidate_blocks[r0:r1])


def sparse_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, topk, workspace,
                           topk_indices):
    dg = deep_gemm()
    T = q.shape[0]
    w = _weights(weights, torch.bfloat16)
    rc = _chunk_rows(T, workspace, candidate_blocks.shape[1] * cbs)
    for r0 in range(0, T, rc):
        r1 = min(T, r0 + rc)
        buf, t, n = _dg_sparse_prefill(dg, q[r0:r1], q_scale[r0:r1], k, k_scale, w[r0:r1], ks[r0:r1], ke[r0:r1],
                                       candidate_blocks[r0:r1], cbs)
        # DeepGEMM's slot j holds block dg_candidates[j] (of sbk positions; -1 = filler): sparse_topk reads the
        # buffer directly through that list, no copy.
        _ops.sparse_topk(buf, t.dg_candidates, t.sbk, n, topk, topk_indices[r0:r1])


def sparse_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, candidate_blocks,
                          cbs, topk, workspace, topk_indices):
    dg = deep_gemm()
    kv = formats.as_3d_cache(kv_cache)
    nb, bs = kv.shape[0], kv.shape[1]
    R = q.shape[0]
    w = _weights(weights, torch.bfloat16)
    rc = _chunk_rows(R, workspace, candidate_blocks.shape[1] * cbs)
    for r0 in range(0, R, rc):
        r1 = min(R, r0 + rc)
        ri = None if req_indices is None else req_indices[r0:r1]
        bt = block_table if ri is not None else block_table[r0:r1]
        rows = tr.decode_rows(context_lens[r0:r1], bt, ri, bs, nb)
        buf, t = _dg_sparse_paged(dg, q[r0:r1], q_scale[r0:r1], kv, w[r0:r1], rows, candidate_blocks[r0:r1], cbs)
        patch_sparse_bad_pages(buf, t.dg_candidates, t.sbk, bt, rows.req, bs, nb)
        _ops.sparse_topk(buf, t.dg_candidates, t.sbk, rows.n, topk, topk_indices[r0:r1])


# ----------------------------------------------------------------------------------------------------
# Registration and warmup
# ----------------------------------------------------------------------------------------------------

_ENTRIES = {
    "mqa_logits": (mqa_logits, supports_mqa_logits),
    "paged_mqa_logits": (paged_mqa_logits, supports_paged_mqa_logits),
    "sparse_mqa_logits": (sparse_mqa_logits, supports_sparse_mqa_logits),
    "paged_sparse_mqa_logits": (paged_sparse_mqa_logits, supports_paged_sparse_mqa_logits),
    "indexer_prefill": (indexer_prefill, supports_indexer_prefill),
    "indexer_decode": (indexer_decode, supports_indexer_decode),
    "sparse_indexer_prefill": (sparse_indexer_prefill, supports_sparse_indexer_prefill),
    "sparse_indexer_decode": (sparse_indexer_decode, supports_sparse_indexer_decode),
}


_DEFER = {"paged_mqa_logits": defer_decode, "indexer_decode": defer_decode}


def register() -> None:
    """Register the DeepGEMM entries (idempotent). deep_gemm itself is imported on the first support check."""
    for op, (fn, sup) in _ENTRIES.items():
        backends.register(op, "deepgemm", fn, supports=sup, priority=PRIORITY, defer=_DEFER.get(op))


@_cudalib.on_device
def warmup(device, num_heads: int, head_dim: int, fmt: str, block_size: int = 64, cbs: int = 8, *,
           max_rows: int = 32, weights_dtype: Optional[torch.dtype] = None,
           logits_dtypes=(torch.float32,), num_candidate_blocks: Optional[int] = None, streams=()) -> list[str]:
    """JIT-compile every DeepGEMM kernel (and copy kernel) this configuration can launch, before capture.

    ``max_rows``: the most query rows one DeepGEMM call can get (a layer's row capacity, or its end-to-end
    chunk size); SM90's decode metadata kernel is compiled for every ``align(rows, 32)`` bucket up to it.
    ``num_candidate_blocks``: the consumer level's list width (SM100 sparse kernels are templated on it).
    ``streams``: extra streams that will capture graphs (SM100 sparse metadata zeroes a per-stream workspace
    on first use, which must not happen in capture); the default capture stream of ``torch.cuda.graph`` is
    always included. Returns what was warmed (for logs). Does nothing when the backend cannot run.
    """
    from .. import testing
    device = torch.device(device)
    warmed: list[str] = []
    if device.type != "cuda" or unavailable_reason():
        return warmed
    dg, arch = deep_gemm(), _arch(device)
    if arch is None:
        return warmed
    wd = weights_dtype or (torch.float32 if arch == "sm90" else torch.bfloat16)
    H, D = num_heads, head_dim
    T = 4
    qs = testing.make_queries(T, H, D, fmt, device=device)
    w = qs.weights.to(wd)
    k, ksc = testing.make_packed_k(320, D, fmt, device=device)
    ks = torch.zeros(T, dtype=torch.int32, device=device)
    ke = torch.full((T,), 40, dtype=torch.int32, device=device)
    case = testing.make_paged_cache([40, 64, 8, 30], block_size, D, fmt, device=device)
    lens = torch.tensor([40, 64, 8, 30], dtype=torch.int32, device=device)
    dense_pre = tr.supports_dense(arch, fmt, H, D, wd, rows=T, width=64, paged=False, num_kv=320) is None
    dense_dec = tr.supports_dense(arch, fmt, H, D, wd, rows=T, width=64, paged=True, block_size=block_size) is None
    for ld in logits_dtypes:
        if dense_pre:
            mqa_logits(qs.q, qs.q_scale, k, ksc, w, ks, ke, torch.empty(T, 64, dtype=ld, device=device))
            warmed.append(f"mqa_logits H{H} D{D} {fmt} -> {ld}")
        if dense_dec:
            paged_mqa_logits(qs.q, qs.q_scale, case.kv_cache, w, lens, case.block_table, None,
                             torch.empty(T, 64, dtype=ld, device=device))
            warmed.append(f"paged_mqa_logits H{H} D{D} {fmt} bs{block_size} -> {ld}")
    if dense_dec:
        kv = formats.as_3d_cache(case.kv_cache)
        buf = torch.empty(T, 64, dtype=torch.float32 if arch == "sm90" else torch.bfloat16, device=device)
        patch_bad_pages(buf, lens, case.block_table, torch.arange(T, dtype=torch.int32, device=device),
                        block_size, kv.shape[0])
        if arch == "sm90":
            for bucket in range(32, tr.sm90_metadata_bucket(max_rows) + 1, 32):
                dg.get_paged_mqa_logits_metadata(torch.ones(bucket, 1, dtype=torch.int32, device=device),
                                                 block_size, dg.get_num_sms())
            warmed.append(f"sm90 paged metadata buckets 32..{tr.sm90_metadata_bucket(max_rows)}")
        else:
            for r in sorted({min(max_rows, x) for x in (1, 513, 2049)}):
                z = torch.ones(r, 1, dtype=torch.int32, device=device)
                dg.get_paged_mqa_logits_metadata(z, block_size, dg.get_num_sms(),
                                                 torch.arange(r, dtype=torch.int32, device=device))
            warmed.append("sm100 paged metadata thread variants")
    nbk = num_candidate_blocks or 4
    sparse_pre = tr.supports_sparse(arch, fmt, H, D, wd, rows=T, num_candidate_blocks=nbk, cbs=cbs,
                                    paged=False, num_kv=320) is None
    sparse_dec = tr.supports_sparse(arch, fmt, H, D, wd, rows=T, num_candidate_blocks=nbk, cbs=cbs, paged=True,
                                    block_size=block_size, page_stride_bytes=_page_stride(
                                        formats.as_3d_cache(case.kv_cache))) is None
    if sparse_pre or sparse_dec:
        cand = testing.random_candidates([40] * T, nbk, cbs, device=device)
        streams = [None, _default_capture_stream()] + list(streams)
        for st in streams:
            ctx = torch.cuda.stream(st) if st is not None else _nullcontext()
            with ctx:
                for ld in logits_dtypes:
                    out = torch.empty(T, nbk * cbs, dtype=ld, device=device)
                    if sparse_pre:
                        sparse_mqa_logits(qs.q, qs.q_scale, k, ksc, w, ks, ke, cand, cbs, out)
                    if sparse_dec:
                        paged_sparse_mqa_logits(qs.q, qs.q_scale, case.kv_cache, w, lens, case.block_table, None,
                                                cand, cbs, out)
            if st is not None:
                st.synchronize()
        warmed.append(f"sparse H{H} cbs{cbs} nbk{nbk} on {len(streams)} streams")
    torch.cuda.synchronize(device)
    return warmed


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _default_capture_stream():
    """The side stream ``torch.cuda.graph`` captures on when none is given (created on first use)."""
    g = torch.cuda.graph(torch.cuda.CUDAGraph())  # constructing the context manager does not capture
    return getattr(g, "capture_stream", None) or torch.cuda.graph.default_capture_stream
