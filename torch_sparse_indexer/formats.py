"""Byte formats (SPEC section 3): FP8 / MXFP4 quantization of K and Q, and the paged K-cache layout.

Everything here is byte-for-byte what DeepGEMM's ``per_token_cast_to_fp8`` / ``per_token_cast_to_fp4``
and vLLM's indexer cache use. Every kernel backend reads and writes these layouts; this module is the
one place that defines them.

Paged cache page (``block_size`` tokens): first ``block_size * value_bytes`` bytes of values (token t at
``t * value_bytes``), then ``block_size`` 4-byte scales (token t at ``block_size * value_bytes + 4 t``).
"""
from __future__ import annotations

import torch

FORMATS = ("fp8", "mxfp4")
HEAD_DIMS = (64, 128)
CACHE_BLOCK_SIZES = (16, 32, 64, 128, 256)
CANDIDATE_BLOCK_SIZES = (8, 16, 32, 64)
MAX_HEADS = 128
MAX_TOPK = 4096

FP8_MAX = 448.0
FP4_MAX = 6.0
AMAX_FLOOR = 1e-4
MX_GROUP = 32
FP8_DTYPE = torch.float8_e4m3fn

# e2m1 magnitudes by 3-bit code; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding boundaries between consecutive codes, and whether a tie goes up (to the even code).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def log2_block_size(v: int) -> int:
    """log2 of a cache or candidate block size: the kernels index pages and blocks with shifts and masks
    (a division by a runtime int costs tens of instructions per element); the ops validate the sizes."""
    if v <= 0 or v & (v - 1):
        raise ValueError(f"block size: expected a power of two, got {v}")
    return v.bit_length() - 1


def value_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one token's values: D for fp8, D/2 for mxfp4."""
    check_fmt(fmt)
    return head_dim if fmt == "fp8" else head_dim // 2


def bytes_per_token(fmt: str, head_dim: int) -> int:
    """Values plus the 4-byte scale word: D + 4 (fp8) or D/2 + 4 (mxfp4)."""
    return value_bytes(fmt, head_dim) + 4


def head_dim_from_bytes(fmt: str, bpt: int) -> int:
    check_fmt(fmt)
    return bpt - 4 if fmt == "fp8" else 2 * (bpt - 4)


def check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")


# ----------------------------------------------------------------------------------------------------
# Scales
# ----------------------------------------------------------------------------------------------------

def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 ``x`` up to a power of two: exponent + (mantissa != 0), clamped to [1, 254]."""
    bits = x.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    exp = exp.clamp(1, 254)
    return (exp << 23).view(torch.float32)


def ue8m0_byte(pow2: torch.Tensor) -> torch.Tensor:
    """Biased exponent (``exponent + 127``) of power-of-two fp32 values, as int32 in [0, 255]."""
    return (pow2.float().contiguous().view(torch.int32) >> 23) & 0xFF


def ue8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte (int) -> the fp32 power of two 2^(byte - 127). Byte 0 gives 2^-127 (denormal)."""
    b = byte.to(torch.int32)
    normal = (b.clamp(min=1) << 23).view(torch.float32)
    return torch.where(b == 0, torch.full_like(normal, 2.0 ** -127), normal)


def pack_ue8m0(bytes_: torch.Tensor) -> torch.Tensor:
    """[..., 4] ints in [0, 255] -> [...] int32, little-endian (byte g at bits 8g..8g+7)."""
    b = bytes_.to(torch.int64)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_ue8m0(word: torch.Tensor) -> torch.Tensor:
    """[...] int32 -> [..., 4] int32 bytes, byte g = bits 8g..8g+7."""
    w = word.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (8 * g)) & 0xFF for g in range(4)], dim=-1).to(torch.int32)


def _true_div(x: torch.Tensor, c: float) -> torch.Tensor:
    # A Python-scalar divisor becomes a multiply by its reciprocal on CUDA (one ulp off a true
    # division); a same-shaped tensor divisor keeps the bytes identical on every device.
    return x / torch.full_like(x, c)


# ----------------------------------------------------------------------------------------------------
# FP8 (e4m3, one fp32 scale per row)
# ----------------------------------------------------------------------------------------------------

