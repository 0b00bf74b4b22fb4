// CPU stand-ins for what the decode scoring kernels (csrc/scoring.cu) take from CUDA headers and PTX, for the
// emulation build (CSRC=scoring.cu csrc/emu/build_emu.sh): logic checks of the kernels on a machine without a GPU.
// wgmma runs synchronously: every thread of the warpgroup (= the CTA) deposits its A registers, a barrier, each
// thread computes its own accumulator fragment from all A fragments and the shared-memory B matrix its
// descriptor addresses. cp.async lands at the wait that covers it (tsi_emu::async_copy). Not a performance
// model.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda_emu.h"

#define __grid_constant__

// Integer min / max as CUDA's device overloads (mixed int / enumerator arguments).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}

// prmt.b32 in its default mode (selector nibbles: bits 0-2 pick a byte of {b, a}, bit 3 replicates its sign).
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const uint64_t x = (uint64_t)b << 32 | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 15;
    unsigned byte = (unsigned)(x >> (8 * (sel & 7))) & 0xFF;
    if (sel & 8) byte = (byte & 0x80) ? 0xFF : 0;
    r |= byte << (8 * i);
  }
  return r;
}

inline uint32_t __cvta_generic_to_shared(const void* p) {
  return (uint32_t)(static_cast<const unsigned char*>(p) - tsi_emu::tl_block->smem.data());
}

struct __nv_bfloat16 {
  uint16_t x;
};
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned u = __float_as_uint(f);
  if (std::isnan(f)) return {(uint16_t)((u >> 16) | 0x40)};
  return {(uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16)};  // round to nearest even
}

enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
// float -> e4m3 (round to nearest even; __NV_SATFINITE: out-of-range values to +-448, NaN to 0x7F).
inline unsigned char __nv_cvt_float_to_fp8(float f, __nv_saturation_t, __nv_fp8_interpretation_t) {
  if (std::isnan(f)) return 0x7F;
  const unsigned char sign = std::signbit(f) ? 0x80 : 0;
  const double a = std::fabs((double)f);
  if (a == 0.0) return sign;
  if (a >= 464.0) return sign | 0x7E;  // 464 rounds (to even) to 448, larger values past it: saturate
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  e -= 1;             // a = 1.x * 2^e
  if (e < -6) e = -6;  // subnormals: steps of 2^-9
  const double q = std::nearbyint(a * std::ldexp(1.0, 3 - e));  // 3 mantissa bits at exponent e
  unsigned code;
  if (e == -6 && q < 8) code = (unsigned)q;                       // subnormal (or zero)
  else code = (q >= 16 ? (unsigned)(e + 8) << 3 : (unsigned)(e + 7) << 3 | ((unsigned)q - 8));
  if (code > 0x7E) code = 0x7E;
  return sign | (unsigned char)code;
}

// e4m3 byte -> value, every byte tabulated once.
inline double tsi_emu_e4m3(unsigned b) {
  static const auto lut = [] {
    struct T {
      double v[256];
    } t;
    for (unsigned x = 0; x < 256; ++x) {
      const int e = (x >> 3) & 15, m = x & 7;
      const double v = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp((double)m, -9) : std::ldexp(8.0 + m, e - 10);
      t.v[x] = (x & 0x80) ? -v : v;
    }
    return t;
  }();
  return lut.v[b & 0xFF];
}

// The PTX helpers of scoring.cu.
inline float relu_nan(float x) { return std::isnan(x) ? x : (x > 0.f ? x : 0.f); }

inline void e2m1x8_to_e4m3(uint32_t w, uint32_t l0, uint32_t l1, uint32_t& o0, uint32_t& o1) {
  const uint32_t m = w & 0x77777777u, t = w << 4;
  o0 = __byte_perm(l0, l1, m & 0xFFFF) | (__byte_perm(t, w, 0x5140) & 0x80808080u);
  o1 = __byte_perm(l0, l1, m >> 16) | (__byte_perm(t, w, 0x7362) & 0x80808080u);
}

inline void cp_async_n(uint32_t dst, const void* src, int src_bytes, int n) {
  tsi_emu::async_copy(tsi_emu::tl_block->smem.data() + dst, src, src_bytes, n);
}
inline void cp_async16(uint32_t dst, const void* src, int src_bytes) { cp_async_n(dst, src, src_bytes, 16); }
inline void cp_async8(uint32_t dst, const void* src, int src_bytes) { cp_async_n(dst, src, src_bytes, 8); }
inline void cp_async4(uint32_t dst, const void* src, int src_bytes) { cp_async_n(dst, src, src_bytes, 4); }
inline void cp_async_commit() { tsi_emu::async_commit(); }
template <int N>
inline void cp_async_wait() {
  tsi_emu::async_wait(N);
}

inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int N>
inline void wgmma_wait() {}
template <int R>
inline void fence_operands(float (&)[R]) {}
inline void fence_async_smem() {}

// m64nNk32 e4m3 x e4m3 -> f32, N = 2 R. A fragment of thread (warp w, lane l, t = l % 4): a0 = row 16 w + l / 4,
// columns 4 t .. 4 t + 3 (byte i = column 4 t + i); a1 = row + 8; a2, a3 = columns + 16. D fragment: d[4 c + j] =
// (row 16 w + l / 4 + 8 (j >> 1), column 8 c + 2 t + (j & 1)). B (K x N, K-major, no swizzle) at the descriptor's
// start address: element (k, n) at (k / 16) * LBO + (n / 8) * SBO + (n % 8) * 16 + k % 16.
template <int R>
inline void wgmma(float (&d)[R], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc, int accumulate) {
  static_assert(R == 8 || R == 16 || R == 32, "N = 16, 32, 64");
  // The warpgroup's A fragments, 4 words per thread, in two buffers used alternately: a thread writes one only
  // after every thread has passed the barrier of the previous call, i.e. finished reading the one before.
  static thread_local unsigned parity = 0;  // (a thread is created per block: it starts at 0 in every block)
  auto* blk = tsi_emu::tl_block;
  uint32_t* A = blk->scratch + 512 * (parity ^= 1u);
  const int tid = (int)threadIdx.x;
  A[4 * tid] = a0;
  A[4 * tid + 1] = a1;
  A[4 * tid + 2] = a2;
  A[4 * tid + 3] = a3;
  blk->bar.arrive_and_wait();
  const unsigned char* sm = blk->smem.data();
  const uint32_t start = (uint32_t)(desc & 0x3FFF) << 4, lbo = (uint32_t)((desc >> 16) & 0x3FFF) << 4,
                 sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
  auto a_at = [&](int row, int k) {
    const int w = row / 16, rr = row % 16;
    const int thread = 32 * w + 4 * (rr % 8) + (k % 16) / 4, reg = (rr >= 8) + 2 * (k >= 16);
    return (A[4 * thread + reg] >> (8 * (k % 4))) & 0xFF;
  };
  const int warp = tid / 32, lane = tid % 32, t = lane % 4, r0 = 16 * warp + lane / 4;
  for (int i = 0; i < R; ++i) {
    const int row = r0 + 8 * ((i % 4) >> 1), col = 8 * (i / 4) + 2 * t + (i & 1);
    double s = 0.0;
    for (int k = 0; k < 32; ++k)
      s += tsi_emu_e4m3(a_at(row, k)) *
           tsi_emu_e4m3(sm[start + (k / 16) * lbo + (col / 8) * sbo + (col % 8) * 16 + k % 16]);
    d[i] = accumulate ? (float)(d[i] + s) : (float)s;
  }
}
