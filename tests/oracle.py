"""Brute-force float64 oracle for every op, written apart from ``torch_sparse_indexer.reference``.

It reads the byte formats itself (SPEC section 3: e4m3 and e2m1 decoded from their bit fields, fp32 scales
rebuilt from their four little-endian bytes, UE8M0 bytes as powers of two), scores with plain float64
matmuls row by row, selects with Python's ``sorted`` and applies the documented clamping of
out-of-contract device values (``reference`` module docstring). Tiny shapes only: it loops in Python.

Every function takes CPU or CUDA tensors and returns CPU tensors / Python lists.
"""
from __future__ import annotations

import bisect
import math

import torch

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------
# Element decoders, built from the bit layouts
# ----------------------------------------------------------------------------------------------------

def _e4m3_value(b: int) -> float:
    """e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf; S.1111.111 is NaN."""
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * (m / 8.0) * 2.0 ** -6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def _e2m1_value(c: int) -> float:
    """e2m1: bit 3 sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (m * 0.5)."""
    sign = -1.0 if c & 0x8 else 1.0
    e, m = (c >> 1) & 0x3, c & 0x1
    mag = m * 0.5 if e == 0 else (1.0 + m / 2.0) * 2.0 ** (e - 1)
    return sign * mag


E4M3_TABLE = torch.tensor([_e4m3_value(b) for b in range(256)], dtype=torch.float64)
E2M1_TABLE = torch.tensor([_e2m1_value(c) for c in range(16)], dtype=torch.float64)
# Finite non-negative grids (for the independent rounding below), ascending, with their codes.
_E4M3_POS = sorted((_e4m3_value(b), b) for b in range(0x7F))
_E2M1_POS = sorted((_e2m1_value(c), c) for c in range(8))


