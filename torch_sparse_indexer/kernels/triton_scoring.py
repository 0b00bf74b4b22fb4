"""Triton scoring kernels (SM90 and SM100): ``mqa_logits``, ``paged_mqa_logits``, ``sparse_mqa_logits``,
``paged_sparse_mqa_logits``.

Math (SPEC section 2): ``logit[i, j] = s_j * sum_h w[i, h] * relu(q[i, h] . k[j])``, fp32 accumulation.

* FP8: the e4m3 dot runs on the fp8 tensor cores (``tl.dot`` on ``float8e4nv``); the per-token K scale is
  applied once after the head sum.
* MXFP4 on SM90 (no FP4 MMA): the dot still runs on the fp8 tensor cores, the e2m1 codes re-encoded
  in-register as e4m3 bytes; the cache is read at half the FP8 bytes. The row kernel folds the scales into the
  operands: a query head's groups as ``value * 2^(6 - (c - e))`` (``c`` its largest live-group exponent; exact
  within 14 binades), a K token's as ``value * 2^(6 - (ref - e))`` (``ref`` its largest group exponent; exact
  within 11 binades, looked up in a byte table moved down per group, two table permutes per 8 nibbles), so a
  tile is two K = D/2 MMAs into one accumulator, the heads' ``2^(c - 127)`` in the weights and the token's
  ``2^(ref - 127)`` applied after the head sum. A program that meets a query head or token whose scales do not
  fold (none, in quantized real activations) scores its columns again the per-group way: every nibble as the
  e4m3 byte of ``value * 2^-6`` (exact: e4m3 subnormals hold 0.5 * 2^-6), one K=32 MMA per 32-element group,
  each group's partial sum scaled by ``2^(eq + ek)``, the ``2^12`` of the re-encoding in the weights (relu is
  positively homogeneous). The other kernels take the per-group path.
* MXFP4 on SM100 (``torch.cuda.get_device_capability() >= (10, 0)``): ``tl.dot_scaled`` with e2m1 operands
  and the UE8M0 scale bytes (block-scaled MMA).

Launch rules: every grid is a function of static shapes only; lengths, ``ks/ke``, block tables and candidate
lists are read on the device and masked, following :mod:`torch_sparse_indexer.reference`'s clamping:
``ks/ke`` clamped to ``[0, N]``, decode lengths to ``[0, max_blocks * block_size]``, a request index outside
the block table gives a row of length 0, a page id outside the cache and a candidate id that is negative or
starts at or past the row length score ``-inf``. Nothing is allocated and nothing reads a device value on the
host. Integer arguments are not specialized (``do_not_specialize``), so the kernels a configuration uses are
exactly those :func:`warmup` compiles.

Sparse prefill can share K loads between neighbouring query rows (``TSI_SPARSE_PREFILL_PAIR=1``): one
program scores a *pair* of consecutive rows on the union of their candidate lists. Phase 1 walks row 0's
list and scores both rows on each block (row 1 keeps the result where the block is in its own list, found
by binary search); phase 2 walks the blocks of row 1's list that phase 1 did not cover, compacted on the
device, so a block shared by both rows is loaded and multiplied once. Every output slot is written whatever
the lists hold. On the H200 it measured slower than one row per program (benchmarks/NOTES.md), so the
default is the row kernel.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import backends, formats
from . import _cudalib
from .grid import row_tiles as _row_tiles

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Nibble -> e4m3 re-encoding in PTX, four bytes per instruction sequence (the interpreter runs the
# plain-Triton version of the same bit arithmetic).
_USE_ASM = not _INTERPRET and os.environ.get("TSI_TRITON_NO_ASM", "0") != "1"

_INT_ARGS = ["H", "NQ", "L", "OUT_STRIDE", "N", "NREQ", "MB", "BT_STRIDE", "NB_CACHE", "BS", "LBS", "PAGE_STRIDE",
             "NCAND", "CBS", "LCBS", "COLS", "W_STRIDE"]


# ----------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _lo_to_e4m3(b, USE_ASM: tl.constexpr):
    """Low nibbles of uint8 ``b`` (e2m1 codes) -> e4m3 bytes of ``value * 2^-6``: magnitude bits 0-2 go to
    bits 2-4 (exponent field = e2m1 exponent, subnormal for codes 0/1), sign bit 3 goes to bit 7."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; shl.b32 t, $1, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 $0, $1, 4; "
            "and.b32 $0, $0, 0x80808080; or.b32 $0, $0, t; }",
            "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return ((b & 7) << 2) | ((b & 8) << 4)


@triton.jit
def _hi_to_e4m3(b, USE_ASM: tl.constexpr):
    """High nibbles of ``b`` -> e4m3 bytes of ``value * 2^-6`` (bits 4-6 -> 2-4, bit 7 stays)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 $0, $1, 0x80808080; "
            "or.b32 $0, $0, t; }",
            "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return ((b >> 2) & 0x1C) | (b & 0x80)


@triton.jit
def _fp4_group_to_fp8(b, R: tl.constexpr, USE_ASM: tl.constexpr):
    """``b [R, 16]`` packed e2m1 bytes (one 32-element group) -> ``[R, 32]`` e4m3 in element order."""
    lo = _lo_to_e4m3(b, USE_ASM)
    hi = _hi_to_e4m3(b, USE_ASM)
    return tl.reshape(tl.join(lo, hi), (R, 32)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _ue8m0(word, g: tl.constexpr):
    """Byte ``g`` of an int32 scale word as the fp32 power of two ``2^(byte - 127)`` (byte 0: 2^-127)."""
    e = (word >> (8 * g)) & 0xFF
    bits = tl.where(e == 0, 0x00400000, e << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale_bytes(word, G: tl.constexpr):
    """``word [R]`` int32 -> ``[R, G]`` uint8 UE8M0 bytes (for ``tl.dot_scaled``)."""
    sh = tl.arange(0, G) * 8
    return ((word[:, None] >> sh[None, :]) & 0xFF).to(tl.uint8)


@triton.jit
def _load_q_fp8(q_ptr, qrow, qmask, D: tl.constexpr):
    """``qrow [M]`` int64 byte offsets of query-head rows -> ``[M, D]`` e4m3 (masked rows 0)."""
    d = tl.arange(0, D)
    qrow = tl.multiple_of(qrow, 16)
    v = tl.load(q_ptr + qrow[:, None] + d[None, :], mask=qmask[:, None], other=0)
    return v.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _q_group_bytes(q_ptr, qrow, qmask, g: tl.constexpr):
    """``[M, 16]`` packed e2m1 bytes of group ``g`` of the query-head rows at byte offsets ``qrow`` (masked: 0)."""
    d = tl.arange(0, 16)
    qrow = tl.multiple_of(qrow, 16)
    return tl.load(q_ptr + qrow[:, None] + g * 16 + d[None, :], mask=qmask[:, None], other=0)


@triton.jit
def _load_q_fp4_group(q_ptr, qrow, qmask, g: tl.constexpr, M: tl.constexpr, USE_ASM: tl.constexpr):
    return _fp4_group_to_fp8(_q_group_bytes(q_ptr, qrow, qmask, g), M, USE_ASM)


@triton.jit
def _e2m1_value(code):
    """e2m1 codes (int32, 0..15) -> fp32 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    m = code & 7
    p2 = (((m >> 1) + 125) << 23).to(tl.float32, bitcast=True)  # 2^(e - 2) for codes >= 2
    mag = tl.where(m < 2, m.to(tl.float32) * 0.5, (2 + (m & 1)).to(tl.float32) * p2)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _q_fold_base(q_ptr, qs_ptr, qrow, qsidx, qmask, MQ: tl.constexpr, D: tl.constexpr):
    """MXFP4 queries: per head the largest exponent ``C`` among its live groups (a group with a nonzero code) and
    ``ok``: every head's live groups lie within 14 binades of its ``C`` (then :func:`_q_fold_halves` is exact).
    Returns ``(C [MQ], ok scalar, scale words [MQ])``."""
    qw = tl.load(qs_ptr + qsidx, mask=qmask, other=0)
    b0 = _q_group_bytes(q_ptr, qrow, qmask, 0)
    b1 = _q_group_bytes(q_ptr, qrow, qmask, 1)
    if D == 128:
        b2 = _q_group_bytes(q_ptr, qrow, qmask, 2)
        b3 = _q_group_bytes(q_ptr, qrow, qmask, 3)
    else:
        b2 = tl.zeros((MQ, 16), tl.uint8)
        b3 = b2
    live0 = tl.max(b0 & 0x77, axis=1) != 0  # -0 (code 8) counts as zero
    live1 = tl.max(b1 & 0x77, axis=1) != 0
    live2 = tl.max(b2 & 0x77, axis=1) != 0
    live3 = tl.max(b3 & 0x77, axis=1) != 0
    e0 = qw & 0xFF
    e1 = (qw >> 8) & 0xFF
    e2 = (qw >> 16) & 0xFF
    e3 = (qw >> 24) & 0xFF
    c = tl.maximum(tl.maximum(tl.where(live0, e0, 0), tl.where(live1, e1, 0)),
                   tl.maximum(tl.where(live2, e2, 0), tl.where(live3, e3, 0)))
    okh = ((~live0 | (c - e0 <= 14)) & (~live1 | (c - e1 <= 14)) & (~live2 | (c - e2 <= 14))
           & (~live3 | (c - e3 <= 14)))
    ok = tl.min(okh.to(tl.int32), axis=0) == 1
    return c, ok, qw