def quantize_fp8_rows(x: torch.Tensor, pow2_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8: ``x [..., D]`` float -> (``float8_e4m3fn [..., D]``, ``float32 [...]`` scale).

    ``s = max(amax, 1e-4) / 448`` (rounded up to a power of two when ``pow2_scale``), values
    ``e4m3(x * (1 / s))``.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    s = _true_div(amax, FP8_MAX)
    if pow2_scale:
        s = ceil_to_ue8m0(s)
    vals = (xf * (1.0 / s).unsqueeze(-1)).to(FP8_DTYPE)
    return vals, s


def dequantize_fp8_rows(vals: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return vals.float() * scale.float().unsqueeze(-1)


# ----------------------------------------------------------------------------------------------------
# MXFP4 (e2m1, one UE8M0 scale per 32 elements, 4 scale bytes per row packed into an int32)
# ----------------------------------------------------------------------------------------------------

def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float ``x`` to the nearest e2m1 value (ties to even, saturating at 6); uint8 codes 0..15.

    Negative zero is stored as +0 (code 0).
    """
    xf = x.float()
    a = xf.abs()
    code = torch.zeros_like(a, dtype=torch.int32)
    for bound, up in zip(_E2M1_BOUNDS, _E2M1_TIE_UP):
        code += (a >= bound if up else a > bound).to(torch.int32)
    sign = ((xf < 0) & (code != 0)).to(torch.int32) << 3
    return (code | sign).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    c = code.to(torch.int64)
    mag = table[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes -> [..., D/2] uint8; element 2i in the low nibble, 2i+1 in the high nibble."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] uint8 (or int8) -> [..., D] uint8 codes."""
    p = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    lo = p & 0xF
    hi = (p >> 4) & 0xF
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def quantize_mxfp4_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row MXFP4: ``x [..., D]`` (D = 64 or 128) -> (``uint8 [..., D/2]``, ``int32 [...]`` packed scales).

    Per 32 elements ``sf = pow2_ceil(max(amax, 1e-4) / 6)``, codes ``e2m1(x * (1 / sf))``; unused scale
    bytes (D = 64) are 127.
    """
    d = x.shape[-1]
    if d % MX_GROUP != 0 or d // MX_GROUP > 4:
        raise ValueError(f"x: expected a last dimension of 32, 64, 96 or 128 for MXFP4, got {d}")
    xf = x.float()
    g = xf.unflatten(-1, (d // MX_GROUP, MX_GROUP))
    amax = g.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    sf = ceil_to_ue8m0(_true_div(amax, FP4_MAX))
    codes = e2m1_encode(g * (1.0 / sf).unsqueeze(-1)).flatten(-2)
    sbytes = ue8m0_byte(sf)
    if sbytes.shape[-1] < 4:
        pad = torch.full((*sbytes.shape[:-1], 4 - sbytes.shape[-1]), 127, dtype=sbytes.dtype, device=x.device)
        sbytes = torch.cat([sbytes, pad], dim=-1)
    return pack_nibbles(codes), pack_ue8m0(sbytes)


def dequantize_mxfp4_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(``uint8 [..., D/2]``, ``int32 [...]``) -> fp32 ``[..., D]``."""
    vals = e2m1_decode(unpack_nibbles(packed))
    d = vals.shape[-1]
    sf = ue8m0_to_float(unpack_ue8m0(scale)[..., : d // MX_GROUP])
    return (vals.unflatten(-1, (d // MX_GROUP, MX_GROUP)) * sf.unsqueeze(-1)).flatten(-2)


def quantize_rows(x: torch.Tensor, fmt: str, pow2_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows of ``x [..., D]`` in ``fmt``: (values, per-row scale word)."""
    check_fmt(fmt)
    if fmt == "fp8":
        return quantize_fp8_rows(x, pow2_scale)
    return quantize_mxfp4_rows(x)


def dequantize_rows(vals: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` (fp32 ``[..., D]``). For fp8 ``scale`` is fp32; for mxfp4 int32."""
    check_fmt(fmt)
    if fmt == "fp8":
        return dequantize_fp8_rows(vals, scale)
    return dequantize_mxfp4_rows(vals, scale)


def quantize_q(q: torch.Tensor, weights: torch.Tensor, fmt: str, weight_scale: float = 1.0):
    """Quantize queries ``q [T, H, D]`` per (token, head) and fold what can be folded into the weights.

    Returns ``(q_values, q_scale, weights_fp32 [T, H])``:
    fp8: ``float8_e4m3fn [T, H, D]``, ``None``, ``weights * s * weight_scale`` (s = power-of-two scale);
    mxfp4: ``uint8 [T, H, D/2]``, ``int32 [T, H]``, ``weights * weight_scale``.
    """
    check_fmt(fmt)
    if fmt == "fp8":
        vals, s = quantize_fp8_rows(q, pow2_scale=True)
        return vals, None, (weights.float() * s * weight_scale).contiguous()
    vals, sc = quantize_mxfp4_rows(q)
    return vals, sc, (weights.float() * weight_scale).contiguous()


# ----------------------------------------------------------------------------------------------------
# Paged cache layout
# ----------------------------------------------------------------------------------------------------

def allocate_k_cache(num_blocks: int, block_size: int, head_dim: int, fmt: str,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed paged K cache ``uint8 [num_blocks, block_size, bytes_per_token(fmt, head_dim)]``."""
    check_fmt(fmt)
    if block_size not in CACHE_BLOCK_SIZES:
        raise ValueError(f"block_size: expected one of {CACHE_BLOCK_SIZES}, got {block_size}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim: expected one of {HEAD_DIMS}, got {head_dim}")
    return torch.zeros(num_blocks, block_size, bytes_per_token(fmt, head_dim), dtype=torch.uint8, device=device)


def as_3d_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """Accept ``[NB, BS, bpt]`` or ``[NB, BS, 1, bpt]``; return the 3-D view (no copy)."""
    if kv_cache.dim() == 4:
        return kv_cache.select(2, 0)
    return kv_cache


def page_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[NB, BS * bpt]`` uint8 view of each page's bytes (pages may be padded apart)."""
    kv = as_3d_cache(kv_cache)
    nb, bs, bpt = kv.shape
    return kv.as_strided((nb, bs * bpt), (kv.stride(0), 1))


def cache_views(kv_cache: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a paged cache: values ``[NB, BS, D]`` (float8_e4m3fn) or ``[NB, BS, D/2]`` (uint8), and
    scales ``[NB, BS]`` (float32 for fp8, int32 for mxfp4). Writing into them writes the cache."""
    kv = as_3d_cache(kv_cache)
    nb, bs, bpt = kv.shape
    vb = bpt - 4
    pages = page_bytes(kv)
    vals = pages[:, : bs * vb].unflatten(1, (bs, vb))
    if fmt == "fp8":
        vals = vals.view(FP8_DTYPE)
    scales = pages[:, bs * vb: bs * bpt].view(torch.float32 if fmt == "fp8" else torch.int32)
    return vals, scales
