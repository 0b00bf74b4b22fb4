"""Byte formats (SPEC section 3), pinned by hand-computed vectors, plus round-trip bounds on random data."""
from __future__ import annotations

import math

import pytest
import torch

from torch_sparse_indexer import formats

import oracle

ops = torch.ops.sparse_indexer


def _bytes(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).contiguous().view(torch.uint8).tolist()


# ----------------------------------------------------------------------------------------------------
# e2m1
# ----------------------------------------------------------------------------------------------------

def test_e2m1_code_table():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    got = formats.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got == expected
    # Every representable value encodes back to its own code (code 8, -0, is never produced).
    vals = torch.tensor(expected)
    assert formats.e2m1_encode(vals).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]


def test_e2m1_ties_to_even_and_signs():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    # down, up, down, up, down, up, down: the neighbour with an even code wins.
    assert formats.e2m1_encode(torch.tensor(ties)).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert formats.e2m1_encode(-torch.tensor(ties)).tolist() == [0, 10, 10, 12, 12, 14, 14]
    # Just off the midpoints.
    eps = 1e-6
    above = formats.e2m1_encode(torch.tensor([t + eps for t in ties])).tolist()
    below = formats.e2m1_encode(torch.tensor([t - eps for t in ties])).tolist()
    assert above == [1, 2, 3, 4, 5, 6, 7]
    assert below == [0, 1, 2, 3, 4, 5, 6]
    # Negative zero and negatives that round to zero are stored as +0; saturation at 6; NaN-free input only.
    assert formats.e2m1_encode(torch.tensor([-0.0, -0.1, -0.25, 6.5, 100.0, -7.0])).tolist() == [0, 0, 0, 7, 7, 15]


def test_nibble_order():
    codes = torch.tensor([[1, 2, 3, 4, 0xF, 0]], dtype=torch.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]  # element 2i low nibble, 2i+1 high nibble
    assert formats.unpack_nibbles(packed).tolist() == codes.tolist()
    assert formats.unpack_nibbles(packed.view(torch.int8)).tolist() == codes.tolist()


# ----------------------------------------------------------------------------------------------------
# UE8M0 and power-of-two scales
# ----------------------------------------------------------------------------------------------------

def test_ue8m0_packing_little_endian():
    w = formats.pack_ue8m0(torch.tensor([[1, 2, 3, 4], [0x7F, 0x80, 0x81, 0xFE]]))
    assert w.dtype == torch.int32
    assert w.tolist() == [0x04030201, 0xFE81807F - (1 << 32)]
    # In memory (little-endian) byte g is the scale of elements [32g, 32g + 32).
    assert _bytes(w) == [1, 2, 3, 4, 0x7F, 0x80, 0x81, 0xFE]
    assert formats.unpack_ue8m0(w).tolist() == [[1, 2, 3, 4], [0x7F, 0x80, 0x81, 0xFE]]


@pytest.mark.parametrize("x, expected", [
    (1.0, 1.0),                       # exact powers of two stay
    (0.5, 0.5),
    (2.0 ** -20, 2.0 ** -20),
    (1.0 + 2.0 ** -23, 2.0),          # any nonzero mantissa goes up
    (0.75, 1.0),
    (3.0, 4.0),
    (1e-4 / 448, 2.0 ** -22),         # the fp8 amax floor
    (1e-4 / 6, 2.0 ** -15),           # the mxfp4 amax floor
    (0.0, 2.0 ** -126),               # biased exponent clamped to >= 1
    (2.0 ** -127, 2.0 ** -126),       # denormal: exponent 0 + 1
    (2.0 ** 127, 2.0 ** 127),
    (1.5 * 2.0 ** 127, 2.0 ** 127),   # clamped to <= 254
])
def test_ceil_to_ue8m0(x, expected):
    got = formats.ceil_to_ue8m0(torch.tensor([x], dtype=torch.float32))
    assert got.item() == expected
    assert got.item() == oracle.pow2_ceil_f32(float(torch.tensor(x, dtype=torch.float32)))


