"""Triton cache kernels: ``write_k_cache``, ``gather_k``, ``quantize_q`` (SPEC section 3).

Bytes are exactly :mod:`torch_sparse_indexer.formats`'s: the same amax floor, correctly rounded divisions
(``div_rn``), the same power-of-two rounding of the scale on its fp32 bits, round-to-nearest-even e4m3
conversion, and the same e2m1 rounding boundaries and tie directions. Grids depend on static sizes only;
slots, offsets and block-table entries are read on the device and follow the reference's clamping (slots
``< 0`` or past the cache are skipped; gathered rows whose page is missing are written as zeros).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import backends, formats
from . import _cudalib

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The bf16-pair MXFP4 encoder in PTX (add.rn.bf16x2, max.u16x2: SM90+); the interpreter runs its plain-Triton form.
_USE_ASM = not _INTERPRET and os.environ.get("TSI_TRITON_NO_ASM", "0") != "1"
_TOK = 64  # query-head rows per program (quantize)
# (tokens per program, warps) of the cache write per format: FP8 16 tokens, one warp (1M random slots on the H200:
# 121.0-121.4 vs 122.7-123.5 us at 32 tokens, 4 warps, in four runs: 0.80 vs 0.79 of copy bandwidth; NOTES.md,
# session 7); MXFP4 (bf16-pair encoder) the same: 121.2 vs 151.5 us at 32 tokens on 4 warps, whose layout splits a
# token's groups across warps and so reduces its scale word through shared memory (run 42).
# (tokens per program, warps, L2 hints: see _write_kernel). Both formats keep only the scale words in L2 (mask 2):
# 1M random slots on the H200, FP8 121 -> 112 us (mask 3 before), MXFP4 104-114 -> 102 (no hints before; runs
# 98-99); the rows' and values' evict-first hint cost time in every pair measured, on the H200 and an H100.
_WRITE_LAUNCH = {"fp8": (16, 1, 2), "mxfp4": (16, 1, 2)}
_GTOK = 128  # rows per program (gather)

# Benchmarks may override launches: {"write": see _write_config, "gather": see _gather_config}. The defaults
# are the fastest byte-equal configurations measured on the H200 (benchmarks/NOTES.md, cache v2).
CONFIG_OVERRIDES: dict = {}


def _write_config(fmt: str):
    """(tokens per program, integer e4m3 rounding, warps, L2 hints); an override (both formats) may leave out the
    last two (4 warps, no hints). Hints: a bit mask, 1 the rows and values evict first, 2 the scale words evict
    last (True = 3, False = 0); the defaults keep only the scale words in L2, so that neighbouring slots'
    partial-sector scale stores merge there (_WRITE_LAUNCH). On the GPU the e4m3 bytes come from triton's fp8 cast (the
    hardware's round-to-nearest-even conversion: 206 -> 129 us for 1M tokens, bytes equal to the reference's
    there; quantize_q uses it too); the integer rounding serves the interpreter, whose cast does not round."""
    tok, warps, hints = _WRITE_LAUNCH[fmt]
    cfg = tuple(CONFIG_OVERRIDES.get("write", (tok, _INTERPRET, warps, hints)))
    cfg = cfg + (4, False)[len(cfg) - 2:]
    h = cfg[3]
    return cfg[:3] + (3 if h is True else 0 if h is False else int(h),)  # by identity: True == 1 as a value


def _pairs(fmt: str, x) -> bool:
    """Whether the MXFP4 encoder runs on bf16 pairs (needs a contiguous bf16 input: it loads int32 words)."""
    return (fmt == "mxfp4" and x.dtype == torch.bfloat16 and x.is_contiguous() and x.data_ptr() % 4 == 0
            and CONFIG_OVERRIDES.get("pairs", True))


def _gather_config(R: int):
    """(rows per program, request chunk). ``None`` (the default) sizes the chunk from the batch: the next
    power of two of num_reqs + 1, 2..128. Each row's request search compares the row with a whole chunk, so a
    fixed 128-wide chunk for one request was ~60x the work of the copy (195 -> 75 us for 1M FP8 tokens)."""
    tok, rc = CONFIG_OVERRIDES.get("gather", (_GTOK, None))
    if rc is None:
        rc = min(128, max(2, triton.next_power_of_2(R + 1)))
    return tok, rc


@triton.jit
def _pow2_ceil(s):
    """Round positive fp32 ``s`` up to a power of two on its bits: exponent + (mantissa != 0), in [1, 254]."""
    bits = s.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = e + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 254)
    return (e << 23).to(tl.float32, bitcast=True), e


@triton.jit
def _e4m3_rne_bytes(x):
    """fp32 -> e4m3fn bytes, round to nearest even, saturating at 448, in integer arithmetic: exactly
    torch's ``.to(float8_e4m3fn)`` for |x| <= 448 (triton's fp8 cast on the H200 was seen to differ from it
    in a few bytes per thousand tokens, and the interpreter's cast does not round at all)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    af = a.to(tl.float32, bitcast=True)
    # normal range: keep 3 mantissa bits with round-half-even on the 20 dropped ones
    r = a >> 20
    rem = a & 0xFFFFF
    r = r + ((rem > 0x80000) | ((rem == 0x80000) & ((r & 1) == 1))).to(tl.int32)
    normal = r - (120 << 3)
    # subnormal range (< 2^-6): multiples of 2^-9
    v = af * 512.0
    fl = tl.floor(v)
    fr = v - fl
    fli = fl.to(tl.int32)
    sub = fli + ((fr > 0.5) | ((fr == 0.5) & ((fli & 1) == 1))).to(tl.int32)
    code = tl.where(af < 0.015625, sub, tl.minimum(normal, 0x7E))
    return (code | sign).to(tl.uint8)


