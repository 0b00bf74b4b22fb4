// write_k_cache for MXFP4 caches (SPEC: per 32 elements sf = pow2_ceil(max(amax, 1e-4) / 6), e2m1 codes of
// x * (1 / sf) rounded half to even and saturating, element 2i in the low nibble; the token's four UE8M0 bytes in
// one little-endian int32 at its page's end, bytes past D / 32 groups = 127). Byte-identical to
// torch_sparse_indexer.formats.quantize_mxfp4_rows on the same input.
//
// Why CUDA here: the Triton kernel was ALU-bound on its group reshapes and nibble packing (0.46 of copy
// bandwidth, NOTES.md). Here a lane owns 8 consecutive elements (one 16-byte bf16 load, one 4-byte store of 8
// nibbles), a 32-element group is 4 neighbouring lanes (amax through two shuffles), a token is D / 8 lanes.
#pragma once

#include <cstdint>

#ifdef TSI_EMULATE
#include <cmath>
#include "emu/cuda_emu.h"
#endif

namespace tsi_cache {

constexpr int THREADS = 256;
#ifndef TSI_CACHE_TPT
#define TSI_CACHE_TPT 2
#endif
constexpr int TPT = TSI_CACHE_TPT;  // tokens per lane: all their loads issued before the first is used
constexpr unsigned FULL = 0xffffffffu;

struct WriteParams {
  const void* k;        // [T, D] bf16 (kbf16 = 1) or fp32, rows contiguous
  const void* slots;    // [T] int64 (slot64 = 1) or int32
  unsigned char* kv;    // paged cache bytes: page p at kv + p * page_stride
  long long T;
  long long nslot;      // num_blocks * block_size: slots outside [0, nslot) are skipped
  long long page_stride;
  int lbs;              // log2(block_size)
  int D;                // 64 or 128
  int kbf16;
  int slot64;
};

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
#ifdef TSI_EMULATE
  uint4 v;
  memcpy(&v, p, 16);
  return v;
#else
  return __ldcs(reinterpret_cast<const uint4*>(p));  // read once: evict first
#endif
}

__device__ __forceinline__ void st_stream4(unsigned char* p, uint32_t v) {
#ifdef TSI_EMULATE
  memcpy(p, &v, 4);
#else
  __stcs(reinterpret_cast<unsigned*>(p), v);
#endif
}

// The 4-byte scale words of neighbouring slots share 32-byte sectors: kept in L2 (evict last) so that words
// written by other CTAs merge there instead of each leaving as a partial-sector write (the FP8 kernel measured
// this, NOTES.md).
__device__ __forceinline__ void st_keep4(unsigned char* p, uint32_t v) {
#ifdef TSI_EMULATE
  memcpy(p, &v, 4);
#else
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;" ::"l"(p), "r"(v), "l"(pol) : "memory");
#endif
}

__device__ __forceinline__ float div_rn(float a, float b) {
#ifdef TSI_EMULATE
  return a / b;
#else
  return __fdiv_rn(a, b);
#endif
}

// e2m1 code (0..15) of fp32 x already divided by its scale: ties to even, saturating at 6, -0 and NaN to 0 (as
// formats.e2m1_encode). |x| >= 1: the bits rounded half-even to one mantissa bit, whose exponent and bit are the
// code (2..7); below 1: round-half-even(2|x|) = 0, 1 or 2, the low mantissa bits of |x| + 2^22 (whose ulp is 1/2;
// no float-to-int conversion, a quarter-rate instruction).
__device__ __forceinline__ uint32_t e2m1_code(float x) {
  const float a = fabsf(x);
  const uint32_t bits = __float_as_uint(a);
  int big = (int)((bits + 0x1fffffu + ((bits >> 22) & 1u)) >> 22) - 252;
  big = big < 7 ? big : 7;
  const int small = (int)(__float_as_uint(a + 4194304.0f) & 3u);
  const int c = a >= 1.0f ? big : (a < 1.0f ? small : 0);
  return (uint32_t)c | ((x < 0.0f && c != 0) ? 8u : 0u);
}