def test_ue8m0_byte_and_value():
    pow2 = torch.tensor([1.0, 0.5, 2.0 ** -126, 2.0 ** 127])
    assert formats.ue8m0_byte(pow2).tolist() == [127, 126, 1, 254]
    assert formats.ue8m0_to_float(torch.tensor([127, 126, 1, 254, 0])).tolist() == \
        [1.0, 0.5, 2.0 ** -126, 2.0 ** 127, 2.0 ** -127]


# ----------------------------------------------------------------------------------------------------
# Per-row quantization, known vectors
# ----------------------------------------------------------------------------------------------------

def test_fp8_known_rows():
    # amax 448 -> s = 1 exactly; 448 = 1.75 * 2^8 -> 0x7E, -224 -> 0xF6, 1 -> 0x38.
    v, s = formats.quantize_fp8_rows(torch.tensor([[448.0, -224.0, 1.0, 0.0]]), pow2_scale=True)
    assert _bytes(v) == [0x7E, 0xF6, 0x38, 0x00] and s.tolist() == [1.0]
    # amax 1: pow2 s = 2^-8 -> values 256 (0x78) and 128 (0x70); the fp32 scale is 0x3B800000.
    v, s = formats.quantize_fp8_rows(torch.tensor([[1.0, 0.5]]), pow2_scale=True)
    assert _bytes(v) == [0x78, 0x70] and _bytes(s) == [0x00, 0x00, 0x80, 0x3B]
    # Without pow2 the scale is amax / 448 and the row max maps to 448.
    v, s = formats.quantize_fp8_rows(torch.tensor([[1.0, -0.5]]), pow2_scale=False)
    assert _bytes(v) == [0x7E, 0xF6] and s.item() == pytest.approx(1 / 448, rel=1e-7)
    # All-zero row: amax floored at 1e-4 -> s = 2^-22 (0x34800000), zero values.
    v, s = formats.quantize_fp8_rows(torch.zeros(1, 8), pow2_scale=True)
    assert _bytes(v) == [0] * 8 and _bytes(s) == [0x00, 0x00, 0x80, 0x34]


def test_mxfp4_known_row_d64_padding():
    # Group 0: amax 3 -> sf = 0.5 (byte 126), values [3, -6] -> codes [5, 15] -> byte 0xF5.
    # Group 1: amax 0.25 -> 0.25/6 -> sf = 2^-4 (byte 123), values [4, 0] -> codes [6, 0] -> byte 0x06.
    x = torch.tensor([1.5, -3.0] * 16 + [0.25, 0.0] * 16).unsqueeze(0)
    v, sc = formats.quantize_mxfp4_rows(x)
    assert _bytes(v) == [0xF5] * 16 + [0x06] * 16
    assert _bytes(sc) == [126, 123, 127, 127]  # D = 64: the unused bytes are 127


def _toy_rows_fp8():
    a = torch.full((64,), 56.0)                         # s = 56/448 = 2^-3, values 448
    b = torch.tensor([1.0, -1.0] * 32)                  # s = 2^-8, values +-256
    c = torch.zeros(64)
    c[63] = -7.0                                        # s = 2^-6, value -448
    exp = [([0x7E] * 64, [0x00, 0x00, 0x00, 0x3E]),
           ([0x78, 0xF8] * 32, [0x00, 0x00, 0x80, 0x3B]),
           ([0x00] * 63 + [0xFE], [0x00, 0x00, 0x80, 0x3C])]
    return torch.stack([a, b, c]), exp