@triton.jit
def _e2m1_codes(x):
    """fp32 ``x`` (already divided by its scale) -> e2m1 codes 0..15 (ties to even, saturating, -0 -> +0, NaN -> 0,
    as ``formats.e2m1_encode``). |x| >= 1: the fp32 bits rounded half-even to one mantissa bit, whose exponent and
    bit are the code (2..7; finite scaled inputs stay <= 6, inf saturates); below 1: round-half-even(2|x|) = 0, 1
    or 2 through the 2^23 addend. A few ops per value instead of seven compares (MXFP4 writes are ALU-bound)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    big = tl.minimum(((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252, 7)
    small = ((a * 2.0 + 8388608.0) - 8388608.0).to(tl.int32)
    c = tl.where(a >= 1.0, big, tl.where(a < 1.0, small, 0))
    sign = ((x < 0) & (c != 0)).to(tl.int32) << 3
    return c | sign


def _pair_asm() -> str:
    """PTX for :func:`_e2m1_pair_bytes`: four words ``$1..$4`` (two bf16 each), their magnitudes ``$5..$8``, the
    group words ``$9..$12`` (``e << 7`` per half) and ``$13..$16`` (``12 + 2e`` per half); one register of four
    packed bytes out (``$0``). Per word: the rounding magic ``2^(max(exp|x|, e) + 6)`` per bf16 half
    (``max.u16x2``), one ``add.rn.bf16x2`` rounds both halves to their e2m1 grid step (the magic's ulp is the
    step: sf/2 below 2 sf, sf below 4 sf, 2 sf above), the code is the ulp count plus the range's base
    (``(magic >> 6) - 12 - 2e``), the sign goes in where the code is nonzero (-0 -> +0); two words' codes then
    share a register (bytes: lo0, lo1, hi0, hi1) and one shift folds the high halves into bits 4-7 of each byte."""
    body = []
    for i in range(4):
        w, a, e, k = (f"${1 + i}", f"${5 + i}", f"${9 + i}", f"${13 + i}")
        body.append(
            f"and.b32 m, {a}, 0x7F807F80; max.u16x2 m, m, {e}; add.u32 m, m, 0x03000300; add.rn.bf16x2 t, {a}, m; "
            f"shr.u32 d, m, 6; sub.u32 c, t, m; add.u32 c, c, d; sub.u32 c, c, {k}; add.u32 z, c, 0x00070007; "
            f"shr.u32 s, {w}, 12; and.b32 s, s, z; and.b32 s, s, 0x00080008; or.b32 c{i}, c, s;")
    body.append("shl.b32 c1, c1, 8; or.b32 c0, c0, c1; shr.u32 s, c0, 12; or.b32 c0, c0, s; "
                "shl.b32 c3, c3, 8; or.b32 c2, c2, c3; shr.u32 s, c2, 12; or.b32 c2, c2, s; "
                "prmt.b32 $0, c0, c2, 0x5410;")
    return "{ .reg .b32 m, t, d, c, z, s, c0, c1, c2, c3; " + " ".join(body) + " }"


_PAIR_ASM = tl.constexpr(_pair_asm())


@triton.jit
def _bf16_rne(x):
    """fp32 -> the bf16 bit pattern (int32, low 16 bits) rounded to nearest even (finite inputs)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _e2m1_half(h, sgn, e7):
    """Plain-Triton form of one bf16 half of :data:`_PAIR_ASM` (the interpreter's path): ``h`` the magnitude bits,
    ``sgn`` the sign bit (0/1), ``e7`` the group's biased scale exponent << 7 -> e2m1 code 0..15."""
    m = tl.maximum(h & 0x7F80, e7)
    magic = m + 0x300
    # |x| < magic / 32: the fp32 sum is exact or below half a bf16 ulp, so one rounding to bf16 is the hardware's
    t = _bf16_rne((h << 16).to(tl.float32, bitcast=True) + (magic << 16).to(tl.float32, bitcast=True))
    c = t - magic + ((m - e7) >> 6)
    return c | ((sgn & (c != 0).to(tl.int32)) << 3)