// 8 consecutive elements of row t starting at element e0, as fp32.
__device__ __forceinline__ void load8(const WriteParams& p, long long t, int e0, bool in, float (&x)[8]) {
  uint4 a = make_uint4(0u, 0u, 0u, 0u), b = make_uint4(0u, 0u, 0u, 0u);
  if (in) {
    if (p.kbf16) {
      a = ld_stream16(static_cast<const unsigned char*>(p.k) + (t * p.D + e0) * 2);
    } else {
      const unsigned char* q = static_cast<const unsigned char*>(p.k) + (t * p.D + e0) * 4;
      a = ld_stream16(q);
      b = ld_stream16(q + 16);
    }
  }
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  if (p.kbf16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[2 * j] = __uint_as_float(w[j] << 16);
      x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = __uint_as_float(w[j]);
  }
}

// One CTA: THREADS / (D / 8) tokens per step, TPT steps. Every lane runs every shuffle (no early exit).
__global__ void __launch_bounds__(THREADS) write_mxfp4_kernel(WriteParams p) {
  const int lpt = p.D >> 3;  // lanes per token
  const int lane_t = (int)threadIdx.x & (lpt - 1);
  const int lane = (int)threadIdx.x & 31;
  const long long per_step = THREADS / lpt;
  const long long t0 = (long long)blockIdx.x * per_step * TPT + (int)threadIdx.x / lpt;
  float x[TPT][8];
  long long slot[TPT];
#pragma unroll
  for (int s = 0; s < TPT; ++s) {
    const long long t = t0 + s * per_step;
    const bool in = t < p.T;
    load8(p, t, 8 * lane_t, in, x[s]);
    slot[s] = -1;
    if (in) slot[s] = p.slot64 ? static_cast<const long long*>(p.slots)[t] : static_cast<const int*>(p.slots)[t];
  }
#pragma unroll
  for (int s = 0; s < TPT; ++s) {
    // amax over the group on the bits of |x| (non-negative floats order as integers; a NaN stays NaN, as in
    // torch's amax), floored at 1e-4
    uint32_t m = __float_as_uint(1e-4f);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t a = __float_as_uint(x[s][j]) & 0x7fffffffu;
      m = a > m ? a : m;
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      const uint32_t y = __shfl_xor_sync(FULL, m, o);
      m = y > m ? y : m;
    }
    const uint32_t sb = __float_as_uint(div_rn(__uint_as_float(m), 6.0f));
    int e = (int)((sb >> 23) & 0xffu) + ((sb & 0x7fffffu) != 0u ? 1 : 0);
    e = e < 1 ? 1 : (e > 254 ? 254 : e);
    // 1 / sf = 2^(127 - e), from the bits (2^-127 is subnormal)
    const float inv = __uint_as_float(e == 254 ? 0x00400000u : (uint32_t)(254 - e) << 23);
    uint32_t codes = 0u;
#pragma unroll
    for (int j = 0; j < 8; ++j) codes |= e2m1_code(x[s][j] * inv) << (4 * j);
    // the token's scale bytes: group g's exponent from its first lane (token lanes 4g..4g+3)
    const int base = lane & ~(lpt - 1);
    uint32_t word = 0u;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const uint32_t eg = (uint32_t)__shfl_sync(FULL, e, base + 4 * (g < lpt / 4 ? g : 0));
      word |= (g < lpt / 4 ? eg : 127u) << (8 * g);
    }
    const long long sl = slot[s];
    if (sl >= 0 && sl < p.nslot) {
      const long long bs = 1ll << p.lbs;
      const long long page = sl >> p.lbs, off = sl & (bs - 1);
      unsigned char* pg = p.kv + page * p.page_stride;
      const int vb = p.D >> 1;
      st_stream4(pg + off * vb + 4 * lane_t, codes);
      if (lane_t == 0) st_keep4(pg + bs * vb + off * 4, word);
    }
  }
}

}  // namespace tsi_cache