def u8(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a 1-byte-element tensor, as int64 on CPU."""
    return t.detach().cpu().contiguous().view(torch.uint8).to(torch.int64)


def f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensor of 32-bit patterns -> float64 values (IEEE binary32 decoded by hand)."""
    bits = bits.to(torch.int64) & 0xFFFFFFFF
    sign = torch.where((bits >> 31) != 0, -1.0, 1.0).double()
    e = (bits >> 23) & 0xFF
    m = (bits & 0x7FFFFF).double()
    normal = (1.0 + m / 2.0 ** 23) * torch.pow(2.0, (e - 127).double())
    sub = m / 2.0 ** 23 * 2.0 ** -126
    val = torch.where(e == 0, sub, normal)
    val = torch.where((e == 255) & (m == 0), torch.full_like(val, math.inf), val)
    val = torch.where((e == 255) & (m != 0), torch.full_like(val, math.nan), val)
    return sign * val


def le_word(b: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes -> [...] unsigned little-endian word (int64)."""
    b = b.to(torch.int64)
    return b[..., 0] + (b[..., 1] << 8) + (b[..., 2] << 16) + (b[..., 3] << 24)


def int32_bytes(w: torch.Tensor) -> torch.Tensor:
    """int32 words -> [..., 4] bytes, byte g = bits 8g..8g+7 (the in-register meaning, not memory order)."""
    w = w.detach().cpu().to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (8 * g)) & 0xFF for g in range(4)], dim=-1)


def decode_e4m3(bytes_: torch.Tensor) -> torch.Tensor:
    return E4M3_TABLE[bytes_.to(torch.int64)]


def decode_e2m1_packed(bytes_: torch.Tensor) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] float64; element 2i = low nibble, 2i+1 = high nibble."""
    b = bytes_.to(torch.int64)
    lo, hi = E2M1_TABLE[b & 0xF], E2M1_TABLE[(b >> 4) & 0xF]
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def mx_scales(scale_bytes: torch.Tensor, d: int) -> torch.Tensor:
    """[..., 4] UE8M0 bytes -> [..., d] float64 per-element scale (byte g covers elements [32g, 32g+32))."""
    groups = torch.pow(2.0, (scale_bytes[..., : d // 32].to(torch.int64) - 127).double())
    return groups.repeat_interleave(32, dim=-1)


# ----------------------------------------------------------------------------------------------------
# Independent quantizers (float32 arithmetic where the recipe is float32, rounding by grid search)
# ----------------------------------------------------------------------------------------------------

def pow2_ceil_f32(x: float) -> float:
    """Round a positive float32 value up to a power of two, biased exponent clamped to [1, 254]."""
    if x == 0.0:
        return 2.0 ** -126
    mant, exp = math.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    p = exp - 1 if mant == 0.5 else exp
    return 2.0 ** min(max(p, -126), 127)


def _round_to_grid(y: float, grid) -> int:
    """Code of the nearest grid magnitude to |y| (ties to the even code), saturating at the top."""
    a = abs(y)
    if a >= grid[-1][0]:
        return grid[-1][1]
    i = bisect.bisect_right([g for g, _ in grid], a)  # grid[i-1] <= a < grid[i]
    (lo, clo), (hi, chi) = grid[i - 1], grid[i]
    if a - lo != hi - a:
        return clo if a - lo < hi - a else chi
    return clo if clo % 2 == 0 else chi


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def quantize_fp8_row(x: torch.Tensor, pow2: bool) -> tuple[list[int], float]:
    """One row of D values -> (D e4m3 bytes, fp32 scale) by the DeepGEMM/vLLM recipe."""
    xf = x.detach().cpu().float()
    amax = max(float(xf.abs().max()), f32(1e-4))
    s = f32(f32(amax) / f32(448.0))
    if pow2:
        s = pow2_ceil_f32(s)
    inv = f32(1.0 / s)
    codes = []
    for v in xf.tolist():
        y = f32(v * inv)
        c = _round_to_grid(y, _E4M3_POS)
        codes.append(c | 0x80 if (y < 0 or (y == 0 and math.copysign(1, y) < 0)) else c)
    return codes, s


def quantize_mxfp4_row(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """One row of D values -> (D/2 packed bytes, 4 UE8M0 scale bytes) by DeepGEMM's recipe."""
    xf = x.detach().cpu().float().tolist()
    d = len(xf)
    codes, sbytes = [], []
    for g in range(d // 32):
        grp = xf[32 * g: 32 * g + 32]
        amax = max(max(abs(v) for v in grp), f32(1e-4))
        sf = pow2_ceil_f32(f32(f32(amax) / 6.0))
        sbytes.append(int(round(math.log2(sf))) + 127)
        for v in grp:
            y = f32(v * f32(1.0 / sf))
            c = _round_to_grid(y, _E2M1_POS)
            codes.append(c | 0x8 if (y < 0 and c != 0) else c)
    sbytes += [127] * (4 - len(sbytes))
    packed = [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(d // 2)]
    return packed, sbytes


def f32_bytes(v: float) -> list[int]:
    bits = int(torch.tensor([v], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF
    return [(bits >> (8 * i)) & 0xFF for i in range(4)]


# ----------------------------------------------------------------------------------------------------
# Dequantized inputs
# ----------------------------------------------------------------------------------------------------

def dequant_q(q: torch.Tensor, q_scale) -> torch.Tensor:
    """fp8 ``[T, H, D]`` or mxfp4 ``[T, H, D/2]`` + int32 ``[T, H]`` -> float64 ``[T, H, D]``."""
    b = u8(q)
    if q_scale is None:
        return decode_e4m3(b)
    vals = decode_e2m1_packed(b)
    return vals * mx_scales(int32_bytes(q_scale), vals.shape[-1])


def dequant_packed_k(k: torch.Tensor, k_scale: torch.Tensor, fmt: str):
    """Packed K -> (float64 ``[N, D]`` values incl. MX scales, float64 ``[N]`` post-sum scale)."""
    b = u8(k)
    if fmt == "fp8":
        bits = k_scale.detach().cpu().contiguous().view(torch.int32).to(torch.int64)
        return decode_e4m3(b), f32_from_bits(bits)
    vals = decode_e2m1_packed(b)
    return vals * mx_scales(int32_bytes(k_scale), vals.shape[-1]), torch.ones(k.shape[0], dtype=torch.float64)


def cache_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """[NB, BS, bpt] or [NB, BS, 1, bpt] -> int64 [NB, BS * bpt] bytes of each page, in address order."""
    kv = kv_cache.detach().cpu()
    nb = kv.shape[0]
    return torch.stack([kv[p].contiguous().reshape(-1) for p in range(nb)]).to(torch.int64) if nb else \
        torch.zeros(0, 0, dtype=torch.int64)


def dequant_cache(kv_cache: torch.Tensor, fmt: str):
    """Paged cache -> (float64 [NB, BS, D], float64 [NB, BS] post-sum scale), reading SPEC's page layout:
    values of every token first, then one 4-byte scale per token."""
    bs, bpt = kv_cache.shape[1], kv_cache.shape[-1]
    vb = bpt - 4
    pages = cache_pages(kv_cache)
    nb = pages.shape[0]
    vals = pages[:, : bs * vb].reshape(nb, bs, vb)
    sc = pages[:, bs * vb: bs * bpt].reshape(nb, bs, 4)
    if fmt == "fp8":
        return decode_e4m3(vals), f32_from_bits(le_word(sc))
    d = 2 * vb
    return decode_e2m1_packed(vals) * mx_scales(sc, d), torch.ones(nb, bs, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------
# Scores
# ----------------------------------------------------------------------------------------------------

def _row_scores(qd, w, kd, ks):
    """qd [H, D], w [H], kd [C, D], ks [C] -> (scores [C], magnitude bound [C]) in float64."""
    dots = qd @ kd.T                      # [H, C]
    s = (w[:, None] * dots.clamp(min=0)).sum(0) * ks
    mag = ((w.abs()[:, None] * (qd.abs() @ kd.abs().T)).sum(0)) * ks.abs()
    return s, mag


def _prefill_bounds(ks, ke, N):
    """Documented clamp: ks' = clamp(ks, 0, N), ke' = clamp(ke, ks', N)."""
    out = []
    for a, b in zip(ks.tolist(), ke.tolist()):
        a2 = min(max(a, 0), N)
        b2 = min(max(b, a2), N)
        out.append((a2, b2 - a2))
    return out


def _decode_rows(context_lens, block_table, req_indices, bs):
    """Per row: (request, n) with n clamped to [0, max_blocks * bs] and 0 for an out-of-range request."""
    num_reqs, mb = block_table.shape
    lens = context_lens.tolist()
    reqs = list(range(len(lens))) if req_indices is None else req_indices.tolist()
    rows = []
    for r, L in zip(reqs, lens):
        if not 0 <= r < num_reqs:
            rows.append((r, 0))
        else:
            rows.append((r, min(max(L, 0), mb * bs)))
    return rows


def _paged_key(kd, kss, bt, req, p, bs):
    """Dequantized key of request-local position p, or None where its page id is out of range."""
    page = int(bt[req, p // bs])
    if not 0 <= page < kd.shape[0]:
        return None
    return kd[page, p % bs], kss[page, p % bs]


def _score_columns(qd_i, w_i, keys):
    """keys: list per column of (kd [D], scale) or None -> (scores [C], bound [C])."""
    C = len(keys)
    s = torch.full((C,), NEG_INF, dtype=torch.float64)
    mag = torch.zeros(C, dtype=torch.float64)
    live = [c for c, kk in enumerate(keys) if kk is not None]
    if live:
        kd = torch.stack([keys[c][0] for c in live])
        kscale = torch.stack([torch.as_tensor(keys[c][1], dtype=torch.float64) for c in live])
        sc, mg = _row_scores(qd_i, w_i, kd, kscale)
        s[live] = sc
        mag[live] = mg
    return s, mag


def mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, width):
    """Dense prefill scores (compressed layout), float64 ``[T, width]`` and an error-magnitude bound."""
    fmt = "fp8" if q_scale is None else "mxfp4"
    qd, w = dequant_q(q, q_scale), weights.detach().cpu().double()
    kd, kss = dequant_packed_k(k, k_scale, fmt)
    bounds = _prefill_bounds(ks.cpu(), ke.cpu(), k.shape[0])
    out, mags = [], []
    for i, (a, n) in enumerate(bounds):
        keys = [(kd[a + c], kss[a + c]) if c < n else None for c in range(width)]
        s, m = _score_columns(qd[i], w[i], keys)
        out.append(s)
        mags.append(m)
    return _stack(out, width), _stack(mags, width)


def _stack(rows, width):
    return torch.stack(rows) if rows else torch.zeros(0, width, dtype=torch.float64)


def sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs):
    fmt = "fp8" if q_scale is None else "mxfp4"
    qd, w = dequant_q(q, q_scale), weights.detach().cpu().double()
    kd, kss = dequant_packed_k(k, k_scale, fmt)
    bounds = _prefill_bounds(ks.cpu(), ke.cpu(), k.shape[0])
    cb = candidate_blocks.cpu().tolist()
    width = candidate_blocks.shape[1] * cbs
    out, mags = [], []
    for i, (a, n) in enumerate(bounds):
        keys = []
        for c in range(width):
            b = cb[i][c // cbs]
            p = b * cbs + c % cbs
            keys.append((kd[a + p], kss[a + p]) if b >= 0 and p < n else None)
        s, m = _score_columns(qd[i], w[i], keys)
        out.append(s)
        mags.append(m)
    return _stack(out, width), _stack(mags, width)


def _cache_block_size(kv_cache):
    return kv_cache.shape[1]


def paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, width):
    fmt = "fp8" if q_scale is None else "mxfp4"
    qd, w = dequant_q(q, q_scale), weights.detach().cpu().double()
    kd, kss = dequant_cache(kv_cache, fmt)
    bs = _cache_block_size(kv_cache)
    bt = block_table.cpu()
    rows = _decode_rows(context_lens.cpu(), bt, None if req_indices is None else req_indices.cpu(), bs)
    out, mags = [], []
    for i, (req, n) in enumerate(rows):
        keys = [_paged_key(kd, kss, bt, req, p, bs) if p < n else None for p in range(width)]
        s, m = _score_columns(qd[i], w[i], keys)
        out.append(s)
        mags.append(m)
    return _stack(out, width), _stack(mags, width)


def paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                            candidate_blocks, cbs):
    fmt = "fp8" if q_scale is None else "mxfp4"
    qd, w = dequant_q(q, q_scale), weights.detach().cpu().double()
    kd, kss = dequant_cache(kv_cache, fmt)
    bs = _cache_block_size(kv_cache)
    bt = block_table.cpu()
    rows = _decode_rows(context_lens.cpu(), bt, None if req_indices is None else req_indices.cpu(), bs)
    cb = candidate_blocks.cpu().tolist()
    width = candidate_blocks.shape[1] * cbs
    out, mags = [], []
    for i, (req, n) in enumerate(rows):
        keys = []
        for c in range(width):
            b = cb[i][c // cbs]
            p = b * cbs + c % cbs
            keys.append(_paged_key(kd, kss, bt, req, p, bs) if b >= 0 and p < n else None)
        s, m = _score_columns(qd[i], w[i], keys)
        out.append(s)
        mags.append(m)
    return _stack(out, width), _stack(mags, width)


# ----------------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------------

def _rank(v: float):
    """Sort key, best first: finite (and +inf) by value, then -inf, then NaN."""
    if math.isnan(v):
        return (2, 0.0)
    if v == NEG_INF:
        return (1, 0.0)
    return (0, -v)


def select(entries, k):
    """entries: [(position, value)] -> the k best positions (value desc, lower position on ties), ascending,
    -1 padded to k."""
    best = sorted(entries, key=lambda e: (_rank(e[1]), e[0]))[:k]
    chosen = sorted(p for p, _ in best)
    return chosen + [-1] * (k - len(chosen))


def topk(logits, lengths, k):
    lg = logits.detach().cpu().double().tolist()
    L = logits.shape[1]
    out = []
    for row, n in zip(lg, lengths.cpu().tolist()):
        n = min(max(n, 0), L)
        out.append(select([(c, row[c]) for c in range(n)], k))
    return out


def sparse_topk(logits, candidate_blocks, cbs, lengths, k):
    lg = logits.detach().cpu().double().tolist()
    cb = candidate_blocks.cpu().tolist()
    out = []
    for row, blocks, n in zip(lg, cb, lengths.cpu().tolist()):
        entries = []
        for c, v in enumerate(row):
            b = blocks[c // cbs]
            p = b * cbs + c % cbs
            if b >= 0 and p < n:
                entries.append((p, v))
        out.append(select(entries, k))
    return out


def block_topk(logits, lengths, cbs, num_blocks):
    """Best ``num_blocks`` blocks by max valid logit (NaN lowest, then -inf), ascending, -1 padded."""
    lg = logits.detach().cpu().double().tolist()
    L = logits.shape[1]
    out = []
    for row, n in zip(lg, lengths.cpu().tolist()):
        n = min(max(n, 0), L)
        entries = []
        for b in range((n + cbs - 1) // cbs):
            vals = row[b * cbs: min((b + 1) * cbs, n)]
            entries.append((b, min(vals, key=_rank)))  # the block's best value
        out.append(select(entries, num_blocks))
    return out


# ----------------------------------------------------------------------------------------------------
# Cache write / gather / query quantization
# ----------------------------------------------------------------------------------------------------

def write_k_cache(k, slot_mapping, kv_cache, fmt, pow2_scale):
    """Expected cache bytes (int64 [NB, BS * bpt] per page) after the write; slots < 0 or past the cache
    are skipped; a later token wins a repeated slot (the tests use distinct slots)."""
    pages = cache_pages(kv_cache).clone()
    nb, bs, bpt = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[-1]
    vb = bpt - 4
    for t, slot in enumerate(slot_mapping.cpu().tolist()):
        if not 0 <= slot < nb * bs:
            continue
        page, off = divmod(slot, bs)
        if fmt == "fp8":
            vals, s = quantize_fp8_row(k[t], pow2_scale)
            sbytes = f32_bytes(s)
        else:
            vals, sbytes = quantize_mxfp4_row(k[t])
        pages[page, off * vb:(off + 1) * vb] = torch.tensor(vals)
        pages[page, bs * vb + 4 * off: bs * vb + 4 * off + 4] = torch.tensor(sbytes)
    return pages


def gather_k(kv_cache, block_table, cu_seq_lens, n_rows, fmt):
    """Expected packed rows as (bytes int64 [n_rows, vb] or None where untouched, scale bytes [n_rows, 4])."""
    pages = cache_pages(kv_cache)
    nb, bs, bpt = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[-1]
    vb = bpt - 4
    bt = block_table.cpu()
    num_reqs, mb = bt.shape
    cu = cu_seq_lens.cpu().tolist()
    vals = [None] * n_rows
    scs = [None] * n_rows
    for r in range(len(cu) - 1):
        for t in range(cu[r], cu[r + 1]):
            if t >= n_rows:
                break
            p = t - cu[r]
            page = int(bt[r, p // bs]) if r < num_reqs and p // bs < mb else -1
            if 0 <= page < nb:
                off = p % bs
                vals[t] = pages[page, off * vb:(off + 1) * vb]
                scs[t] = pages[page, bs * vb + 4 * off: bs * vb + 4 * off + 4]
            else:
                vals[t] = torch.zeros(vb, dtype=torch.int64)
                scs[t] = torch.zeros(4, dtype=torch.int64)
    return vals, scs


def quantize_q(q, weights, fmt, weight_scale):
    """Expected (value bytes int64 [T, H, D or D/2], scale bytes int64 [T, H, 4] or None, weights float64)."""
    T, H, D = q.shape
    w = weights.detach().cpu().double()
    vals, scales, wout = [], [], torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            if fmt == "fp8":
                v, s = quantize_fp8_row(q[t, h], True)
                # w * s is exact (s a power of two); one float32 rounding for the weight_scale product.
                wout[t, h] = f32(f32(float(w[t, h]) * s) * f32(weight_scale))
            else:
                v, sb = quantize_mxfp4_row(q[t, h])
                scales.append(sb)
                wout[t, h] = f32(float(w[t, h]) * f32(weight_scale))
            vals.append(v)
    vb = D if fmt == "fp8" else D // 2
    vt = torch.tensor(vals, dtype=torch.int64).reshape(T, H, vb)
    st = None if fmt == "fp8" else torch.tensor(scales, dtype=torch.int64).reshape(T, H, 4)
    return vt, st, wout


def prefill_lengths(ks, ke, N):
    """Documented per-row usable key count of a prefill row (int64 [T])."""
    return torch.tensor([n for _, n in _prefill_bounds(ks.cpu(), ke.cpu(), N)], dtype=torch.int64)


def decode_lengths(context_lens, block_table, req_indices, bs):
    """Documented per-row valid length of a decode row (int64 [R])."""
    rows = _decode_rows(context_lens.cpu(), block_table.cpu(), None if req_indices is None else req_indices.cpu(), bs)
    return torch.tensor([n for _, n in rows], dtype=torch.int64)