@triton.jit
def _e2m1_pair_bytes(w, a, e, USE_ASM: tl.constexpr):
    """``w`` int32 words of two bf16 elements (2i low half, 2i+1 high half), ``a = w & 0x7FFF7FFF``, ``e`` the
    group's biased scale exponent (broadcast to ``w``'s shape) -> uint8 ``code(2i) | code(2i + 1) << 4`` (ties to
    even, -0 -> +0): exactly :func:`formats.e2m1_encode` of ``x * 2^(127 - e)`` for finite groups with
    ``e <= 246``. About 13 instructions per word where the fp32 encoder takes ~60 (MXFP4 writes were ALU-bound)."""
    if USE_ASM:
        ew = (e << 7) | (e << 23)
        k = (12 + 2 * e) * 0x10001
        return tl.inline_asm_elementwise(_PAIR_ASM, "=r" + ",r" * 16, [w, a, ew, k], dtype=tl.uint8, is_pure=True,
                                         pack=4)
    else:
        lo = _e2m1_half(a & 0xFFFF, (w >> 15) & 1, e << 7)
        hi = _e2m1_half(a >> 16, (w >> 31) & 1, e << 7)
        return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _max_u16x2(x, y):
    """Per-half unsigned maximum of two words (one instruction: the amax of bf16 magnitudes two at a time)."""
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _quant_mxfp4_bf16(w, ROWS: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr):
    """``w [ROWS, G, 16]`` int32 words of bf16 pairs -> (``[ROWS, G, 16]`` uint8 values, ``[ROWS]`` int32 scale
    word, ``ok``): the recipe of :func:`_quant_rows` with the amax taken on the bf16 bits (per-half unsigned
    maxima) and the encoding on pairs. ``ok`` is False when a group holds inf/NaN or needs ``e > 246`` (amax >
    6 * 2^119: the magic would overflow bf16); the caller then takes the fp32 path."""
    a = w & 0x7FFF7FFF
    if USE_ASM:
        am = tl.reduce(a, 2, _max_u16x2)
        abits = tl.maximum(am & 0xFFFF, am >> 16)
    else:  # the same maxima; the interpreter runs a custom reduction ~20x slower
        abits = tl.max(tl.maximum(a & 0xFFFF, a >> 16), axis=2)
    amax = tl.maximum((abits << 16).to(tl.float32, bitcast=True), 1e-4)
    _, e = _pow2_ceil(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
    ok = (tl.max(tl.max(abits, axis=1), axis=0) < 0x7F80) & (tl.max(tl.max(e, axis=1), axis=0) <= 246)
    vals = _e2m1_pair_bytes(w, a, tl.broadcast_to(e[:, :, None], w.shape), USE_ASM)
    gi = tl.arange(0, G)
    word = tl.sum(e << (8 * gi[None, :]), axis=1)
    if G == 2:
        word = word | (127 << 16) | (127 << 24)
    return vals, word, ok


@triton.jit
def _quant_rows(x, ROWS: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr, POW2: tl.constexpr,
                SOFT_FP8: tl.constexpr):
    """``x [ROWS, D]`` fp32 -> (value bytes ``[ROWS, VB]`` uint8, scale word ``[ROWS]`` (fp32 or int32))."""
    if FP4:
        G: tl.constexpr = D // 32
        xg = tl.reshape(x, (ROWS, G, 32))
        amax = tl.maximum(tl.max(tl.abs(xg), axis=2), 1e-4)
        sf, e = _pow2_ceil(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
        inv = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
        codes = tl.reshape(_e2m1_codes(xg * inv[:, :, None]), (ROWS, D // 2, 2))
        lo, hi = tl.split(codes)
        vals = (lo | (hi << 4)).to(tl.uint8)
        gi = tl.arange(0, G)
        word = tl.sum(e << (8 * gi[None, :]), axis=1)
        if G == 2:
            word = word | (127 << 16) | (127 << 24)
        return vals, word
    else:
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
        s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        if POW2:
            s, e = _pow2_ceil(s)
        inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        if SOFT_FP8:
            vals = _e4m3_rne_bytes(x * inv[:, None])
        else:
            vals = (x * inv[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return vals, s


@triton.jit
def _pair_cols(D: tl.constexpr):
    """``[1, D/32, 16]`` offsets of a row's int32 words of bf16 pairs, group by group: also its packed MXFP4 bytes."""
    return tl.arange(0, D // 32)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]


@triton.jit
def _load_rows(k_ptr, t, tm, D: tl.constexpr, PAIRS: tl.constexpr, EV_STREAM: tl.constexpr):
    """Rows ``t`` of ``k``: int32 words ``[TOK, D/32, 16]`` for the pair encoder, else fp32 ``[TOK, D]``."""
    if PAIRS:
        return tl.load(k_ptr.to(tl.pointer_type(tl.int32)) + t.to(tl.int64)[:, None, None] * (D // 2) + _pair_cols(D),
                       mask=tm[:, None, None], other=0, eviction_policy=EV_STREAM)
    else:
        d = tl.arange(0, D)
        return tl.load(k_ptr + t.to(tl.int64)[:, None] * D + d[None, :], mask=tm[:, None], other=0.0,
                       eviction_policy=EV_STREAM).to(tl.float32)


@triton.jit(do_not_specialize=["T", "NSLOT", "LBS", "PAGE_STRIDE"],
            do_not_specialize_on_alignment=["slot_ptr"])
def _write_kernel(k_ptr, slot_ptr, kv_ptr, T, NSLOT, LBS, PAGE_STRIDE,
                  D: tl.constexpr, FP4: tl.constexpr, POW2: tl.constexpr, TOK: tl.constexpr,
                  SOFT_FP8: tl.constexpr, HINTS: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr):
    """``PAIRS`` (MXFP4, bf16 ``k``): the encoder on bf16 pairs (:func:`_quant_mxfp4_bf16`), the fp32 one for a
    program whose groups it cannot take."""
    # HINTS bit 1: the K rows and value bytes stream through L2 once (evict first); bit 2: the 4-byte scale words,
    # one per token at its page's end, stay (evict last) so that neighbouring slots' words written by other
    # programs merge into whole sectors in L2 instead of each leaving as a partial-sector write.
    EV_STREAM: tl.constexpr = "evict_first" if HINTS & 1 else ""
    EV_SCALE: tl.constexpr = "evict_last" if HINTS & 2 else ""
    VB: tl.constexpr = D // 2 if FP4 else D
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)
    tm = t < T
    slot = tl.load(slot_ptr + t, mask=tm, other=-1).to(tl.int64)
    rows = _load_rows(k_ptr, t, tm, D, PAIRS, EV_STREAM)
    keep = tm & (slot >= 0) & (slot < NSLOT)
    slot = tl.where(keep, slot, 0)
    # block sizes are powers of two (validated by the ops): a 64-bit division by a runtime int is a ~40-instruction
    # call per token, a measurable share of this ALU-bound kernel
    BS = 1 << LBS
    page = slot >> LBS
    off = slot & (BS - 1)
    # Offsets built as multiples of 16 (page stride % 16 == 0 is checked on the host) so the stores are
    # 16-byte vectors; a multiple_of hint on the runtime stride does not carry through the product.
    row = (page * (PAGE_STRIDE // 16) + off * (VB // 16)) * 16
    sidx = (page * (PAGE_STRIDE // 4) + BS * (VB // 4)) + off
    if PAIRS:
        vals, sc, ok = _quant_mxfp4_bf16(rows, TOK, D // 32, USE_ASM)
        # Each branch stores its own results: values merged across the branches would be converted to one layout.
        if ok:
            tl.store(kv_ptr + row[:, None, None] + _pair_cols(D), vals, mask=keep[:, None, None],
                     eviction_policy=EV_STREAM)
            tl.store(kv_ptr.to(tl.pointer_type(tl.int32)) + sidx, sc, mask=keep, eviction_policy=EV_SCALE)
        else:
            _write_groups_fp32(k_ptr, kv_ptr, t, tm, keep, row, sidx, D, TOK, EV_STREAM, EV_SCALE)
    else:
        _write_rows_fp32(rows, kv_ptr, keep, row, sidx, D, FP4, POW2, TOK, SOFT_FP8, EV_STREAM, EV_SCALE)


@triton.jit
def _write_groups_fp32(k_ptr, kv_ptr, t, tm, keep, row, sidx, D: tl.constexpr, TOK: tl.constexpr,
                       EV_STREAM: tl.constexpr, EV_SCALE: tl.constexpr):
    """MXFP4 rows of ``k`` in fp32, one 32-element group at a time (the pair encoder's rare fallback: a loop over
    groups keeps its registers, which every program reserves, to one group's)."""
    word = tl.zeros((TOK,), tl.int32)
    d = tl.arange(0, 32)
    for g in tl.range(0, D // 32, loop_unroll_factor=1):
        x = tl.load(k_ptr + t.to(tl.int64)[:, None] * D + g * 32 + d[None, :], mask=tm[:, None], other=0.0,
                    eviction_policy=EV_STREAM).to(tl.float32)
        vals, e = _quant_rows(x, TOK, 32, True, True, False)
        tl.store(kv_ptr + row[:, None] + g * 16 + tl.arange(0, 16)[None, :], vals, mask=keep[:, None],
                 eviction_policy=EV_STREAM)
        word = word | (e << (8 * g))
    if D == 64:
        word = word | (127 << 16) | (127 << 24)
    tl.store(kv_ptr.to(tl.pointer_type(tl.int32)) + sidx, word, mask=keep, eviction_policy=EV_SCALE)


@triton.jit
def _write_rows_fp32(x, kv_ptr, keep, row, sidx, D: tl.constexpr, FP4: tl.constexpr, POW2: tl.constexpr,
                     TOK: tl.constexpr, SOFT_FP8: tl.constexpr, EV_STREAM: tl.constexpr, EV_SCALE: tl.constexpr):
    """Quantize fp32 rows ``x [TOK, D]`` and store values and scale words (:func:`_quant_rows`)."""
    VB: tl.constexpr = D // 2 if FP4 else D
    vals, sc = _quant_rows(x, TOK, D, FP4, POW2, SOFT_FP8)
    vb = tl.arange(0, VB)
    tl.store(kv_ptr + row[:, None] + vb[None, :], vals, mask=keep[:, None], eviction_policy=EV_STREAM)
    if FP4:
        tl.store(kv_ptr.to(tl.pointer_type(tl.int32)) + sidx, sc, mask=keep, eviction_policy=EV_SCALE)
    else:
        tl.store(kv_ptr.to(tl.pointer_type(tl.float32)) + sidx, sc, mask=keep, eviction_policy=EV_SCALE)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["NOUT", "R", "NREQ", "MB", "BT_STRIDE", "NB_CACHE", "BS", "PAGE_STRIDE"],
            do_not_specialize_on_alignment=["cu_ptr", "bt_ptr", "ksc_ptr"])
def _gather_kernel(kv_ptr, bt_ptr, cu_ptr, k_ptr, ksc_ptr, NOUT, R, NREQ, MB, BT_STRIDE, NB_CACHE, BS,
                   PAGE_STRIDE, VB: tl.constexpr, FP4: tl.constexpr, TOK: tl.constexpr, RC: tl.constexpr):
    """Rows ``t`` of the packed output; request ``r`` = searchsorted(cummax(cu)[1:], t, right) clamped to
    R - 1, as the reference computes it."""
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)
    tm = t < NOUT
    count = tl.zeros((TOK,), tl.int32)
    start = tl.zeros((TOK,), tl.int32)  # cummax(cu)[r] for the row's r
    carry = tl.max(tl.zeros((1,), tl.int32), axis=0)
    last = carry
    ri = tl.arange(0, RC)
    for c0 in range(0, R + 1, RC):
        idx = c0 + ri
        v = tl.load(cu_ptr + idx, mask=idx <= R, other=0)
        v = tl.maximum(v, 0)
        v = tl.maximum(tl.associative_scan(v, 0, _max_combine), carry)
        v = tl.where(idx <= R, v, 2147483647)
        le = v[None, :] <= t[:, None]
        count += tl.sum((le & (idx[None, :] >= 1)).to(tl.int32), axis=1)
        start = tl.maximum(start, tl.max(tl.where(le | (idx[None, :] == 0), v[None, :], 0), axis=1))
        carry = tl.max(tl.where(idx <= R, v, 0), axis=0)
        last = tl.maximum(last, carry)
    r = tl.minimum(count, R - 1)
    inside = tm & (t < last)
    p = t - start
    bi = p // BS
    ok = inside & (r < NREQ) & (p >= 0) & (bi < MB)
    rr = tl.minimum(r, NREQ - 1)
    page = tl.load(bt_ptr + rr.to(tl.int64) * BT_STRIDE + tl.where(ok, bi, 0), mask=ok, other=-1)
    ok = ok & (page >= 0) & (page < NB_CACHE)
    page = tl.where(ok, page, 0).to(tl.int64)
    off = (p % BS).to(tl.int64)
    vb = tl.arange(0, VB)
    row = (page * (PAGE_STRIDE // 16) + off * (VB // 16)) * 16
    src = tl.load(kv_ptr + row[:, None] + vb[None, :], mask=ok[:, None], other=0)
    tl.store(k_ptr + t.to(tl.int64)[:, None] * VB + vb[None, :], src, mask=inside[:, None])
    sidx = (page * (PAGE_STRIDE // 4) + BS * (VB // 4)) + off
    if FP4:
        sc = tl.load(kv_ptr.to(tl.pointer_type(tl.int32)) + sidx, mask=ok, other=0)
    else:
        sc = tl.load(kv_ptr.to(tl.pointer_type(tl.float32)) + sidx, mask=ok, other=0.0)
    tl.store(ksc_ptr + t, sc, mask=inside)


@triton.jit
def _quantize_rows_fp32(q_ptr, qv_ptr, m, mm, D: tl.constexpr, FP4: tl.constexpr, TOK: tl.constexpr,
                        SOFT_FP8: tl.constexpr):
    """Quantize rows ``m`` of ``q`` in fp32, store their values and return their scales (:func:`_quant_rows`)."""
    VB: tl.constexpr = D // 2 if FP4 else D
    x = _load_rows(q_ptr, m, mm, D, False, "")
    vals, sc = _quant_rows(x, TOK, D, FP4, True, SOFT_FP8)
    vb = tl.arange(0, VB)
    tl.store(qv_ptr + m.to(tl.int64)[:, None] * VB + vb[None, :], vals, mask=mm[:, None])
    return sc


@triton.jit(do_not_specialize=["M", "H", "W_STRIDE", "WS"],
            do_not_specialize_on_alignment=["w_ptr", "wo_ptr", "qs_ptr"])
def _quantize_q_kernel(q_ptr, w_ptr, qv_ptr, qs_ptr, wo_ptr, M, H, W_STRIDE, WS,
                       D: tl.constexpr, FP4: tl.constexpr, TOK: tl.constexpr, SOFT_FP8: tl.constexpr,
                       PAIRS: tl.constexpr, USE_ASM: tl.constexpr):
    """Rows are (token, head) pairs ``m = t * H + h`` of ``q [T, H, D]``; ``PAIRS`` as in the cache write."""
    VB: tl.constexpr = D // 2 if FP4 else D
    m = tl.program_id(0) * TOK + tl.arange(0, TOK)
    mm = m < M
    if PAIRS:
        vals, sc, ok = _quant_mxfp4_bf16(_load_rows(q_ptr, m, mm, D, True, ""), TOK, D // 32, USE_ASM)
        if ok:
            tl.store(qv_ptr + m.to(tl.int64)[:, None, None] * VB + _pair_cols(D), vals, mask=mm[:, None, None])
        else:
            sc = _quantize_rows_fp32(q_ptr, qv_ptr, m, mm, D, FP4, TOK, SOFT_FP8)
    else:
        sc = _quantize_rows_fp32(q_ptr, qv_ptr, m, mm, D, FP4, TOK, SOFT_FP8)
    tt = m // H
    hh = m % H
    w = tl.load(w_ptr + tt.to(tl.int64) * W_STRIDE + hh, mask=mm, other=0.0).to(tl.float32)
    if FP4:
        tl.store(qs_ptr + m, sc, mask=mm)
        tl.store(wo_ptr + m, w * WS, mask=mm)
    else:
        tl.store(wo_ptr + m, (w * sc) * WS, mask=mm)


# ----------------------------------------------------------------------------------------------------
# Entry points (schema order) and support checks
# ----------------------------------------------------------------------------------------------------

def _geometry(kv_cache):
    kv = formats.as_3d_cache(kv_cache)
    nb, bs, bpt = kv.shape
    return kv, nb, bs, bpt, kv.stride(0) if nb > 1 else bs * bpt


def write_k_cache(k, slot_mapping, kv_cache, fmt, pow2_scale):
    kv, nb, bs, bpt, stride = _geometry(kv_cache)
    T, D = k.shape
    if T == 0:
        return
    tok, soft, warps, hints = _write_config(fmt)
    _write_kernel[(triton.cdiv(T, tok),)](k, slot_mapping, kv, T, nb * bs, formats.log2_block_size(bs), stride,
                                          D=D, FP4=fmt == "mxfp4", POW2=bool(pow2_scale), TOK=tok, SOFT_FP8=soft,
                                          HINTS=hints, PAIRS=_pairs(fmt, k), USE_ASM=_USE_ASM,
                                          num_warps=warps)


def gather_k(kv_cache, block_table, cu_seq_lens, k, k_scale, fmt):
    kv, nb, bs, bpt, stride = _geometry(kv_cache)
    N = k.shape[0]
    R = cu_seq_lens.shape[0] - 1
    if N == 0 or R <= 0:
        return
    kb = k.view(torch.uint8)
    tok, rc = _gather_config(R)
    _gather_kernel[(triton.cdiv(N, tok),)](kv, block_table, cu_seq_lens, kb, k_scale, N, R, block_table.shape[0],
                                           block_table.shape[1], block_table.stride(0), nb, bs, stride,
                                           VB=bpt - 4, FP4=fmt == "mxfp4", TOK=tok, RC=rc, num_warps=4)


def quantize_q(q, weights, fmt, weight_scale):
    T, H, D = q.shape
    qc = q.contiguous()
    fp4 = fmt == "mxfp4"
    qv = torch.empty((T, H, D // 2 if fp4 else D), dtype=torch.uint8, device=q.device)
    qs = torch.empty((T, H), dtype=torch.int32, device=q.device) if fp4 else None
    wo = torch.empty((T, H), dtype=torch.float32, device=q.device)
    M = T * H
    if M > 0:
        w = weights if weights.stride(-1) == 1 or weights.shape[-1] <= 1 else weights.contiguous()
        _quantize_q_kernel[(triton.cdiv(M, _TOK),)](qc, w, qv, qs if fp4 else wo, wo, M, H,
                                                    w.stride(0) if w.dim() == 2 else H, float(weight_scale),
                                                    D=D, FP4=fp4, TOK=_TOK, SOFT_FP8=_INTERPRET,
                                                    PAIRS=_pairs(fmt, qc), USE_ASM=_USE_ASM, num_warps=4)
    if not fp4:
        qv = qv.view(formats.FP8_DTYPE)
    return qv, qs, wo


def _supports_cuda(t):
    if not t.is_cuda:
        return "needs a CUDA tensor"
    if torch.cuda.get_device_capability(t.device) < (9, 0):
        return "needs SM90 or newer"
    return None


def _supports_cache(kv_cache):
    kv = formats.as_3d_cache(kv_cache)
    if kv.storage_offset() % 16 != 0 or (kv.shape[0] > 1 and kv.stride(0) % 16 != 0):
        return "kv_cache pages must start 16-byte aligned (page stride % 16 == 0)"
    return None


def _supports_write(k, slot_mapping, kv_cache, fmt, pow2_scale):
    return _supports_cuda(k) or _supports_cache(kv_cache)


def _supports_gather(kv_cache, block_table, cu_seq_lens, k, k_scale, fmt):
    return _supports_cuda(kv_cache) or _supports_cache(kv_cache)


def _supports_quantize_q(q, weights, fmt, weight_scale):
    return _supports_cuda(q)


@_cudalib.on_device
def warmup(device, head_dim: int, fmt: str, k_dtypes=(torch.bfloat16,), slot_dtypes=(torch.int64, torch.int32),
           weights_dtypes=(torch.float32,), pow2_scale=(True,)):
    """Compile the cache kernels a configuration uses (tiny launches)."""
    device = torch.device(device)
    cache = formats.allocate_k_cache(4, 16, head_dim, fmt, device)
    for kd in k_dtypes:
        k = torch.randn(8, head_dim, device=device).to(kd)
        for sd in slot_dtypes:
            for p2 in pow2_scale:
                write_k_cache(k, torch.arange(8, device=device, dtype=sd), cache, fmt, p2)
        for wd in weights_dtypes:
            quantize_q(torch.randn(2, 4, head_dim, device=device).to(kd), torch.randn(2, 4, device=device).to(wd),
                       fmt, 1.0)
    bt = torch.arange(4, dtype=torch.int32, device=device).view(2, 2)
    cu = torch.tensor([0, 20, 30], dtype=torch.int32, device=device)
    vb = formats.value_bytes(fmt, head_dim)
    kout = torch.empty(32, vb, dtype=torch.uint8, device=device)
    if fmt == "fp8":
        kout = kout.view(formats.FP8_DTYPE)
    gather_k(cache, bt, cu, kout, torch.empty(32, dtype=torch.float32 if fmt == "fp8" else torch.int32,
                                              device=device), fmt)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def register() -> None:
    backends.register("write_k_cache", "triton", write_k_cache, supports=_supports_write, priority=10)
    backends.register("gather_k", "triton", gather_k, supports=_supports_gather, priority=10)
    backends.register("quantize_q", "triton", quantize_q, supports=_supports_quantize_q, priority=10)