def _toy_rows_mxfp4():
    a = torch.full((64,), 6.0)                          # sf 1, code 7 everywhere
    b = torch.tensor([1.5, -3.0] * 16 + [0.25, 0.0] * 16)
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
    c = torch.tensor(ties + [0.0] * 48)                 # group 1 all zero: amax floor -> sf 2^-15 (112)
    exp = [([0x77] * 32, [127, 127, 127, 127]),
           ([0xF5] * 16 + [0x06] * 16, [126, 123, 127, 127]),
           ([0x07, 0x22, 0x44, 0x66, 0xA0, 0xCA, 0xEC, 0x0E] + [0] * 24, [127, 112, 127, 127])]
    return torch.stack([a, b, c]), exp


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("via", ["formats", "op"])
def test_toy_cache_page_layout(fmt, via):
    """Three tokens in a 2-page cache (block size 16, D = 64): each page is 16 tokens' values, then 16
    4-byte scales. Slots 2 and 0 land in page 0, slot 17 at offset 1 of page 1."""
    rows, exp = _toy_rows_fp8() if fmt == "fp8" else _toy_rows_mxfp4()
    slots = [2, 0, 17]
    bs, vb = 16, (64 if fmt == "fp8" else 32)
    bpt = vb + 4
    cache = formats.allocate_k_cache(2, bs, 64, fmt)
    assert cache.shape == (2, bs, bpt) and cache.dtype == torch.uint8
    if via == "op":
        ops.write_k_cache(rows, torch.tensor(slots), cache, fmt, True)
    else:
        vals_v, scales_v = formats.cache_views(cache, fmt)
        v, s = formats.quantize_rows(rows, fmt, True)
        for t, slot in enumerate(slots):
            vals_v.view(torch.uint8)[slot // bs, slot % bs] = v[t].view(torch.uint8)
            scales_v[slot // bs, slot % bs] = s[t]
    expected = [[0] * (bs * bpt) for _ in range(2)]
    for (vals, sbytes), slot in zip(exp, slots):
        page, off = divmod(slot, bs)
        expected[page][off * vb:(off + 1) * vb] = vals
        expected[page][bs * vb + 4 * off: bs * vb + 4 * off + 4] = sbytes
    assert [cache[p].flatten().tolist() for p in range(2)] == expected

    # The views read back what was written, and a 4-D view is the same bytes.
    vals_v, scales_v = formats.cache_views(cache, fmt)
    v4, s4 = formats.cache_views(cache.unsqueeze(2), fmt)
    assert torch.equal(vals_v.view(torch.uint8), v4.view(torch.uint8)) and torch.equal(scales_v, s4)
    got = formats.dequantize_rows(vals_v[[0, 0, 1], [2, 0, 1]], scales_v[[0, 0, 1], [2, 0, 1]], fmt)
    ref = torch.stack([oracle.decode_e4m3(torch.tensor(e[0])) * oracle.f32_from_bits(oracle.le_word(torch.tensor(e[1])))
                       if fmt == "fp8" else
                       oracle.decode_e2m1_packed(torch.tensor(e[0])) * oracle.mx_scales(torch.tensor(e[1]), 64)
                       for e in exp])
    assert torch.equal(got.double(), ref)


def test_cache_views_padded_pages():
    """Pages padded apart (page stride > block_size * bpt) keep each page's own layout."""
    bs, D, fmt = 16, 64, "fp8"
    bpt = D + 4
    stride = bs * bpt + 64
    store = torch.zeros(3 * stride, dtype=torch.uint8)
    cache = store.as_strided((3, bs, bpt), (stride, bpt, 1))
    rows, exp = _toy_rows_fp8()
    ops.write_k_cache(rows, torch.tensor([2, 0, 33]), cache, fmt, True)
    assert store[stride * 2 + 1 * D: stride * 2 + 2 * D].tolist() == exp[2][0]
    assert store[stride * 2 + bs * D + 4: stride * 2 + bs * D + 8].tolist() == exp[2][1]
    assert store[bs * bpt: stride].tolist() == [0] * 64  # padding untouched


# ----------------------------------------------------------------------------------------------------
# Round trips on random data
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_fp8_round_trip_bound(gen, pow2, D):
    x = torch.randn(257, D, generator=gen) * torch.logspace(-3, 3, 257).unsqueeze(1)
    v, s = formats.quantize_fp8_rows(x, pow2)
    amax = x.abs().amax(1).clamp(min=1e-4)
    if pow2:
        assert torch.all(s >= amax / 448) and torch.all(s < 2 * amax / 448)
        assert torch.all(formats.ceil_to_ue8m0(s) == s)
    else:
        torch.testing.assert_close(s, amax / 448, rtol=1e-6, atol=0)
    deq = formats.dequantize_fp8_rows(v, s)
    # One float32 rounding of the exact (4-bit x 24-bit) product.
    assert torch.equal(deq, (oracle.decode_e4m3(oracle.u8(v)) * s.double().unsqueeze(1)).float())
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal spacing 2^-9 (absolute <= 2^-10 * s).
    err = (deq.double() - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2.0 ** -4, s.double().unsqueeze(1) * 2.0 ** -10) * (1 + 1e-6)
    assert torch.all(err <= bound)


@pytest.mark.parametrize("D", [64, 128])
def test_mxfp4_round_trip_bound(gen, D):
    x = torch.randn(129, D, generator=gen) * torch.logspace(-3, 3, 129).unsqueeze(1)
    v, sc = formats.quantize_mxfp4_rows(x)
    assert v.shape == (129, D // 2) and v.dtype == torch.uint8 and sc.dtype == torch.int32
    sb = formats.unpack_ue8m0(sc)
    assert torch.all(sb[:, D // 32:] == 127)
    sf = formats.ue8m0_to_float(sb[:, : D // 32]).double()           # [N, G]
    amax = x.view(129, D // 32, 32).abs().amax(2).double().clamp(min=1e-4)
    assert torch.all(sf >= amax / 6) and torch.all(sf < amax / 3)     # the tightest power of two
    deq = formats.dequantize_mxfp4_rows(v, sc).double()
    assert torch.equal(deq, oracle.decode_e2m1_packed(oracle.u8(v)) * oracle.mx_scales(oracle.int32_bytes(sc), D))
    y = (x.double().view(129, D // 32, 32) / sf.unsqueeze(2)).abs()
    # Half the gap between neighbours: 0.25 below 2, 0.5 in [2, 4), 1 in [4, 6].
    half_gap = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    err = (deq.view(129, D // 32, 32) - x.double().view(129, D // 32, 32)).abs()
    assert torch.all(err <= half_gap * sf.unsqueeze(2) * (1 + 1e-6))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantize_rows_matches_independent_quantizer(gen, fmt):
    x = torch.randn(6, 128, generator=gen) * 3
    x[0, 5] = -0.0
    x[1] = 0.0
    v, s = formats.quantize_rows(x, fmt, True)
    for t in range(6):
        if fmt == "fp8":
            codes, scale = oracle.quantize_fp8_row(x[t], True)
            assert _bytes(v[t]) == codes and s[t].item() == scale
        else:
            packed, sbytes = oracle.quantize_mxfp4_row(x[t])
            assert _bytes(v[t]) == packed and _bytes(s[t]) == sbytes


# ----------------------------------------------------------------------------------------------------
# quantize_q: scale folding
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_quantize_q_fp8_folds_pow2_scale(gen, wdtype):
    T, H, D = 3, 8, 64
    q = torch.randn(T, H, D, generator=gen) * torch.logspace(-2, 2, H).view(1, H, 1)
    w = (torch.randn(T, H, generator=gen)).to(wdtype)
    qv, qs, wf = formats.quantize_q(q, w, "fp8", 0.25)
    assert qs is None and qv.dtype == torch.float8_e4m3fn and wf.dtype == torch.float32
    for t in range(T):
        for h in range(H):
            amax = max(float(q[t, h].abs().max()), 1e-4)
            mant, e = math.frexp(float(torch.tensor(amax, dtype=torch.float32)) / 448)
            s = 2.0 ** (e - 1 if mant == 0.5 else e)
            assert wf[t, h].item() == float(w[t, h].float()) * s * 0.25  # powers of two: exact
            # q == q8 * s within e4m3 rounding, so w * relu(q . k) == wf * relu(q8 . k).
            deq = qv[t, h].float().double() * s
            assert torch.all((deq - q[t, h].double()).abs() <= q[t, h].double().abs() * 2 ** -4 + s * 2 ** -10)


def test_quantize_q_mxfp4_keeps_scales(gen):
    T, H, D = 2, 4, 128
    q = torch.randn(T, H, D, generator=gen)
    w = torch.randn(T, H, generator=gen)
    qv, qs, wf = formats.quantize_q(q, w, "mxfp4", 0.3)
    assert qv.shape == (T, H, D // 2) and qs.shape == (T, H) and qs.dtype == torch.int32
    assert torch.equal(wf, w * 0.3)
    v2, s2 = formats.quantize_mxfp4_rows(q.reshape(T * H, D))
    assert torch.equal(qv.reshape(T * H, -1), v2) and torch.equal(qs.reshape(-1), s2)