@triton.jit
def _q_fold_halves(q_ptr, qrow, qmask, qw, c, MQ: tl.constexpr, D: tl.constexpr):
    """MXFP4 queries ``[MQ, D]`` (packed bytes at ``qrow``, scale words ``qw``) folded into e4m3 operands for the
    K-folded tiles (:func:`_kfold_operands`): each element as ``value * 2^(6 - (c - e))``, ``c`` its head's largest
    live-group exponent (:func:`_q_fold_base`), exact for ``c - e <= 14`` (e4m3 holds 0.5 * 2^-8 .. 6 * 2^6; a
    dead group's zeros stay zeros whatever its exponent). Returns ``(q1, q2)``, each ``[MQ, D/2]``, column
    ``4i + k`` holding element ``8i + k`` (q1) or ``8i + 4 + k`` (q2)."""
    VB: tl.constexpr = D // 2
    d = tl.arange(0, VB)
    b = tl.load(q_ptr + tl.multiple_of(qrow, 16)[:, None] + d[None, :], mask=qmask[:, None], other=0).to(tl.int32)
    code = tl.reshape(tl.join(b & 15, b >> 4), (MQ, D))  # element order
    e = (qw[:, None] >> ((tl.arange(0, D) // 32) * 8)[None, :]) & 0xFF
    f = ((133 - tl.minimum(tl.maximum(c[:, None] - e, 0), 14)) << 23).to(tl.float32, bitcast=True)
    v = tl.reshape(_e2m1_value(code) * f, (MQ, D // 8, 2, 4))
    lo, hi = tl.split(tl.permute(v, (0, 1, 3, 2)))
    return (tl.reshape(lo, (MQ, VB)).to(tl.float8e4nv), tl.reshape(hi, (MQ, VB)).to(tl.float8e4nv))


# e4m3 bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2^6, four to a word (magnitude code = byte
# index), and the per-byte step that lowers a nonzero entry's exponent by one (entry 0 stays 0).
_KF_LUT0 = tl.constexpr(0x6C686000)
_KF_LUT1 = tl.constexpr(0x7C787470)
_KF_STEP0 = tl.constexpr(0x08080800)
_KF_STEP1 = tl.constexpr(0x08080808)
# Largest spread (binades) between a token's group scales that the K-folded operand holds exactly: every nonzero
# entry of the table shifted down by d stays a normal e4m3 (0.5 * 2^(6 - 11) = 2^-6).
_KF_SPAN = tl.constexpr(11)


@triton.jit
def _kfold_operands(kb, d, USE_ASM: tl.constexpr):
    """``kb [R, VB]`` packed e2m1 bytes and ``d [R, VB]`` int32 (each byte's group: its token's largest group
    exponent minus the group's, at most ``_KF_SPAN``) -> ``(a1, a2)`` ``[R, VB]`` e4m3 of ``value * 2^(6 - d)``,
    word by word: column ``4i + k`` holds element ``8i + k`` (a1) or ``8i + 4 + k`` (a2), the order of
    :func:`_q_fold_halves`. Exact: no rounding happens for ``d <= _KF_SPAN``."""
    if USE_ASM:
        # Per 32-bit word (8 nibbles): the magnitudes index a byte table (prmt), the table moved down d binades
        # (two IMADs per word, no borrow for d <= 11); the sign of nibble k lands on bit 7 of output byte k
        # through a byte permute of w and w << 4.
        l0 = _KF_LUT0 - d * _KF_STEP0
        l1 = _KF_LUT1 - d * _KF_STEP1
        # (the MMA takes the result through shared memory: triton moves its register layout only through
        # elementwise ops of one operand)
        a1, a2 = tl.inline_asm_elementwise(
            "{ .reg .b32 m, s, t; and.b32 m, $2, 0x77777777; prmt.b32 $0, $3, $7, m; shr.b32 m, m, 16; "
            "prmt.b32 $1, $3, $7, m; shl.b32 t, $2, 4; prmt.b32 s, t, $2, 0x5140; and.b32 s, s, 0x80808080; "
            "or.b32 $0, $0, s; prmt.b32 s, t, $2, 0x7362; and.b32 s, s, 0x80808080; or.b32 $1, $1, s; }",
            "=r,=r,r,r,r,r,r,r,r,r,r", [kb, l0, l1], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        R: tl.constexpr = kb.shape[0]
        VB: tl.constexpr = kb.shape[1]
        x = tl.permute(tl.reshape(kb.to(tl.int32), (R, VB // 4, 2, 2)), (0, 1, 3, 2))  # [t, i, j, p]: byte 4i + 2p + j
        b1, b2 = tl.split(x)
        a1 = _kfold_bytes(tl.reshape(tl.join(b1 & 15, b1 >> 4), (R, VB)), d)
        a2 = _kfold_bytes(tl.reshape(tl.join(b2 & 15, b2 >> 4), (R, VB)), d)
    return a1.to(tl.float8e4nv, bitcast=True), a2.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _kfold_bytes(code, d):
    """Plain-Triton form of one table entry: e2m1 ``code`` -> the e4m3 byte of ``value * 2^(6 - d)``."""
    m = code & 7
    base = (((m >> 1) + 12) << 3) | tl.where(m >= 2, (m & 1) << 2, 0)
    mag = tl.where(m == 0, 0, base - 8 * d)
    return ((mag | ((code & 8) << 4)) & 0xFF).to(tl.uint8)


@triton.jit
def _kfold_tile(kv_ptr, koff, sc_ptr, sidx, kmask, q1, q2, D: tl.constexpr, BLOCK_N: tl.constexpr,
                USE_ASM: tl.constexpr):
    """MXFP4 K tile with its tokens' group scales folded into the e4m3 operand (SM90): returns ``(acc [BLOCK_N, MQ]
    = q.k * 2^(6 + 6 - ref - c + 2 * 127), ref [BLOCK_N] = each token's largest group exponent, bad [BLOCK_N])``;
    ``bad``: a token whose groups span more than ``_KF_SPAN`` binades or carry exponent 255 (its score from this
    tile is wrong and the caller rescores it)."""
    VB: tl.constexpr = D // 2
    G: tl.constexpr = D // 32
    word = tl.load(sc_ptr + sidx, mask=kmask, other=0)
    e0 = word & 0xFF
    e1 = (word >> 8) & 0xFF
    ref = tl.maximum(e0, e1)
    mn = tl.minimum(e0, e1)
    if G == 4:
        e2 = (word >> 16) & 0xFF
        e3 = (word >> 24) & 0xFF
        ref = tl.maximum(ref, tl.maximum(e2, e3))
        mn = tl.minimum(mn, tl.minimum(e2, e3))
    bad = (ref - mn > _KF_SPAN) | (ref == 255)
    d = ref[:, None] - ((word[:, None] >> ((tl.arange(0, VB) // 16) * 8)[None, :]) & 0xFF)
    c = tl.arange(0, VB)
    kb = tl.load(kv_ptr + tl.multiple_of(koff, 16)[:, None] + c[None, :], mask=kmask[:, None], other=0)
    a1, a2 = _kfold_operands(kb, d, USE_ASM)
    acc = tl.dot(a1, tl.trans(q1))
    acc = tl.dot(a2, tl.trans(q2), acc)
    return acc, ref, bad


@triton.jit
def _group_scale(word, g: tl.constexpr, sq):
    """Multiplier of group ``g``'s partial sums: the tokens' ``2^ek`` ``[BLOCK_N, 1]`` times the heads' ``2^eq``
    ``sq [MQ]``."""
    return _ue8m0(word, g)[:, None] * sq[None, :]


@triton.jit
def _tile_scores(kv_ptr, koff, sc_ptr, sidx, kmask, q8, qg0, qg1, qg2, qg3, sq0, sq1, sq2, sq3, qp, qsb, wv,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, MQ: tl.constexpr, FP4: tl.constexpr,
                 DOT_SCALED: tl.constexpr, USE_ASM: tl.constexpr):
    """Weighted-relu head terms of one K tile: returns ``(relu(q.k) * w [BLOCK_N, MQ], k_scale [BLOCK_N])``.

    ``koff [BLOCK_N]`` int64 byte offsets of each token's values; its scale word is ``sc_ptr[sidx]`` (fp32 for
    FP8, int32 UE8M0 bytes for MXFP4).
    FP8: ``q8 [MQ, D]``. MXFP4 (SM90, per-group: see :func:`_kfold_tile` for the folded tiles): per-group e4m3
    queries ``qg* [MQ, 32]`` and their fp32 scales ``sq* [MQ]``. MXFP4 (SM100): packed queries ``qp [MQ, D/2]``
    and scale bytes ``qsb [MQ, D/32]``.
    """
    koff = tl.multiple_of(koff, 16)
    if FP4:
        word = tl.load(sc_ptr + sidx, mask=kmask, other=0)
        if DOT_SCALED:
            d = tl.arange(0, D // 2)
            kb = tl.load(kv_ptr + koff[:, None] + d[None, :], mask=kmask[:, None], other=0)
            acc = tl.dot_scaled(kb, _scale_bytes(word, D // 32), "e2m1", tl.trans(qp), qsb, "e2m1")
        else:
            d = tl.arange(0, 16)
            kb = tl.load(kv_ptr + koff[:, None] + d[None, :], mask=kmask[:, None], other=0)
            part = tl.dot(_fp4_group_to_fp8(kb, BLOCK_N, USE_ASM), tl.trans(qg0))
            acc = part * _group_scale(word, 0, sq0)
            kb = tl.load(kv_ptr + koff[:, None] + 16 + d[None, :], mask=kmask[:, None], other=0)
            part = tl.dot(_fp4_group_to_fp8(kb, BLOCK_N, USE_ASM), tl.trans(qg1))
            acc += part * _group_scale(word, 1, sq1)
            if D == 128:
                kb = tl.load(kv_ptr + koff[:, None] + 32 + d[None, :], mask=kmask[:, None], other=0)
                part = tl.dot(_fp4_group_to_fp8(kb, BLOCK_N, USE_ASM), tl.trans(qg2))
                acc += part * _group_scale(word, 2, sq2)
                kb = tl.load(kv_ptr + koff[:, None] + 48 + d[None, :], mask=kmask[:, None], other=0)
                part = tl.dot(_fp4_group_to_fp8(kb, BLOCK_N, USE_ASM), tl.trans(qg3))
                acc += part * _group_scale(word, 3, sq3)
        ksc = tl.full((BLOCK_N,), 1.0, tl.float32)
    else:
        d = tl.arange(0, D)
        # Loaded as e4m3 (not bytes then bitcast) so the pipeliner streams it into shared memory for the MMA.
        kb = tl.load(kv_ptr.to(tl.pointer_type(tl.float8e4nv)) + koff[:, None] + d[None, :], mask=kmask[:, None],
                     other=0.0)
        acc = tl.dot(kb, tl.trans(q8))
        ksc = tl.load(sc_ptr + sidx, mask=kmask, other=0.0)
    # max.NaN: a NaN score from garbage cache bytes must stay NaN (SPEC 2); one instruction where the
    # compare-and-select form took two.
    return tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * wv[None, :], ksc


@triton.jit
def _paged_row(len_ptr, req_ptr, row, NREQ, MB, LBS, HAS_REQ: tl.constexpr):
    """A decode row's (context length, request) with the reference's clamping: the length to ``[0, MB << LBS]``,
    0 for a request index outside the block table (the index is then clamped into the table; nothing is read)."""
    n = tl.load(len_ptr + row)
    if HAS_REQ:
        req = tl.load(req_ptr + row)
    else:
        req = row
    n = tl.minimum(tl.maximum(n, 0), MB << LBS)
    n = tl.where((req >= 0) & (req < NREQ), n, 0)
    req = tl.minimum(tl.maximum(req, 0), NREQ - 1)
    return n, req


@triton.jit
def _load_queries(q_ptr, qs_ptr, qrow, qsidx, qmask, MQ: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr,
                  DOT_SCALED: tl.constexpr, USE_ASM: tl.constexpr):
    """Load the query operand(s) for ``MQ`` query-head rows (see :func:`_tile_scores`)."""
    q8 = tl.zeros((16, 32), tl.uint8)  # placeholders for the operands a format does not use
    qg0 = q8
    qg1 = q8
    qg2 = q8
    qg3 = q8
    one = tl.full((MQ,), 1.0, tl.float32)
    sq0 = one
    sq1 = one
    sq2 = one
    sq3 = one
    qp = tl.zeros((16, 16), tl.uint8)
    qsb = tl.zeros((16, 4), tl.uint8)
    if FP4:
        qw = tl.load(qs_ptr + qsidx, mask=qmask, other=0x7F7F7F7F)
        if DOT_SCALED:
            d = tl.arange(0, D // 2)
            qp = tl.load(q_ptr + tl.multiple_of(qrow, 16)[:, None] + d[None, :], mask=qmask[:, None], other=0)
            qsb = _scale_bytes(qw, D // 32)
        else:
            qg0 = _load_q_fp4_group(q_ptr, qrow, qmask, 0, MQ, USE_ASM)
            qg1 = _load_q_fp4_group(q_ptr, qrow, qmask, 1, MQ, USE_ASM)
            sq0 = _ue8m0(qw, 0)
            sq1 = _ue8m0(qw, 1)
            if D == 128:
                qg2 = _load_q_fp4_group(q_ptr, qrow, qmask, 2, MQ, USE_ASM)
                qg3 = _load_q_fp4_group(q_ptr, qrow, qmask, 3, MQ, USE_ASM)
                sq2 = _ue8m0(qw, 2)
                sq3 = _ue8m0(qw, 3)
    else:
        q8 = _load_q_fp8(q_ptr, qrow, qmask, D)
    return q8, qg0, qg1, qg2, qg3, sq0, sq1, sq2, sq3, qp, qsb


# ----------------------------------------------------------------------------------------------------
# Kernel 1: one query row per program (decode, dense and sparse; prefill sparse fallback)
# ----------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=_INT_ARGS,
            do_not_specialize_on_alignment=["w_ptr", "out_ptr", "a_ptr", "b_ptr", "bt_ptr", "req_ptr",
                                            "cand_ptr", "qs_ptr"])
def _rows_kernel(q_ptr, qs_ptr, w_ptr, kv_ptr, ksc_ptr, a_ptr, b_ptr, bt_ptr, req_ptr, cand_ptr, out_ptr,
                 H, L, OUT_STRIDE, N, NREQ, MB, BT_STRIDE, NB_CACHE, LBS, PAGE_STRIDE, NCAND, LCBS, W_STRIDE, COLS,
                 HP: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr, PAGED: tl.constexpr, SPARSE: tl.constexpr,
                 HAS_REQ: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, NUM_STAGES: tl.constexpr,
                 IDX_LOAD: tl.constexpr, PACK_IDS: tl.constexpr, DOT_SCALED: tl.constexpr,
                 USE_ASM: tl.constexpr, QFOLD: tl.constexpr = 0):
    """Program (row, chunk): columns ``[chunk * COLS, (chunk + 1) * COLS)`` of one query row; ``COLS`` is a
    multiple of ``BLOCK_N`` and at most ``TILES * BLOCK_N`` (a runtime value: see ``_row_tiles``).

    PAGED: ``a_ptr`` = context_lens, ``bt_ptr`` = block table, ``req_ptr`` = req_indices, ``kv_ptr`` = cache
    bytes. Packed: ``a_ptr/b_ptr`` = ks/ke, ``kv_ptr`` = K value bytes, ``ksc_ptr`` = K scales.
    Block sizes are powers of two passed as ``LBS = log2(block_size)``, ``LCBS = log2(cbs)``: the per-column
    index math is shifts and masks (a division by a runtime int costs ~20 instructions per element).
    ``IDX_LOAD``: each tile loads its candidate / page ids itself (no shared-memory gathers and their
    barriers) instead of gathering them from vectors loaded once per program. ``PACK_IDS`` (sparse, without
    ``IDX_LOAD``): one gather per tile of (page << 32 | block id), the block id -1 where the slot is invalid,
    instead of three gathers (block id, validity, page).
    ``QFOLD`` (MXFP4 on SM90): 1 scores a program's tiles with the query's and K's group scales folded into the
    e4m3 operands (:func:`_q_fold_base`, :func:`_kfold_tile`) and scores them again the per-group way when some
    scale did not fold exactly (a query head spanning more than 14 binades, a token more than ``_KF_SPAN``);
    0 scores every tile the per-group way.
    """
    BS = 1 << LBS
    CBS = 1 << LCBS
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    VB: tl.constexpr = D // 2 if FP4 else D
    if PAGED:
        n, req = _paged_row(a_ptr, req_ptr, row, NREQ, MB, LBS, HAS_REQ)
        ks_row = 0
    else:
        ks_row = tl.minimum(tl.maximum(tl.load(a_ptr + row), 0), N)
        ke_row = tl.maximum(tl.minimum(tl.load(b_ptr + row), N), ks_row)
        n = ke_row - ks_row
        req = 0

    h = tl.arange(0, HP)
    hmask = h < H
    qrow = (row.to(tl.int64) * H + h) * VB
    wv = tl.load(w_ptr + row.to(tl.int64) * W_STRIDE + h, mask=hmask, other=0.0).to(tl.float32)
    c_lo = chunk * COLS
    c_hi = tl.minimum(c_lo + COLS, L)
    if QFOLD == 1:
        qc, q_ok, qw = _q_fold_base(q_ptr, qs_ptr, qrow, row.to(tl.int64) * H + h, hmask, HP, D)
    if SPARSE:
        c_mid = c_hi
    else:
        # Dense rows: columns past the length only need -inf.
        c_mid = tl.minimum(c_hi, tl.maximum(c_lo, n))
    if PAGED:
        # The scale words live in the cache pages (4-byte aligned: page stride % 4 == 0).
        if FP4:
            sc_base = kv_ptr.to(tl.pointer_type(tl.int32))
        else:
            sc_base = kv_ptr.to(tl.pointer_type(tl.float32))
    else:
        sc_base = ksc_ptr
    out_row = out_ptr + row.to(tl.int64) * OUT_STRIDE
    cand_row = cand_ptr + row.to(tl.int64) * NCAND
    bt_row = bt_ptr + req.to(tl.int64) * BT_STRIDE
    offs = tl.arange(0, BLOCK_N)
    # Without IDX_LOAD, the program's candidate ids and page ids are loaded once, before the loop, and each
    # tile takes its ids by register gathers (shared memory and a barrier each). With IDX_LOAD each tile
    # loads its ids; triton 3.6's pipeliner streams those loads as earlier cp.async stages (v2's in-loop
    # loads were synchronous only because the K offsets were not provably 16-byte multiples).
    if SPARSE:
        nblk = (n + CBS - 1) >> LCBS
        if not IDX_LOAD:
            NS: tl.constexpr = TILES * BLOCK_N // 8  # cbs >= 8
            s0 = c_lo >> LCBS
            sl = s0 + tl.arange(0, NS)
            blkv = tl.load(cand_row + sl, mask=sl < tl.minimum(NCAND, (c_hi + CBS - 1) >> LCBS), other=-1)
            bval = (blkv >= 0) & (blkv < nblk)
            if PAGED:
                pagev = tl.load(bt_row + tl.where(bval, (blkv << LCBS) >> LBS, 0), mask=bval, other=-1)
            if PACK_IDS:
                blkv = tl.where(bval, blkv, -1)
                if PAGED:
                    pkv = (pagev.to(tl.int64) << 32) | (blkv.to(tl.int64) & 0xFFFFFFFF)
    else:
        if PAGED and not IDX_LOAD:
            NPG: tl.constexpr = TILES * BLOCK_N // 8  # >= pages a chunk can touch (block_size >= 16)
            p0 = c_lo >> LBS
            pi = p0 + tl.arange(0, NPG)
            pagev = tl.load(bt_row + pi, mask=(pi < MB) & ((pi << LBS) < tl.minimum(n, c_hi)), other=-1)
    # QFOLD = 1: the folded tiles first (rows whose queries fold), then, where a scale did not fold, every tile of
    # the program the per-group way (overwriting the columns). Real activations never need the second pass.
    nbad = c_lo * 0
    for mode in tl.static_range(2 if QFOLD == 1 else 1):
        if QFOLD == 1 and mode == 0:
            go = q_ok
        elif QFOLD == 1:
            go = (q_ok == 0) | (nbad != 0)
        else:
            go = c_lo >= 0
        if go:
            if QFOLD == 1 and mode == 0:
                q1, q2 = _q_fold_halves(q_ptr, qrow, hmask, qw, qc, HP, D)
                # operands: 2^(6 + e - c) per query group, 2^(6 + e - ref) per K group; ksc = 2^(ref - 127)
                wk = wv * _ue8m0(qc, 0) * (1.0 / 4096.0)
                badv = tl.zeros((BLOCK_N,), tl.int32)
            else:
                q8, qg0, qg1, qg2, qg3, sq0, sq1, sq2, sq3, qp, qsb = _load_queries(
                    q_ptr, qs_ptr, qrow, row.to(tl.int64) * H + h, hmask, HP, D, FP4, DOT_SCALED, USE_ASM)
                wk = wv
                if FP4 and not DOT_SCALED:
                    wk = wv * 4096.0  # the 2^-6 * 2^-6 of the e4m3 re-encoding
            for c0 in tl.range(c_lo, c_mid, BLOCK_N, num_stages=NUM_STAGES):
                cols = c0 + offs
                cmask = cols < c_hi
                if SPARSE:
                    if IDX_LOAD:
                        slot = cols >> LCBS
                        blk = tl.load(cand_row + slot, mask=cmask & (slot < NCAND), other=-1)
                        valid = cmask & (blk >= 0) & (blk < nblk)
                    elif PACK_IDS:
                        li = tl.minimum((cols - c_lo) >> LCBS, NS - 1)
                        if PAGED:
                            pk = tl.gather(pkv, li, 0)
                            blk = pk.to(tl.int32)  # the low half: the block id, -1 if invalid
                            page = (pk >> 32).to(tl.int32)
                        else:
                            blk = tl.gather(blkv, li, 0)
                        valid = cmask & (blk >= 0)
                    else:
                        li = tl.minimum((cols - c_lo) >> LCBS, NS - 1)
                        blk = tl.gather(blkv, li, 0)
                        valid = cmask & tl.gather(bval.to(tl.int32), li, 0).to(tl.int1)
                    pos = tl.where(valid, (blk << LCBS) + (cols & (CBS - 1)), 0)
                    valid = valid & (pos < n)
                    if PAGED:
                        if IDX_LOAD:
                            page = tl.load(bt_row + (pos >> LBS), mask=valid, other=-1)
                        elif not PACK_IDS:
                            page = tl.gather(pagev, li, 0)
                else:
                    pos = cols
                    valid = cmask & (pos < n)
                    if PAGED:
                        if IDX_LOAD:
                            page = tl.load(bt_row + (cols >> LBS), mask=valid, other=-1)
                        else:
                            page = tl.gather(pagev, tl.minimum(tl.maximum((cols >> LBS) - p0, 0), NPG - 1), 0)
                if PAGED:
                    valid = valid & (page >= 0) & (page < NB_CACHE)
                    page = tl.where(valid, page, 0).to(tl.int64)
                    off = (pos & (BS - 1)).to(tl.int64)
                    # page stride % 16 == 0 is checked on the host (supports): 16-byte vector copies
                    koff = (page * (PAGE_STRIDE // 16) + off * (VB // 16)) * 16
                    sidx = page * (PAGE_STRIDE // 4) + BS * (VB // 4) + off
                    sc_tile = sc_base
                else:
                    sidx = tl.where(valid, ks_row + pos, 0).to(tl.int64)
                    koff = sidx * VB
                    sc_tile = ksc_ptr
                if QFOLD == 1 and mode == 0:
                    acc, ref, bad = _kfold_tile(kv_ptr, koff, sc_tile, sidx, valid, q1, q2, D, BLOCK_N, USE_ASM)
                    terms = tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * wk[None, :]
                    ksc = _ue8m0(ref, 0)
                    badv = badv | bad.to(tl.int32)
                else:
                    terms, ksc = _tile_scores(kv_ptr, koff, sc_tile, sidx, valid, q8, qg0, qg1, qg2, qg3, sq0, sq1,
                                              sq2, sq3, qp, qsb, wk, D, BLOCK_N, HP, FP4, DOT_SCALED, USE_ASM)
                logit = tl.sum(terms, axis=1) * ksc
                logit = tl.where(valid, logit, float("-inf"))
                tl.store(out_row + cols, logit.to(out_ptr.dtype.element_ty), mask=cmask)
            if QFOLD == 1 and mode == 0:
                nbad = tl.max(badv, 0)  # (its barrier orders the column stores above before the rescoring's)
    ninf = tl.full((BLOCK_N,), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
    for c0 in range(c_lo + tl.cdiv(c_mid - c_lo, BLOCK_N) * BLOCK_N, c_hi, BLOCK_N):
        cols = c0 + offs
        tl.store(out_row + cols, ninf, mask=cols < c_hi)


# ----------------------------------------------------------------------------------------------------
# Kernel 1b: FP8 dense decode with the K tiles fetched by TMA (SM90; experimental, see _DENSE_DECODE_TMA)
# ----------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=_INT_ARGS,
            do_not_specialize_on_alignment=["w_ptr", "out_ptr", "a_ptr", "bt_ptr", "req_ptr", "kv_ptr"])
def _dense_decode_tma_kernel(q_ptr, w_ptr, kdesc, kv_ptr, a_ptr, bt_ptr, req_ptr, out_ptr,
                             H, L, OUT_STRIDE, NREQ, MB, BT_STRIDE, NB_CACHE, LBS, PAGE_STRIDE, W_STRIDE, COLS,
                             HP: tl.constexpr, D: tl.constexpr, HAS_REQ: tl.constexpr, T: tl.constexpr,
                             SUB: tl.constexpr, NUM_STAGES: tl.constexpr):
    """``paged_mqa_logits`` on an FP8 cache, program (row, chunk) as in :func:`_rows_kernel` (``COLS`` a multiple
    of ``SUB * T``), each tile of ``T`` tokens one TMA box ``[1, T, D]`` of the page view ``kdesc`` (``[NB, BS,
    D]`` e4m3, strides ``[PAGE_STRIDE, D, 1]``; ``T <= BS``, so a tile never leaves its page), ``SUB`` tiles per
    loop iteration (pages of 64 tokens, 128-token steps as the row kernel takes). The copy engine moves
    whole tiles, so the warps issue no per-thread copies or address arithmetic for K and the pipeline's loads
    stay in flight without occupying the load/store unit's per-thread request slots."""
    BS = 1 << LBS
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n, req = _paged_row(a_ptr, req_ptr, row, NREQ, MB, LBS, HAS_REQ)
    h = tl.arange(0, HP)
    hmask = h < H
    q8 = _load_q_fp8(q_ptr, (row.to(tl.int64) * H + h) * D, hmask, D)
    wv = tl.load(w_ptr + row.to(tl.int64) * W_STRIDE + h, mask=hmask, other=0.0).to(tl.float32)
    c_lo = chunk * COLS
    c_hi = tl.minimum(c_lo + COLS, L)
    c_mid = tl.minimum(c_hi, tl.maximum(c_lo, n))
    sc_base = kv_ptr.to(tl.pointer_type(tl.float32))
    out_row = out_ptr + row.to(tl.int64) * OUT_STRIDE
    bt_row = bt_ptr + req.to(tl.int64) * BT_STRIDE
    offs = tl.arange(0, T)
    for c00 in tl.range(c_lo, c_mid, SUB * T, num_stages=NUM_STAGES):
        for sub in tl.static_range(SUB):
            c0 = c00 + sub * T
            # (c0 < c_mid keeps the table read inside the row's pages: c_mid <= n <= MB * BS)
            page = tl.load(bt_row + (c0 >> LBS), mask=c0 < c_mid, other=-1)
            pv = (page >= 0) & (page < NB_CACHE)
            page = tl.where(pv, page, 0)
            off = c0 & (BS - 1)
            kb = kdesc.load([page, off, 0]).reshape(T, D)
            acc = tl.dot(kb, tl.trans(q8))
            cols = c0 + offs
            valid = cols < tl.where(pv, c_mid, c0)  # (a vector-scalar "&" is int32 in triton 3.9's interpreter)
            sidx = page.to(tl.int64) * (PAGE_STRIDE // 4) + BS * (D // 4) + off + offs
            ksc = tl.load(sc_base + sidx, mask=valid, other=0.0)
            terms = tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * wv[None, :]
            logit = tl.sum(terms, axis=1) * ksc
            logit = tl.where(valid, logit, float("-inf"))
            tl.store(out_row + cols, logit.to(out_ptr.dtype.element_ty), mask=cols < c_hi)
    ninf = tl.full((T,), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
    for c0 in range(c_lo + tl.cdiv(c_mid - c_lo, SUB * T) * SUB * T, c_hi, T):
        cols = c0 + offs
        tl.store(out_row + cols, ninf, mask=cols < c_hi)


# ----------------------------------------------------------------------------------------------------
# Kernel 2: dense prefill, a block of BQ query rows per program over absolute key windows
# ----------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=_INT_ARGS + ["NJ"],
            do_not_specialize_on_alignment=["w_ptr", "out_ptr", "a_ptr", "b_ptr", "qs_ptr", "ksc_ptr"])
def _prefill_dense_kernel(q_ptr, qs_ptr, w_ptr, k_ptr, ksc_ptr, a_ptr, b_ptr, out_ptr,
                          H, NQ, L, OUT_STRIDE, N, COLS, NJ, W_STRIDE,
                          HP: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr,
                          BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_SCALED: tl.constexpr,
                          USE_ASM: tl.constexpr):
    """Program (qb, j): rows ``[qb*BQ, qb*BQ + BQ)``. Valid scores are computed on absolute key windows
    ``[kmin + w*COLS, kmin + (w+1)*COLS)`` for ``w = j, j + NJ, ...`` (kmin/kmax: the block's key span), so
    every key tile is loaded once for all BQ rows and each output element has exactly one writer; ``-inf``
    goes to columns ``[j*COLS, (j+1)*COLS)`` at or past each row's length."""
    qb = tl.program_id(0)
    j = tl.program_id(1)
    VB: tl.constexpr = D // 2 if FP4 else D
    MQ: tl.constexpr = BQ * HP
    rb = qb * BQ + tl.arange(0, BQ)
    rok = rb < NQ
    ks = tl.minimum(tl.maximum(tl.load(a_ptr + rb, mask=rok, other=0), 0), N)
    ke = tl.maximum(tl.minimum(tl.load(b_ptr + rb, mask=rok, other=0), N), ks)
    ke = tl.where(rok, ke, ks)
    n = ke - ks
    has = n > 0
    kmin = tl.min(tl.where(has, ks, N), axis=0)
    kmax = tl.max(tl.where(has, ke, 0), axis=0)

    i = tl.arange(0, MQ)
    qr = qb * BQ + i // HP
    hh = i % HP
    qmask = (qr < NQ) & (hh < H)
    qidx = qr.to(tl.int64) * H + hh
    q8, qg0, qg1, qg2, qg3, sq0, sq1, sq2, sq3, qp, qsb = _load_queries(
        q_ptr, qs_ptr, qidx * VB, qidx, qmask, MQ, D, FP4, DOT_SCALED, USE_ASM)
    wv = tl.load(w_ptr + qr.to(tl.int64) * W_STRIDE + hh, mask=qmask, other=0.0).to(tl.float32)
    if FP4 and not DOT_SCALED:
        wv = wv * 4096.0

    offs = tl.arange(0, BLOCK_N)
    out_rows = out_ptr + rb.to(tl.int64) * OUT_STRIDE
    w0 = kmin + j * COLS
    while w0 < kmax:
        w1 = tl.minimum(w0 + COLS, kmax)
        for t0 in tl.range(w0, w1, BLOCK_N, num_stages=NUM_STAGES):
            key = t0 + offs
            kval = key < w1
            key64 = tl.where(kval, key, 0).to(tl.int64)
            terms, ksc = _tile_scores(k_ptr, key64 * VB, ksc_ptr, key64, kval, q8, qg0, qg1, qg2, qg3, sq0,
                                      sq1, sq2, sq3, qp, qsb, wv, D, BLOCK_N, MQ, FP4, DOT_SCALED, USE_ASM)
            s = tl.sum(tl.reshape(terms, (BLOCK_N, BQ, HP)), axis=2) * ksc[:, None]  # [BLOCK_N, BQ]
            ok = kval[:, None] & (key[:, None] >= ks[None, :]) & (key[:, None] < ke[None, :])
            col = key[:, None] - ks[None, :]
            tl.store(out_rows[None, :] + col, s.to(out_ptr.dtype.element_ty), mask=ok)
        w0 += NJ * COLS
    # -inf past each row's length, in this program's column chunk.
    ninf = tl.full((BQ, BLOCK_N), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
    c_lo = j * COLS
    c_hi = tl.minimum(c_lo + COLS, L)
    nmin = tl.min(tl.where(rok, n, L), axis=0)
    for c0 in range(tl.maximum(c_lo, (nmin // BLOCK_N) * BLOCK_N), c_hi, BLOCK_N):
        cols = c0 + offs
        m = rok[:, None] & (cols[None, :] < c_hi) & (cols[None, :] >= n[:, None])
        tl.store(out_rows[:, None] + cols[None, :], ninf, mask=m)


# ----------------------------------------------------------------------------------------------------
# Kernel 3: sparse prefill, a pair of consecutive query rows per program on the union of their lists
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _lower_bound(row_ptr, x, NCAND, LOG2: tl.constexpr):
    """Vectorized lower bound of ``x`` in the candidate row (negative ids read as +inf)."""
    lo = tl.zeros(x.shape, tl.int32)
    cnt = tl.full(x.shape, 0, tl.int32) + NCAND
    for _ in tl.static_range(LOG2 + 1):
        half = cnt // 2
        mid = lo + half
        v = tl.load(row_ptr + tl.minimum(mid, NCAND - 1), mask=cnt > 0, other=0)
        v = tl.where(v < 0, 2147483647, v)
        go = (cnt > 0) & (v < x)
        lo = tl.where(go, mid + 1, lo)
        cnt = tl.where(go, cnt - half - 1, half)
    return lo


@triton.jit(do_not_specialize=_INT_ARGS,
            do_not_specialize_on_alignment=["w_ptr", "out_ptr", "a_ptr", "b_ptr", "cand_ptr", "qs_ptr",
                                            "ksc_ptr"])
def _prefill_pair_kernel(q_ptr, qs_ptr, w_ptr, k_ptr, ksc_ptr, a_ptr, b_ptr, cand_ptr, out_ptr,
                         H, NQ, OUT_STRIDE, N, NCAND, CBS, W_STRIDE,
                         HP: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAND_P2: tl.constexpr, LOG2: tl.constexpr, NUM_STAGES: tl.constexpr,
                         DOT_SCALED: tl.constexpr, USE_ASM: tl.constexpr):
    """Program p: rows ``2p`` and ``2p + 1`` (sparse layout, ``NCAND`` slots of ``CBS`` columns each)."""
    p = tl.program_id(0)
    VB: tl.constexpr = D // 2 if FP4 else D
    MQ: tl.constexpr = 2 * HP
    r0 = 2 * p
    r1 = r0 + 1
    has1 = r1 < NQ
    r1c = tl.minimum(r1, NQ - 1)
    ks0 = tl.minimum(tl.maximum(tl.load(a_ptr + r0), 0), N)
    n0 = tl.maximum(tl.minimum(tl.load(b_ptr + r0), N), ks0) - ks0
    ks1 = tl.minimum(tl.maximum(tl.load(a_ptr + r1c), 0), N)
    n1 = tl.maximum(tl.minimum(tl.load(b_ptr + r1c), N), ks1) - ks1
    # Rows of different requests (different ks) share no K rows: row 1 then takes everything in phase 2.
    pair = has1 & (ks0 == ks1)

    i = tl.arange(0, MQ)
    qr = tl.minimum(r0 + i // HP, NQ - 1)
    hh = i % HP
    # Row r0 + i // HP exists (the second row only when has1); compared per element, not through the scalar
    # has1, whose broadcast the interpreter turns into an integer mask.
    qmask = (hh < H) & (r0 + i // HP < NQ)
    qidx = qr.to(tl.int64) * H + hh
    q8, qg0, qg1, qg2, qg3, sq0, sq1, sq2, sq3, qp, qsb = _load_queries(
        q_ptr, qs_ptr, qidx * VB, qidx, qmask, MQ, D, FP4, DOT_SCALED, USE_ASM)
    wv = tl.load(w_ptr + qr.to(tl.int64) * W_STRIDE + hh, mask=qmask, other=0.0).to(tl.float32)
    if FP4 and not DOT_SCALED:
        wv = wv * 4096.0

    c0_row = cand_ptr + r0.to(tl.int64) * NCAND
    c1_row = cand_ptr + r1c.to(tl.int64) * NCAND
    o0_row = out_ptr + r0.to(tl.int64) * OUT_STRIDE
    o1_row = out_ptr + r1c.to(tl.int64) * OUT_STRIDE
    nb0 = (n0 + CBS - 1) // CBS
    nb1 = (n1 + CBS - 1) // CBS
    offs = tl.arange(0, BLOCK_N)
    L = NCAND * CBS

    # Row 1's slot for each of row 0's slots (-1: not in row 1), for the whole list at once so the
    # per-tile work is a register gather, not a chain of dependent loads.
    si = tl.arange(0, CAND_P2)
    b0v = tl.load(c0_row + si, mask=si < NCAND, other=-1)
    j1v = _lower_bound(c1_row, tl.where(b0v < 0, 2147483647, b0v), NCAND, LOG2)
    b1at = tl.load(c1_row + tl.minimum(j1v, NCAND - 1), mask=si < NCAND, other=-1)
    map1 = tl.where(pair & (b0v >= 0) & (j1v < NCAND) & (b1at == b0v), j1v, -1)
    nkey = tl.maximum(n0, tl.where(pair, n1, 0))

    # Phase 1: row 0's slots, both rows scored on each block.
    for c0 in tl.range(0, L, BLOCK_N, num_stages=NUM_STAGES):
        cols = c0 + offs
        cmask = cols < L
        slot = cols // CBS
        t = cols % CBS
        slot_c = tl.minimum(slot, CAND_P2 - 1)
        blk = tl.where(cmask, tl.gather(b0v, slot_c, 0), -1)  # register gather: keeps the K load pipelined
        j1 = tl.gather(map1, slot_c, 0)
        in1 = cmask & (j1 >= 0)
        # K rows are loaded for either row's range (row 1's mapping only decides where its score goes).
        kval = cmask & (blk >= 0) & (blk < (nkey + CBS - 1) // CBS)
        pos = tl.where(kval, blk * CBS + t, 0)
        kval = kval & (pos < nkey)
        v0 = kval & (pos < n0)
        v1 = in1 & kval & (pos < n1)
        key = tl.where(kval, ks0 + pos, 0).to(tl.int64)
        terms, ksc = _tile_scores(k_ptr, key * VB, ksc_ptr, key, kval, q8, qg0, qg1, qg2, qg3, sq0, sq1, sq2,
                                  sq3, qp, qsb, wv, D, BLOCK_N, MQ, FP4, DOT_SCALED, USE_ASM)
        s = tl.sum(tl.reshape(terms, (BLOCK_N, 2, HP)), axis=2) * ksc[:, None]
        s0, s1 = tl.split(s)
        tl.store(o0_row + cols, tl.where(v0, s0, float("-inf")).to(out_ptr.dtype.element_ty), mask=cmask)
        c1 = j1 * CBS + t
        tl.store(o1_row + c1, tl.where(v1, s1, float("-inf")).to(out_ptr.dtype.element_ty), mask=in1)

    # Phase 2: row 1's slots not written by phase 1, compacted. Slot i of row 1 was written iff its block is
    # found in row 0 at j = lower_bound and row 0's block j maps back to slot i.
    simask = si < tl.where(has1, NCAND, 0)  # (not has1 & ...: see qmask)
    b1v = tl.load(c1_row + si, mask=simask, other=-1)
    j0 = _lower_bound(c0_row, tl.where(b1v < 0, 2147483647, b1v), NCAND, LOG2)
    b0 = tl.load(c0_row + tl.minimum(j0, NCAND - 1), mask=simask, other=-1)
    back = _lower_bound(c1_row, tl.where(b0 < 0, 2147483647, b0), NCAND, LOG2)
    done = pair & (b1v >= 0) & (j0 < NCAND) & (b0 == b1v) & (back == si)
    todo = simask & ~done
    incl = tl.cumsum(todo.to(tl.int32), axis=0)
    m = tl.sum(todo.to(tl.int32), axis=0)
    SPT: tl.constexpr = BLOCK_N // 8  # at most this many slots per tile (cbs >= 8, BLOCK_N >= cbs)
    jj = tl.arange(0, SPT)
    for s0i in tl.range(0, m * CBS, BLOCK_N, num_stages=NUM_STAGES):
        cols = s0i + offs  # compacted column index
        k = cols // CBS
        t = cols % CBS
        cmask = k < m
        # Slot of the k-th to-do entry = number of slots whose inclusive count is <= k; computed for the
        # tile's few distinct k, then spread to its columns.
        kb0 = s0i // CBS
        slj = tl.sum((incl[None, :] <= (kb0 + jj)[:, None]).to(tl.int32), axis=1)  # [SPT]
        sl = tl.sum(tl.where((k - kb0)[:, None] == jj[None, :], slj[None, :], 0), axis=1)
        sl = tl.minimum(sl, NCAND - 1)
        blk = tl.where(cmask, tl.gather(b1v, sl, 0), -1)
        v1 = cmask & (blk >= 0) & (blk < nb1)
        pos = tl.where(v1, blk * CBS + t, 0)
        v1 = v1 & (pos < n1)
        key = tl.where(v1, ks1 + pos, 0).to(tl.int64)
        terms, ksc = _tile_scores(k_ptr, key * VB, ksc_ptr, key, v1, q8, qg0, qg1, qg2, qg3, sq0, sq1, sq2,
                                  sq3, qp, qsb, wv, D, BLOCK_N, MQ, FP4, DOT_SCALED, USE_ASM)
        s = tl.sum(tl.reshape(terms, (BLOCK_N, 2, HP)), axis=2) * ksc[:, None]
        s0, s1 = tl.split(s)
        tl.store(o1_row + sl * CBS + t, tl.where(v1, s1, float("-inf")).to(out_ptr.dtype.element_ty),
                 mask=cmask)


# ----------------------------------------------------------------------------------------------------
# Launch configuration (static facts only) and launchers
# ----------------------------------------------------------------------------------------------------

def _dot_scaled_default(device) -> bool:
    if _INTERPRET or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (10, 0)


_FORCE_DOT_SCALED: bool | None = None  # tests set this to run the SM100 code path where it is emulated


def _use_dot_scaled(device) -> bool:
    return _dot_scaled_default(device) if _FORCE_DOT_SCALED is None else _FORCE_DOT_SCALED


def _heads_pad(H: int) -> int:
    return max(16, triton.next_power_of_2(H))


# Benchmarks may override a launch configuration per kernel family ("rows", "prefill_dense", "pair"), and the
# row kernel's tiles per program ("row_tiles"), to compare alternatives; the defaults below are what the library
# launches (fixed, so results never depend on timing-based tuning).
CONFIG_OVERRIDES: dict = {}


# Tiles per row program: fixed, so the per-program index vectors have a static size (and the grid is
# rows x ceil(L / (tiles * BLOCK_N))).
_ROW_TILES = 16


_ROW_DEFAULT = (64, 4, 3, _ROW_TILES, False, False, None, None)
# FP8 dense decode and FP8 sparse prefill with 128 heads (up to 64: below): 128-token tiles whose ids are loaded
# per tile measured 7-9% faster on the H200 (724 vs 777 us, 2321 vs 2540 us at 64 heads; benchmarks/NOTES.md,
# v3); paged sparse decode and MXFP4 were slower that way (148 vs 110 us), so they keep the default.
_ROW_WIDE = (128, 4, 3, _ROW_TILES, True, False, None, None)
# Paged sparse decode: ids packed into one shared-memory gather per tile (14 barriers per program instead of
# 38) measured 110 -> 98 us (FP8, 128-token tiles) and 186 -> 172 us (MXFP4, 32 tiles) on the H200
# (benchmarks/NOTES.md, v4).
# The last element, CTAs per SM on the H200 (FP8: 62 KB of shared memory in a local sm_90a compile; MXFP4: 210
# registers, Nsight Compute), lets _row_tiles size the programs so that the grid fills whole waves (see there;
# on another GPU a wrong count only changes that estimate).
_ROW_SPARSE_DECODE = {False: (128, 4, 3, 2 * _ROW_TILES, False, True, None, 3),
                      True: (64, 4, 3, 4 * _ROW_TILES, False, True, None, 2)}
# MXFP4 with the query and K group scales folded into the e4m3 operands (QFOLD = 1; benchmarks/NOTES.md, session 9):
# the per-group rescoring in the same kernel (a query or token whose scales do not fold: none in real activations)
# needs 230+ registers and spills under the cap, which only the folded tiles have to fit. Paged sparse decode:
# 128-token tiles on one warpgroup, three CTAs per SM, measured 117-119 us at the target shape (64-token tiles with
# four CTAs 136 us, the per-group kernel 164: runs 50-51); paged dense decode the same way 832 us at 128 x 128K
# (64-token tiles 1004, per-group 1206: run 53). Packed K (prefill rows; not measured): 64-token tiles, four CTAs.
_ROW_SPARSE_DECODE_QFOLD = (128, 4, 3, 2 * _ROW_TILES, False, True, 168, 3)
_ROW_DENSE_DECODE_QFOLD = (128, 4, 3, _ROW_TILES, False, False, 168, 3)
_ROW_QFOLD = (64, 4, 3, _ROW_TILES, False, False, 128, 4)
# FP8 dense decode on SM90, up to 64 heads: two stages and at most 96 registers per thread let 5 CTAs share an
# SM (3 with three stages: shared memory; 4 at 112 registers), more K tiles in flight per SM than deeper
# per-CTA pipelines give: 128 x 128K measured 696 -> 614-620 us on the H200 (benchmarks/NOTES.md, v5). Sparse
# decode went the other way (95 -> 103-112 us): its gathered 1 KB blocks want the deeper per-CTA prefetch.
# With 128 heads the accumulator alone takes 128 registers, so the cap stays off there; SM100 (another MMA and
# pipeliner, not measured) keeps the previous configuration. Programs sized by _row_tiles (up to 32 tiles, 5 CTAs
# per SM): 624 -> 619 us at 128 x 128K (25-tile programs; NOTES.md, v6).
_ROW_DENSE_DECODE = (128, 4, 2, 2 * _ROW_TILES, True, False, 96, 5)
# FP8 sparse prefill (one row per program) on SM90, up to 64 heads: the same occupancy argument; 2160 -> 1629 us
# (510 -> 675 TFLOP/s useful) at 4096 x 16K candidates on the H200 (benchmarks/NOTES.md, v5).
_ROW_SPARSE_PREFILL = (128, 4, 2, 2 * _ROW_TILES, True, False, 96, None)


# FP8 dense decode through TMA tiles (_dense_decode_tma_kernel): (tokens per tile, warps, stages, loop iterations per
# program (at most), register cap or None, CTAs per SM or None[, tiles per iteration, default 1]). Off (None) until
# it measures faster than _ROW_DENSE_DECODE on the H200, whose gap to DeepGEMM (0.89-0.92x, none on an H100) may
# come from per-thread copies keeping too little of its bandwidth in flight (benchmarks/NOTES.md, session 36); on an
# H100 it runs level with the row kernel, bitwise equal. CONFIG_OVERRIDES["dense_tma"] switches it on.
_DENSE_DECODE_TMA = None


def _dense_tma_config(block_size: int):
    """The TMA dense decode's configuration for a cache of ``block_size`` tokens per page, or None (the row
    kernel runs): off by default, and only for pages of at least 64 tokens (a tile is at most one page and
    at least one wgmma M)."""
    cfg = CONFIG_OVERRIDES.get("dense_tma", _DENSE_DECODE_TMA)
    if cfg is None or block_size < 64:
        return None
    return (min(cfg[0], block_size),) + tuple(cfg[1:])


def _rows_config(HP: int, fp4: bool, paged: bool = True, sparse: bool = True, sm90: bool = True, qfold: bool = False):
    """(BLOCK_N, warps, stages, tiles per program (at most), per-tile index loads, packed ids, register cap or
    None, CTAs per SM or None) of the row kernel (``qfold``: ``QFOLD = 1``); an override may stop after any
    leading prefix of that tuple (the rest come from the default)."""
    if "rows" in CONFIG_OVERRIDES:
        cfg = tuple(CONFIG_OVERRIDES["rows"])
        return cfg + _ROW_DEFAULT[len(cfg):]
    if fp4 and qfold:
        if paged:
            return _ROW_SPARSE_DECODE_QFOLD if sparse else _ROW_DENSE_DECODE_QFOLD
        return _ROW_QFOLD
    if paged and sparse:
        return _ROW_SPARSE_DECODE[fp4]
    if not fp4 and HP <= 64 and paged != sparse and sm90:
        return _ROW_DENSE_DECODE if paged else _ROW_SPARSE_PREFILL
    if not fp4 and paged != sparse:
        return _ROW_WIDE
    return _ROW_DEFAULT


def _chunk_cols(rows: int, width: int, block_n: int, sms: int, waves: int = 32, min_tiles: int = 4) -> int:
    """Columns per program: about ``waves`` programs per SM (so the last wave's tail is a small fraction),
    at least ``min_tiles`` tiles each."""
    cols = triton.cdiv(max(1, rows * width), max(1, sms * waves))
    cols = max(min_tiles * block_n, triton.cdiv(cols, block_n) * block_n)
    return min(cols, max(block_n, triton.cdiv(width, block_n) * block_n))


def _program_tiles(rows: int, width: int, block_n: int, tiles: int, ctas, device) -> int:
    """Tiles per program the row kernel launches with: a forced count (``CONFIG_OVERRIDES["row_tiles"]``, tests
    and benchmarks), else ``_row_tiles`` for configurations that know their CTAs per SM, else ``tiles``."""
    if "row_tiles" in CONFIG_OVERRIDES:
        return max(1, min(tiles, int(CONFIG_OVERRIDES["row_tiles"])))
    if ctas:
        return _row_tiles(rows, width, block_n, tiles, ctas * _cudalib.num_sms(device))
    return tiles


def _q_bytes(q):
    return q.view(torch.uint8) if q.dtype != torch.uint8 else q


def _launch_rows(q, q_scale, weights, logits, *, paged, sparse, kv=None, k_scale=None, ks=None, ke=None,
                 context_lens=None, block_table=None, req_indices=None, candidate_blocks=None, cbs=1,
                 block_size=1, num_cache_blocks=1, page_stride=0, tma=True):
    fp4 = q.dtype != formats.FP8_DTYPE
    R, H, dq = q.shape
    D = dq * 2 if fp4 else dq
    L = logits.shape[1]
    if R == 0 or L == 0:
        return
    HP = _heads_pad(H)
    sm90 = not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] == 9  # the interpreter: the SM90 path
    dot_scaled = fp4 and _use_dot_scaled(q.device)
    dummy = context_lens if paged else ks
    if paged:
        a, b = context_lens, context_lens
        bt = block_table
        req = req_indices if req_indices is not None else context_lens
        nreq, mb, bt_stride = block_table.shape[0], block_table.shape[1], block_table.stride(0)
        kscale = dummy
        N = 0
    else:
        a, b = ks, ke
        bt = req = dummy
        nreq, mb, bt_stride = 1, 1, 0
        kscale = k_scale
        N = kv.shape[0]
    if tma and paged and not sparse and not fp4 and sm90 and _launch_dense_tma(
            q, weights, logits, kv, context_lens, block_table, req_indices, block_size, num_cache_blocks,
            page_stride):
        return
    cand = candidate_blocks if sparse else dummy
    ncand = candidate_blocks.shape[1] if sparse else 1
    # MXFP4 on SM90: scales folded into the operands, the per-group way where they do not fold (QFOLD = 1)
    qfold = fp4 and not dot_scaled and CONFIG_OVERRIDES.get("qfold", True)
    block_n, warps, stages, tiles, idx_load, pack_ids, maxnreg, ctas = _rows_config(HP, fp4, paged, sparse, sm90,
                                                                                     qfold)
    nt = _program_tiles(R, L, block_n, tiles, ctas, q.device)
    grid = (R, triton.cdiv(L, nt * block_n))
    _rows_kernel[grid](
        _q_bytes(q), q_scale if q_scale is not None else dummy, weights, kv, kscale, a, b, bt, req, cand, logits,
        H, L, logits.stride(0), N, nreq, mb, bt_stride, num_cache_blocks, formats.log2_block_size(block_size),
        page_stride, ncand, formats.log2_block_size(cbs), weights.stride(0), nt * block_n,
        HP=HP, D=D, FP4=fp4, PAGED=paged, SPARSE=sparse, HAS_REQ=paged and req_indices is not None,
        BLOCK_N=block_n, TILES=tiles, NUM_STAGES=stages, IDX_LOAD=idx_load, PACK_IDS=pack_ids and sparse,
        DOT_SCALED=dot_scaled, USE_ASM=_USE_ASM, QFOLD=1 if qfold else 0, num_warps=warps, maxnreg=maxnreg)


def _launch_dense_tma(q, weights, logits, kv, context_lens, block_table, req_indices, block_size,
                      num_cache_blocks, page_stride) -> bool:
    """Launch the TMA dense decode where its configuration is on and the cache suits a TMA view (16-byte
    aligned base; page stride a multiple of 16, which ``_supports_paged`` already requires); False otherwise."""
    cfg = _dense_tma_config(block_size)
    if cfg is None or kv.data_ptr() % 16 != 0:
        return False
    t, warps, stages, tiles, maxnreg, ctas = cfg[:6]
    sub = cfg[6] if len(cfg) > 6 else 1
    R, H, D = q.shape
    L = logits.shape[1]
    vals = formats.cache_views(kv, "fp8")[0]
    kdesc = TensorDescriptor(vals, [num_cache_blocks, block_size, D], [page_stride, D, 1], [1, t, D])
    step = sub * t
    nt = _program_tiles(R, L, step, tiles, ctas, q.device)
    _dense_decode_tma_kernel[(R, triton.cdiv(L, nt * step))](
        _q_bytes(q), weights, kdesc, kv, context_lens, block_table,
        req_indices if req_indices is not None else context_lens, logits,
        H, L, logits.stride(0), block_table.shape[0], block_table.shape[1], block_table.stride(0), num_cache_blocks,
        formats.log2_block_size(block_size), page_stride, weights.stride(0), nt * step,
        HP=_heads_pad(H), D=D, HAS_REQ=req_indices is not None, T=t, SUB=sub, NUM_STAGES=stages,
        num_warps=warps, maxnreg=maxnreg)
    return True


def _prefill_dense_config(HP: int, fp4: bool):
    bq = max(1, 128 // HP)
    if "prefill_dense" in CONFIG_OVERRIDES:
        return (bq,) + tuple(CONFIG_OVERRIDES["prefill_dense"])
    # FP8: one warpgroup per CTA at ~164 registers lets three CTAs share an SM, so one CTA's epilogue
    # (relu, weights, head sum) overlaps another's MMAs. MXFP4: 8 warps keep the four group accumulators
    # out of local memory (4 warps spill).
    return (bq, 64, 8, 3) if fp4 else (bq, 64, 4, 3)  # BQ, BLOCK_N, warps, stages


def _launch_prefill_dense(q, q_scale, k, k_scale, weights, ks, ke, logits):
    fp4 = q.dtype != formats.FP8_DTYPE
    T, H, dq = q.shape
    D = dq * 2 if fp4 else dq
    L = logits.shape[1]
    if T == 0 or L == 0:
        return
    HP = _heads_pad(H)
    bq, block_n, warps, stages = _prefill_dense_config(HP, fp4)
    nqb = triton.cdiv(T, bq)
    cols = _chunk_cols(nqb, L, block_n, _cudalib.num_sms(q.device), waves=64, min_tiles=8)
    nj = triton.cdiv(L, cols)
    _prefill_dense_kernel[(nqb, nj)](
        _q_bytes(q), q_scale if q_scale is not None else ks, weights, _q_bytes(k), k_scale, ks, ke, logits,
        H, T, L, logits.stride(0), k.shape[0], cols, nj, weights.stride(0),
        HP=HP, BQ=bq, D=D, FP4=fp4, BLOCK_N=block_n, NUM_STAGES=stages,
        DOT_SCALED=fp4 and _use_dot_scaled(q.device), USE_ASM=_USE_ASM, num_warps=warps)


def _pair_config(HP: int, fp4: bool):
    if "pair" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["pair"]
    # FP8: 4 warps (two CTAs per SM) measured fastest on the H200 (NOTES.md); MXFP4 needs 8 to avoid spills.
    return (64, 8, 3) if fp4 else (64, 4, 3)  # BLOCK_N, warps, stages


# Beyond this many candidate slots, phase 2's in-register compaction would not fit: use the row kernel.
_PAIR_MAX_CAND = 4096
# The pair kernel loads each shared block once for two rows, but on the H200 it measured slower than one
# row per program (NOTES.md: 3.96 ms vs 3.47 ms for the rows kernel before its K loads were pipelined), so
# the rows kernel is the default; TSI_SPARSE_PREFILL_PAIR=1 (read at import: a static choice) selects pairs.
_PAIR_DEFAULT = os.environ.get("TSI_SPARSE_PREFILL_PAIR", "0") == "1"


def _launch_prefill_sparse(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, logits, pair=None):
    fp4 = q.dtype != formats.FP8_DTYPE
    T, H, dq = q.shape
    D = dq * 2 if fp4 else dq
    ncand = candidate_blocks.shape[1]
    if T == 0:
        return
    HP = _heads_pad(H)
    if pair is None:
        pair = _PAIR_DEFAULT and ncand <= _PAIR_MAX_CAND and HP <= 64 and T >= 2
    if not pair:
        _launch_rows(q, q_scale, weights, logits, paged=False, sparse=True, kv=_q_bytes(k), k_scale=k_scale,
                     ks=ks, ke=ke, candidate_blocks=candidate_blocks, cbs=cbs)
        return
    block_n, warps, stages = _pair_config(HP, fp4)
    p2 = triton.next_power_of_2(ncand)
    _prefill_pair_kernel[(triton.cdiv(T, 2),)](
        _q_bytes(q), q_scale if q_scale is not None else ks, weights, _q_bytes(k), k_scale, ks, ke,
        candidate_blocks, logits, H, T, logits.stride(0), k.shape[0], ncand, cbs, weights.stride(0),
        HP=HP, D=D, FP4=fp4, BLOCK_N=block_n, CAND_P2=p2, LOG2=max(1, p2.bit_length() - 1),
        NUM_STAGES=stages, DOT_SCALED=fp4 and _use_dot_scaled(q.device), USE_ASM=_USE_ASM, num_warps=warps)


# ----------------------------------------------------------------------------------------------------
# Op entry points (positional arguments in schema order) and their support checks
# ----------------------------------------------------------------------------------------------------

def _cache_geometry(kv_cache):
    kv = formats.as_3d_cache(kv_cache)
    nb, bs, _ = kv.shape
    return kv, nb, bs, kv.stride(0) if nb > 1 else kv.shape[1] * kv.shape[2]


def mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, logits):
    _launch_prefill_dense(q, q_scale, k, k_scale, weights, ks, ke, logits)


def sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, logits):
    _launch_prefill_sparse(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, logits)


def paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, logits, *, tma=True):
    """``tma=False`` keeps the row kernel even where the TMA dense decode is on (``warmup`` compiles both)."""
    kv, nb, bs, stride = _cache_geometry(kv_cache)
    _launch_rows(q, q_scale, weights, logits, paged=True, sparse=False, kv=kv, context_lens=context_lens,
                 block_table=block_table, req_indices=req_indices, block_size=bs, num_cache_blocks=nb,
                 page_stride=stride, tma=tma)


def paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                            candidate_blocks, cbs, logits):
    kv, nb, bs, stride = _cache_geometry(kv_cache)
    _launch_rows(q, q_scale, weights, logits, paged=True, sparse=True, kv=kv, context_lens=context_lens,
                 block_table=block_table, req_indices=req_indices, candidate_blocks=candidate_blocks, cbs=cbs,
                 block_size=bs, num_cache_blocks=nb, page_stride=stride)


# Base pointers need no alignment: Triton specializes a pointer argument on 16-byte divisibility, so a
# misaligned q / k / cache view compiles a variant with narrower loads and the same arithmetic (the same bits
# as the aligned call). The ``tl.multiple_of`` hints in the kernels only describe offsets, which stay
# multiples of 16 as long as a cache page stride is (checked below).
def _common_supports(q, tensors):
    if not q.is_cuda:
        return "needs a CUDA tensor"
    if torch.cuda.get_device_capability(q.device) < (9, 0):
        return "needs SM90 or newer"
    for name, t in tensors.items():
        if t is not None and t.dim() > 1 and t.stride(-1) != 1:
            return f"{name} must have stride(-1) == 1"
    return None


def _supports_packed(q, q_scale, k, k_scale, weights, ks, ke, *rest):
    return _common_supports(q, {"weights": weights})


def _supports_paged(q, q_scale, kv_cache, weights, *rest):
    why = _common_supports(q, {"weights": weights})
    if why:
        return why
    kv = formats.as_3d_cache(kv_cache)
    if kv.shape[0] > 1 and kv.stride(0) % 16 != 0:
        return "kv_cache page stride must be a multiple of 16 bytes"
    return None


# ----------------------------------------------------------------------------------------------------
# Warmup: compile every variant a configuration can launch, before any CUDA-graph capture
# ----------------------------------------------------------------------------------------------------

@_cudalib.on_device
def warmup(device, num_heads: int, head_dim: int, fmt: str, block_size: int = 64, cbs: int = 8,
           weights_dtypes=(torch.float32,), logits_dtypes=(torch.float32,), ops=None, candidate_slots=None):
    """Launch every scoring kernel variant the configuration can use on tiny inputs (compiles them).

    Variants depend on (fmt, head_dim, padded heads, weights dtype, logits dtype, with/without req_indices,
    pair/row sparse prefill); integer sizes are not specialized, so any later shape reuses these binaries.
    """
    from .. import testing
    device = torch.device(device)
    ops = ops or ("mqa_logits", "sparse_mqa_logits", "paged_mqa_logits", "paged_sparse_mqa_logits")
    H, D = num_heads, head_dim
    T = 4
    qs = testing.make_queries(T, H, D, fmt, device=device)
    kv_vals, kv_sc = testing.make_packed_k(64, D, fmt, device=device)
    case = testing.make_paged_cache([40, 64, 8, 30], block_size, D, fmt, device=device)
    ks = torch.zeros(T, dtype=torch.int32, device=device)
    ke = torch.full((T,), 40, dtype=torch.int32, device=device)
    lens = torch.tensor([40, 64, 8, 30], dtype=torch.int32, device=device)
    nslots = [4] + ([candidate_slots] if candidate_slots else [])
    for wd in weights_dtypes:
        w = qs.weights.to(wd)
        for ld in logits_dtypes:
            if "mqa_logits" in ops:
                mqa_logits(qs.q, qs.q_scale, kv_vals, kv_sc, w, ks, ke, torch.empty(T, 64, dtype=ld, device=device))
            for ns in nslots:
                cand = testing.random_candidates([40] * T, ns, cbs, device=device)
                out = torch.empty(T, ns * cbs, dtype=ld, device=device)
                if "sparse_mqa_logits" in ops:
                    for pair in (True, False):
                        _launch_prefill_sparse(qs.q, qs.q_scale, kv_vals, kv_sc, w, ks, ke, cand, cbs, out, pair)
                if "paged_sparse_mqa_logits" in ops:
                    for req in (None, torch.arange(T, dtype=torch.int32, device=device)):
                        paged_sparse_mqa_logits(qs.q, qs.q_scale, case.kv_cache, w, lens, case.block_table, req,
                                                cand, cbs, out)
            if "paged_mqa_logits" in ops:
                # With the TMA dense decode on, a cache whose base is not 16-byte aligned still takes the row
                # kernel: compile both.
                both = fmt == "fp8" and _dense_tma_config(block_size) is not None
                for tma in ((True, False) if both else (True,)):
                    for req in (None, torch.arange(T, dtype=torch.int32, device=device)):
                        paged_mqa_logits(qs.q, qs.q_scale, case.kv_cache, w, lens, case.block_table, req,
                                         torch.empty(T, 64, dtype=ld, device=device), tma=tma)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def register() -> None:
    backends.register("mqa_logits", "triton", mqa_logits, supports=_supports_packed, priority=10)
    backends.register("sparse_mqa_logits", "triton", sparse_mqa_logits, supports=_supports_packed, priority=10)
    backends.register("paged_mqa_logits", "triton", paged_mqa_logits, supports=_supports_paged, priority=10)
    backends.register("paged_sparse_mqa_logits", "triton", paged_sparse_mqa_logits, supports=_supports_paged,
                      priority=10)
