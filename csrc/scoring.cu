// SM90 decode scoring kernels of libsparse_indexer_scoring.so: paged_mqa_logits and paged_sparse_mqa_logits
// on FP8 and MXFP4 caches, up to 64 heads, D = 64 or 128 (SPEC sections 2-4). C ABI over raw device
// pointers like the top-k library: one build serves every torch version; launches never synchronize,
// never allocate, and their configuration depends only on the shapes (capturable in CUDA graphs).
//
// Design (csrc/README.md; measurements in benchmarks/NOTES.md, "CUDA decode scoring"): one warpgroup per program
// = (query row, run of columns). A tile is 64 columns (tokens) = the M of one wgmma m64nNk32 per 32 of D, with
// the K tile as the register operand A: each thread copies its bytes of two tokens (cp.async, P tiles in
// flight) into staging slots only it reads back, then converts them straight into its A registers: no barrier
// per tile, no operand layout conversion. The queries (operand B, N = heads padded to 16/32/64) sit in shared
// memory, permuted along D to match the order in which a thread holds K (the dot product does not care about
// the order of D, only that A and B agree). MXFP4 tokens have their group scales folded into the e4m3 operand
// (exact while a token's groups span <= 11 binades), queries theirs (<= 14 binades); a program that meets a
// scale that does not fold scores its columns again the per-group way (per-group partial products, fp32 scale
// multiplies).
#ifdef TSI_EMULATE
#include "emu/scoring_emu.h"  // CPU emulation build (CSRC=scoring.cu csrc/emu/build_emu.sh): the PTX below, in C++
#else
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#endif

#include <cstddef>
#include <cstdint>

namespace tsi_scoring {

constexpr int kThreads = 128;  // one warpgroup
constexpr int kTileN = 64;     // columns per tile: the wgmma M
constexpr int kMaxTiles = 64;  // tiles per program at most
// Shared-memory ids per program: candidate slots (cbs >= 8) or pages (block_size >= 16, + 1 for a run that
// does not start on a page boundary).
constexpr int kMaxEntries = kMaxTiles * kTileN / 8;

// Development ablations for benchmarks (scripts/sweep_cuda_decode.py times such builds against the default one in
// one process; their scores are wrong): -DTSI_SCORING_ABLATE=bits takes one part out of the main pass, so the time
// it saves is what that part costs on the critical path. 1: the MXFP4 fold and scale-span check (the raw e2m1
// words are the operand); 2: the wgmmas (the accumulators alias operand words); 4: the epilogue's head sum (one
// accumulator per token); 8: the K bytes (every copy of 0 bytes, zero fill: no DRAM traffic for K). 0 (the
// default) compiles none of it. Ablation builds also keep the default build's occupancy (smem_bytes), so that
// their times differ by the removed work, not by more CTAs per SM from fewer registers.
#ifndef TSI_SCORING_ABLATE
#define TSI_SCORING_ABLATE 0
#endif
constexpr int kAblate = TSI_SCORING_ABLATE;

struct Params {
  const uint8_t* q;          // [R, H, D] e4m3 or [R, H, D/2] e2m1 pairs
  const int32_t* q_scale;    // [R, H] UE8M0 words (mxfp4)
  const void* w;             // [R, >= H] f32 or bf16, row stride w_stride
  const uint8_t* kv;         // pages of page_stride bytes
  const int32_t* context_lens;
  const int32_t* block_table;  // [nreq, mb], row stride bt_stride
  const int32_t* req_indices;  // [R] or null (row r = request r)
  const int32_t* cand;       // [R, ncand] candidate block ids (sparse)
  void* out;                 // [R, L] f32 or bf16, row stride out_stride
  long long page_stride, out_stride, w_stride, bt_stride;
  int H, L, nreq, mb, nb_cache, lbs, ncand, lcbs, cols, w_bf16, out_bf16;
};

// MXFP4 fold tables (the Triton kernel's, triton_scoring._KF_*): e4m3 bytes of the e2m1 magnitudes 0, 0.5,
// 1, 1.5, 2, 3, 4, 6 times 2^6, four to a word, and the per-byte step that lowers a nonzero entry one binade.
// (enumerators: unused constants warn in the builds without wgmma)
enum : uint32_t { kLut0 = 0x6C686000u, kLut1 = 0x7C787470u, kStep0 = 0x08080800u, kStep1 = 0x08080808u };
enum : int {
  kKSpan = 11,  // a token's groups fold exactly within this many binades (0.5 * 2^(6-11) is normal)
  kQSpan = 14,  // a query head's live groups: 0.5 * 2^(6-14) = 2^-9 is the least e4m3 subnormal
};

__device__ __forceinline__ float ue8m0(uint32_t e) { return __uint_as_float(e == 0 ? 0x00400000u : e << 23); }

#ifndef TSI_EMULATE  // (the emulation build has these in emu/scoring_emu.h)
// max.NaN: a NaN score from garbage cache bytes must stay NaN (SPEC 2), where fmaxf would drop it.
__device__ __forceinline__ float relu_nan(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(y) : "f"(x));
  return y;
}

// 8 e2m1 nibbles (element 2i low, 2i+1 high) -> two words of e4m3 bytes of value * 2^(6 - d), elements 0..3
// and 4..7, with (l0, l1) = the fold tables lowered d binades: the magnitudes index the table (prmt), the
// signs land on bit 7 through a byte permute of w and w << 4.
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t w, uint32_t l0, uint32_t l1, uint32_t& o0, uint32_t& o1) {
  asm("{ .reg .b32 m, s, t;\n"
      "and.b32 m, %2, 0x77777777;\n"
      "prmt.b32 %0, %3, %4, m;\n"
      "shr.b32 m, m, 16;\n"
      "prmt.b32 %1, %3, %4, m;\n"
      "shl.b32 t, %2, 4;\n"
      "prmt.b32 s, t, %2, 0x5140;\n"
      "and.b32 s, s, 0x80808080;\n"
      "or.b32 %0, %0, s;\n"
      "prmt.b32 s, t, %2, 0x7362;\n"
      "and.b32 s, s, 0x80808080;\n"
      "or.b32 %1, %1, s; }"
      : "=r"(o0), "=r"(o1)
      : "r"(w), "r"(l0), "r"(l1));
}

// Asynchronous copies into the thread's own staging slots (src_bytes 0: zero fill, nothing read). A thread reads
// back only what it copied itself, after cp.async.wait_group: no barrier is needed.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif  // TSI_EMULATE

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TSI_WGMMA 1
#elif defined(TSI_EMULATE)
#define TSI_WGMMA 1
#endif

#if defined(TSI_WGMMA) && !defined(TSI_EMULATE)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins accumulator registers at this point of the program: the wgmma writes them asynchronously, so the
// compiler must neither read them before the wait nor move their zeroing after the wgmma.
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// m64nNk32 e4m3 x e4m3 -> f32 (N = 2 x the accumulator registers per thread: 16, 32, 64), A = four registers per
// thread, B = the shared-memory matrix of `desc` (K-major, no swizzle); `accumulate` 0 overwrites d.
__device__ __forceinline__ void wgmma(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                      uint64_t desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %12, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %13, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(accumulate), "l"(desc));
}

__device__ __forceinline__ void wgmma(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                      uint64_t desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %20, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %21, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(accumulate), "l"(desc));
}

__device__ __forceinline__ void wgmma(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                      uint64_t desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %36, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %37, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(accumulate), "l"(desc));
}
#endif  // TSI_WGMMA && !TSI_EMULATE

// Where a candidate slot's (sparse) or a page's (dense) tokens are: the address of its first column's token
// (`tok`), from there to that token's scale word (`sdelta`; token i of the slot: tok + i * VB and
// tok + sdelta + 4 * i), and how many of its columns are valid (`limit`: 0 for a -1 or out-of-range block, a
// hole in the block table, columns past the row's length or the program's last column). Addresses, not
// offsets: the per-tile copies then add only a 32-bit offset to a 64-bit pointer.
struct alignas(16) Ent {
  const uint8_t* tok;
  int sdelta, limit;
};

template <int N, int D, bool FP4>
struct alignas(128) Smem {
  uint8_t qf[N * D];                // queries in the wgmma B layout: e4m3 (FP8) or folded e2m1 (MXFP4)
  float wf[N];                      // weights of the main pass (MXFP4: times 2^(c - 127) / 4096)
  float wu[N];                      // weights of the per-group pass (/ 4096: both operands carry 2^6)
  float sq[FP4 ? D / 32 : 1][N];    // query group scales 2^(e - 127) (per-group pass)
  int qc[N];                        // MXFP4: each head's largest live-group exponent
  uint32_t qw[N];                   // MXFP4: each head's scale word
  Ent ent[kMaxEntries];             // per candidate slot (sparse) or page (dense) of the program's tiles
};

// Which D elements a thread's A word m (of 2 * D / 32) holds, for quad position t (elements e .. e + 3), given
// which bytes of a token the thread copies (Stage::part_offset).
template <int D, bool FP4>
__host__ __device__ constexpr int elem_of(int t, int m) {
  return FP4 ? (D == 128 ? 32 * t + 4 * m : 16 * t + 4 * m)
             : (D == 128 ? (m < 4 ? 16 * t + 4 * m : 64 + 16 * t + 4 * (m - 4)) : 16 * t + 4 * m);
}

// Byte offset of (head h, A word m of quad position t) in the B layout: per k32 step a block of N x 32 bytes
// as 16-byte core-matrix rows, 8 heads per 128-byte core matrix, the two 16-byte halves of the step N * 16
// bytes apart (the descriptor's leading-dimension offset), 8-head groups 128 bytes apart (stride offset).
template <int N>
__device__ __forceinline__ int b_offset(int h, int t, int m) {
  return (m >> 1) * (N * 32) + (m & 1) * (N * 16) + (h >> 3) * 128 + (h & 7) * 16 + 4 * t;
}

template <int N>
__device__ __forceinline__ uint64_t b_desc(const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((N * 16) >> 4) << 16;  // leading byte offset: the K-adjacent core matrix
  d |= static_cast<uint64_t>(128 >> 4) << 32;       // stride byte offset: the next 8 heads
  return d;                                        // base offset 0, no swizzle
}

// The staging of one tile: for each thread, tokens r0 = 16 * warp + lane / 4 and r0 + 8 of the tile, quad position
// t's part of each token (FP8 D = 128: bytes 16t.. and 64 + 16t.., 16 each; D = 64: 16t..; MXFP4 D = 128: 16t..
// (group t), D = 64: 8t.. (8 bytes)), and each token's scale word, copied by cp.async with P tiles in flight.
// (Loads straight into registers were slower: the wgmma fence waits for every outstanding register write, so
// each tile waited for the whole prefetch; measured 166 vs 98 us, FP8 sparse decode.)
template <int D, bool FP4>
struct Stage {
  static constexpr int VB = FP4 ? D / 2 : D;    // value bytes per token
  static constexpr int LW = VB / 16;            // 32-bit words per token per thread
  static constexpr int CB = LW >= 4 ? 16 : 8;   // bytes per copy
  static constexpr int CPR = LW * 4 / CB;       // copies per token per thread
  // Stage layout: copy (token rr, part j) of thread tid at ((rr * CPR + j) * 128 + tid) * CB (consecutive
  // threads on consecutive 16 bytes: conflict-free reads), then the scale words at (rr * 128 + tid) * 4.
  static constexpr int kScales = 2 * CPR * kThreads * CB;
  static constexpr int kStage = kScales + 2 * kThreads * 4;
  __host__ __device__ static constexpr int part_offset(int t, int j) {
    return !FP4 && D == 128 ? 64 * j + 16 * t : CB * t;
  }
};

template <int N, int D, bool FP4, int P>
constexpr int smem_bytes() {
  const int b = static_cast<int>((sizeof(Smem<N, D, FP4>) + 127) / 128 * 128) + P * Stage<D, FP4>::kStage;
  return kAblate != 0 && b < 49 * 1024 ? 49 * 1024 : b;  // (at most 4 CTAs per SM: 228 KB < 5 x 49 KB)
}

template <int D, bool FP4, int N, bool SPARSE, int P>
struct Program {
  using T = Stage<D, FP4>;
  static constexpr int VB = T::VB;
  static constexpr int LW = T::LW;
  static constexpr int KS = D / 32;  // k32 steps
  static constexpr int NW = 2 * KS;  // A words per token per thread
  static constexpr int G = D / 32;   // MXFP4 groups
  static constexpr int NACC = N / 2;

  const Params& p;
  Smem<N, D, FP4>& sm;
  uint8_t* ring;       // P stages of T::kStage bytes
  uint32_t ring_s;     // the same, as a shared-memory address
  uint32_t vmask = 0;  // bit 2 * stage + rr: token rr of the tile in that stage is valid
  int row, c_lo, c_hi, c_mid, n, req, ntile, p0, cbs_mask, bs_mask, r0, t;
  int part;            // the thread's byte offset within a token (T::part_offset(t, 0))
  void* outp;          // the output of this thread's stored column in tile 0 (quad positions 0 and 1 store)
  int ncols;           // columns of the program from that one on: tile k stores while k * kTileN < ncols

  __device__ Program(const Params& p_, Smem<N, D, FP4>& sm_, uint8_t* ring_)
      : p(p_), sm(sm_), ring(ring_), ring_s(static_cast<uint32_t>(__cvta_generic_to_shared(ring_))) {}

  // Copies of tile k (k >= ntile: none) into `stage`, committed as one group. (No branch on k: the copies of
  // a tile past the end are issued with 0 bytes, so the scheduler can interleave this with the tile in hand.)
  __device__ __forceinline__ void issue(int k, int stage) {
    const uint32_t dst = ring_s + stage * T::kStage + threadIdx.x * T::CB;
    const uint32_t sdst = ring_s + stage * T::kStage + T::kScales + threadIdx.x * 4;
    const bool live = k < ntile;
    const int cl = (live ? k : 0) * kTileN + r0;  // column within the program
    uint32_t vbits = 0;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int c = cl + 8 * rr;
      int ei, i;
      if (SPARSE) {  // (c_lo is a multiple of 64, hence of the candidate block size)
        ei = c >> p.lcbs;
        i = c & cbs_mask;
      } else {
        ei = ((c_lo + c) >> p.lbs) - p0;
        i = (c_lo + c) & bs_mask;
      }
      const Ent e = sm.ent[ei];
      const bool v = live && i < e.limit;
      const bool copy = v && !(kAblate & 8);
      const int nb = copy ? T::CB : 0;
      const uint8_t* tok = e.tok + (i * VB + part);  // (an invalid entry points at the cache: 0 bytes copied)
#pragma unroll
      for (int j = 0; j < T::CPR; ++j) {
        const uint32_t d = dst + (rr * T::CPR + j) * kThreads * T::CB;
        if (T::CB == 16)
          cp_async16(d, tok + T::part_offset(0, j), nb);
        else
          cp_async8(d, tok + T::part_offset(0, j), nb);
      }
      cp_async4(sdst + rr * kThreads * 4, e.tok + (e.sdelta + 4 * i), copy ? 4 : 0);
      vbits |= static_cast<uint32_t>(v) << rr;
    }
    vmask = (vmask & ~(3u << (2 * stage))) | (vbits << (2 * stage));
    cp_async_commit();
  }

  // The thread's bytes of the tile in `stage` (its copies complete: cp.async.wait_group).
  __device__ __forceinline__ void read(int stage, uint32_t (&w)[2][LW], uint32_t (&sc)[2]) const {
    const uint8_t* base = ring + stage * T::kStage;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
      for (int j = 0; j < T::CPR; ++j) {
        const uint8_t* src = base + ((rr * T::CPR + j) * kThreads + threadIdx.x) * T::CB;
        if (T::CB == 16) {
          const uint4 v = *reinterpret_cast<const uint4*>(src);
          w[rr][4 * j] = v.x;
          w[rr][4 * j + 1] = v.y;
          w[rr][4 * j + 2] = v.z;
          w[rr][4 * j + 3] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(src);
          w[rr][2 * j] = v.x;
          w[rr][2 * j + 1] = v.y;
        }
      }
      sc[rr] = *reinterpret_cast<const uint32_t*>(base + T::kScales + (rr * kThreads + threadIdx.x) * 4);
    }
  }

#ifdef TSI_WGMMA
  // Head sum of relu(acc) * w for the thread's two tokens (quad-reduced), scaled, stored.
  // (weights in registers: read from shared memory per tile they measured 7% slower, MXFP4 sparse decode)
  __device__ __forceinline__ void epilogue(const float (&acc)[NACC], const float (&wr)[N / 4], const float (&ksc)[2],
                                           int stage, int k) const {
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int c = 0; c < ((kAblate & 4) ? 1 : N / 8); ++c) {
      s0 = fmaf(relu_nan(acc[4 * c]), wr[2 * c], s0);
      s0 = fmaf(relu_nan(acc[4 * c + 1]), wr[2 * c + 1], s0);
      s1 = fmaf(relu_nan(acc[4 * c + 2]), wr[2 * c], s1);
      s1 = fmaf(relu_nan(acc[4 * c + 3]), wr[2 * c + 1], s1);
    }
    // Quad sums with one exchange per step: the even quad positions sum token r0's partials, the odd ones
    // token r0 + 8's; positions 0 and 1 end with the two totals (the same additions, in the same order, as
    // reducing each token across the quad).
    const bool odd = t & 1;
    float sum = odd ? s1 : s0;
    sum += __shfl_xor_sync(0xffffffffu, odd ? s0 : s1, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (t < 2 && k * kTileN < ncols) {
      // (a select, not ksc[t]: a runtime index would put the array in local memory)
      const bool ok = (vmask >> (2 * stage + t)) & 1;
      store(outp, k * kTileN, ok ? sum * (odd ? ksc[1] : ksc[0]) : -__int_as_float(0x7f800000));
    }
  }

  // out[i] = v for the row's output `out` (f32 or bf16, p.out_bf16).
  __device__ __forceinline__ void store(void* out, long long i, float v) const {
    if (p.out_bf16)
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(out)[i] = v;
  }

  // The tile's wgmmas: acc = A x B over D, A = the thread's operand words a[token][word], B at `desc`.
  __device__ __forceinline__ void mma(float (&acc)[NACC], const uint32_t (&a)[2][NW], uint64_t desc) const {
    if constexpr ((kAblate & 2) != 0) {
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[i] = __uint_as_float(a[i & 1][(i >> 1) % NW]);
      return;
    }
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < KS; ++j)
      wgmma(acc, a[0][2 * j], a[1][2 * j], a[0][2 * j + 1], a[1][2 * j + 1], desc + j * ((N * 32) >> 4), j);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(acc);  // (the accumulators are read only after the wait)
  }

  // Main pass over the tile in `stage`: A operands (FP8 as loaded; MXFP4 folded, flagging in `bad` the tokens
  // whose scales do not fold), the wgmmas, the epilogue. (Two tiles in flight per warpgroup, one's wgmmas during
  // the other's epilogue, measured no faster: it needs ~160 registers, three CTAs per SM instead of four.)
  __device__ __forceinline__ void score_tile(int stage, int k, uint64_t desc, const float (&wr)[N / 4],
                                             bool& bad) const {
    uint32_t a[2][NW], raw[2][LW], sc[2];
    float ksc[2];
    if (FP4)
      read(stage, raw, sc);
    else
      read(stage, reinterpret_cast<uint32_t(&)[2][LW]>(a), sc);  // FP8: the bytes are the operand
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      if (FP4 && (kAblate & 1)) {
#pragma unroll
        for (int i = 0; i < LW; ++i) {
          a[rr][2 * i] = raw[rr][i];
          a[rr][2 * i + 1] = raw[rr][i] >> 4;
        }
        ksc[rr] = 1.f;
      } else if (FP4) {
        // The token's group exponents are bytes 0..G-1 of its scale word; ref = the largest. Per byte
        // ref - e (no borrow crosses a byte: every e <= ref); the span check tests all bytes at once.
        constexpr uint32_t kBytes = G == 4 ? 0xFFFFFFFFu : 0x0000FFFFu;
        const uint32_t sw = sc[rr] & kBytes;
        uint32_t ref = sw & 0xFF;
#pragma unroll
        for (int gg = 1; gg < G; ++gg) ref = max(ref, __byte_perm(sw, 0, 0x4440 + gg));
        const uint32_t dall = ref * (0x01010101u & kBytes) - sw;
        constexpr uint32_t kOver = (0x80u - (kKSpan + 1)) * 0x01010101u;  // byte + kOver >= 0x80: span > kKSpan
        bad |= ((((dall & 0x7F7F7F7Fu) + kOver) | dall) & (0x80808080u & kBytes)) != 0 || ref == 255;
        const uint32_t d = __byte_perm(dall, 0, 0x4440 + (D == 128 ? t : t >> 1));
        const uint32_t l0 = kLut0 - d * kStep0, l1 = kLut1 - d * kStep1;
#pragma unroll
        for (int i = 0; i < LW; ++i) e2m1x8_to_e4m3(raw[rr][i], l0, l1, a[rr][2 * i], a[rr][2 * i + 1]);
        ksc[rr] = ue8m0(ref);
      } else {
        ksc[rr] = __uint_as_float(sc[rr]);
      }
    }
    float acc[NACC];
    mma(acc, a, desc);
    epilogue(acc, wr, ksc, stage, k);
  }

  // MXFP4 per-group pass over one tile: per group, the A words of the quad positions holding it (the others
  // zero) against the unfolded queries, the partial sums scaled by the token's and head's group scales.
  __device__ __forceinline__ void score_per_group(int stage, int k, uint64_t desc, const float (&wr)[N / 4]) const {
    uint32_t raw[2][LW], sc[2];
    read(stage, raw, sc);
    const int mine = D == 128 ? t : t >> 1;
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
#pragma unroll 1
    for (int gg = 0; gg < G; ++gg) {
      // e4m3 of value * 2^6 (the tables unlowered) where this quad position holds group gg, else zeros
      const uint32_t keep = gg == mine ? 0xFFFFFFFFu : 0u;
      uint32_t a[2][NW];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
#pragma unroll
        for (int i = 0; i < LW; ++i)
          e2m1x8_to_e4m3(raw[rr][i] & keep, kLut0, kLut1, a[rr][2 * i], a[rr][2 * i + 1]);
      float part[NACC];
      mma(part, a, desc);
      const float k0 = ue8m0((sc[0] >> (8 * gg)) & 0xFF), k1 = ue8m0((sc[1] >> (8 * gg)) & 0xFF);
#pragma unroll
      for (int c = 0; c < N / 8; ++c) {
        const float q0 = sm.sq[gg][8 * c + 2 * t], q1 = sm.sq[gg][8 * c + 2 * t + 1];
        acc[4 * c] = fmaf(part[4 * c], k0 * q0, acc[4 * c]);
        acc[4 * c + 1] = fmaf(part[4 * c + 1], k0 * q1, acc[4 * c + 1]);
        acc[4 * c + 2] = fmaf(part[4 * c + 2], k1 * q0, acc[4 * c + 2]);
        acc[4 * c + 3] = fmaf(part[4 * c + 3], k1 * q1, acc[4 * c + 3]);
      }
    }
    const float one[2] = {1.f, 1.f};
    epilogue(acc, wr, one, stage, k);
  }
#endif

  // Queries of this row into the B layout (`fold`: MXFP4 folded per head, else value * 2^6 for MXFP4).
  __device__ __forceinline__ void fill_queries(uint8_t* dst, bool fold) const {
    const int tid = threadIdx.x;
    for (int i = tid; i < N * 4 * NW; i += kThreads) {
      const int h = i / (4 * NW), tt = (i / NW) & 3, m = i % NW;
      const int e0 = elem_of<D, FP4>(tt, m);
      uint32_t v = 0;
      if (h < p.H) {
        const uint8_t* qh = p.q + (static_cast<long long>(row) * p.H + h) * VB;
        if (FP4) {
          const uint32_t bits = *reinterpret_cast<const uint16_t*>(qh + e0 / 2);
          const int e = static_cast<int>((sm.qw[h] >> (8 * (e0 / 32))) & 0xFF);
          const int dq = fold ? min(max(sm.qc[h] - e, 0), kQSpan) : 0;
          const float f = __uint_as_float(static_cast<uint32_t>(127 + 6 - dq) << 23);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t code = (bits >> (4 * j)) & 15;
            const uint32_t mg = code & 7;
            const float mag = mg < 2 ? 0.5f * mg : (2 + (mg & 1)) * __uint_as_float(((mg >> 1) + 125) << 23);
            const float val = (code & 8) ? -mag : mag;
            v |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(val * f, __NV_SATFINITE, __NV_E4M3)) << (8 * j);
          }
        } else {
          v = *reinterpret_cast<const uint32_t*>(qh + e0);
        }
      }
      *reinterpret_cast<uint32_t*>(dst + b_offset<N>(h, tt, m)) = v;
    }
  }

  __device__ void run() {
#ifdef TSI_WGMMA
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    t = lane & 3;
    r0 = 16 * warp + (lane >> 2);
    row = blockIdx.x;
    c_lo = blockIdx.y * p.cols;
    c_hi = min(c_lo + p.cols, p.L);
    const int BS = 1 << p.lbs;
    bs_mask = BS - 1;
    cbs_mask = (1 << p.lcbs) - 1;
    n = p.context_lens[row];
    req = p.req_indices ? p.req_indices[row] : row;
    n = min(max(n, 0), p.mb << p.lbs);
    if (req < 0 || req >= p.nreq) n = 0;
    req = min(max(req, 0), p.nreq - 1);
    c_mid = SPARSE ? c_hi : min(c_hi, max(c_lo, n));
    ntile = c_mid > c_lo ? (c_mid - c_lo + kTileN - 1) / kTileN : 0;
    p0 = c_lo >> p.lbs;
    part = T::part_offset(t, 0);
    {
      const int c0 = c_lo + r0 + 8 * (t & 1);
      ncols = c_hi - c0;
      const long long o = static_cast<long long>(row) * p.out_stride + c0;
      outp = p.out_bf16 ? static_cast<void*>(static_cast<__nv_bfloat16*>(p.out) + o)
                        : static_cast<void*>(static_cast<float*>(p.out) + o);
    }

    // Per head: weights, MXFP4 query scales (largest live-group exponent; whether the live groups fold).
    int ok = 1;
    if (tid < N) {
      const int h = tid;
      float w = 0.f;
      if (h < p.H) {
        const long long wi = static_cast<long long>(row) * p.w_stride + h;
        w = p.w_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.w)[wi])
                     : static_cast<const float*>(p.w)[wi];
      }
      if (FP4) {
        uint32_t qw = 0x7F7F7F7Fu;
        int c = 0;
        if (h < p.H) {
          qw = static_cast<uint32_t>(p.q_scale[static_cast<long long>(row) * p.H + h]);
          const uint32_t* qb = reinterpret_cast<const uint32_t*>(p.q + (static_cast<long long>(row) * p.H + h) * VB);
          bool live[G];
#pragma unroll
          for (int gg = 0; gg < G; ++gg) {
            uint32_t any = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) any |= qb[4 * gg + i] & 0x77777777u;  // -0 (code 8) counts as zero
            live[gg] = any != 0;
            if (live[gg]) c = max(c, static_cast<int>((qw >> (8 * gg)) & 0xFF));
          }
#pragma unroll
          for (int gg = 0; gg < G; ++gg)
            if (live[gg] && c - static_cast<int>((qw >> (8 * gg)) & 0xFF) > kQSpan) ok = 0;
        }
        sm.qw[h] = qw;
        sm.qc[h] = c;
        sm.wf[h] = w * ue8m0(static_cast<uint32_t>(c)) * (1.0f / 4096.0f);
        sm.wu[h] = w * (1.0f / 4096.0f);
#pragma unroll
        for (int gg = 0; gg < G; ++gg) sm.sq[gg][h] = ue8m0((qw >> (8 * gg)) & 0xFF);
      } else {
        sm.wf[h] = w;
      }
    }
    // Ids of the program's columns resolved once (Ent), for every slot or page its tiles touch.
    if (SPARSE) {
      const int nblk = (n + cbs_mask) >> p.lcbs;
      const int s0 = c_lo >> p.lcbs, ns = (c_hi - c_lo + cbs_mask) >> p.lcbs, ne = (ntile * kTileN) >> p.lcbs;
      const int32_t* cand = p.cand + static_cast<long long>(row) * p.ncand;
      for (int s = tid; s < ne; s += kThreads) {
        const int slot = s0 + s;
        const int blk = s < ns && slot < p.ncand ? cand[slot] : -1;
        Ent e = {p.kv, 0, 0};
        if (blk >= 0 && blk < nblk) {
          const int posb = blk << p.lcbs;
          const int pg = p.block_table[static_cast<long long>(req) * p.bt_stride + (posb >> p.lbs)];
          if (pg >= 0 && pg < p.nb_cache) {
            const int first = posb & bs_mask;
            e.tok = p.kv + (static_cast<long long>(pg) * p.page_stride + first * VB);
            e.sdelta = (bs_mask + 1) * VB + first * (4 - VB);
            e.limit = min(cbs_mask + 1, n - posb);
          }
        }
        sm.ent[s] = e;
      }
    } else if (ntile > 0) {
      const int ne = ((c_lo + ntile * kTileN - 1) >> p.lbs) - p0 + 1;
      for (int s = tid; s < ne; s += kThreads) {
        const int pi = p0 + s;
        Ent e = {p.kv, 0, 0};
        if (pi < p.mb && (pi << p.lbs) < c_mid) {
          const int pg = p.block_table[static_cast<long long>(req) * p.bt_stride + pi];
          if (pg >= 0 && pg < p.nb_cache) {
            e.tok = p.kv + static_cast<long long>(pg) * p.page_stride;
            e.sdelta = (bs_mask + 1) * VB;
            e.limit = min(bs_mask + 1, c_mid - (pi << p.lbs));
          }
        }
        sm.ent[s] = e;
      }
    }
    if (FP4) ok = __syncthreads_and(ok);
    else __syncthreads();
    fill_queries(sm.qf, true);
    fence_async_smem();
    __syncthreads();

    float wr[N / 4];
#pragma unroll
    for (int c = 0; c < N / 8; ++c) {
      wr[2 * c] = sm.wf[8 * c + 2 * t];
      wr[2 * c + 1] = sm.wf[8 * c + 2 * t + 1];
    }
    const uint64_t desc_f = b_desc<N>(sm.qf);
    bool bad = false;
    if (ok && ntile > 0) {  // (with no tile the table is not filled: issue() reads tile 0's entries past the end)
#pragma unroll
      for (int s = 0; s < P - 1; ++s) issue(s, s);
      int rd = 0, wr_stage = P - 1;
#pragma unroll 4  // (ring stages fold into constants: 297 -> 260 instructions per MXFP4 tile; runs 67-69)
      for (int k = 0; k < ntile; ++k) {
        issue(k + P - 1, wr_stage);
        cp_async_wait<P - 1>();
        score_tile(rd, k, desc_f, wr, bad);
        rd = rd == P - 1 ? 0 : rd + 1;
        wr_stage = wr_stage == P - 1 ? 0 : wr_stage + 1;
      }
    }
    if (FP4) {
      // (the barrier also orders the main pass's stores before the per-group pass overwrites them)
      const int again = __syncthreads_or(bad ? 1 : 0) || !ok;
      if (again) {
        cp_async_wait<0>();
        // Every thread's copies have landed before anyone overwrites the ring: a thread's last copies (of the
        // tiles past the end, zero-filled) into its slots could otherwise land on another's queries.
        __syncthreads();
        // the unfolded queries go to ring stages 1.. (free now; the loads below use stage 0)
        static_assert(!FP4 || (P - 1) * T::kStage >= N * D, "the per-group queries need P - 1 ring stages");
        uint8_t* qu = ring + T::kStage;
        fill_queries(qu, false);
        fence_async_smem();
        __syncthreads();
#pragma unroll
        for (int c = 0; c < N / 8; ++c) {
          wr[2 * c] = sm.wu[8 * c + 2 * t];
          wr[2 * c + 1] = sm.wu[8 * c + 2 * t + 1];
        }
        const uint64_t desc_u = b_desc<N>(qu);
#pragma unroll 1
        for (int k = 0; k < ntile; ++k) {
          issue(k, 0);
          cp_async_wait<0>();
          score_per_group(0, k, desc_u, wr);
        }
      }
    }
    // Dense rows: the columns past the length only need -inf.
    const float ninf = -__int_as_float(0x7f800000);
    for (int c = c_lo + ntile * kTileN + tid; c < c_hi; c += kThreads)
      store(p.out, static_cast<long long>(row) * p.out_stride + c, ninf);
#else
    __trap();  // built without sm_90a wgmma (the Python side launches these kernels on SM90 only)
#endif
  }
};

// CTAs per SM the register allocation aims at (4: 128 registers per thread, no spills; a build with
// -DTSI_SCORING_MIN_BLOCKS=5 caps at 96 for benchmarks).
#ifndef TSI_SCORING_MIN_BLOCKS
#define TSI_SCORING_MIN_BLOCKS 4
#endif

template <int D, bool FP4, int N, bool SPARSE, int P>
__global__ void __launch_bounds__(kThreads, TSI_SCORING_MIN_BLOCKS) decode_kernel(const __grid_constant__ Params p) {
#ifdef TSI_EMULATE
  TSI_DYN_SMEM(dyn);
#else
  extern __shared__ __align__(128) uint8_t dyn[];
#endif
  auto& sm = *reinterpret_cast<Smem<N, D, FP4>*>(dyn);
  Program<D, FP4, N, SPARSE, P> prog(p, sm, dyn + (sizeof(Smem<N, D, FP4>) + 127) / 128 * 128);
  prog.run();
}

}  // namespace tsi_scoring

namespace {

using tsi_scoring::Params;

constexpr int kVersion = 1;
int g_depth = 0;  // tiles in flight per program at 64 heads (0: the default)

int log2_exact(int v) {
  int l = 0;
  while (l < 31 && (1 << l) < v) ++l;
  return (1 << l) == v ? l : -1;
}

template <int D, bool FP4, int N, bool SPARSE, int P>
cudaError_t launch_p(const Params& p, int rows, int progs, cudaStream_t stream) {
  constexpr int smem = tsi_scoring::smem_bytes<N, D, FP4, P>();
  auto kernel = tsi_scoring::decode_kernel<D, FP4, N, SPARSE, P>;
#ifdef TSI_EMULATE
  (void)stream;
  tsi_emu::launch_xy(rows, progs, tsi_scoring::kThreads, smem, [&]() { kernel(p); });
  return cudaSuccess;
#else
  if (smem > 48 * 1024) {
    // Raise the dynamic shared-memory limit once per device (not a stream operation: capture-safe).
    static bool done[64] = {false};
    int dev = 0;
    cudaGetDevice(&dev);
    if (!done[dev]) {
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
      done[dev] = true;
    }
  }
  kernel<<<dim3(rows, progs), tsi_scoring::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
#endif
}

template <int D, bool FP4, int N, bool SPARSE, int P>
int occupancy_p() {
#ifdef TSI_EMULATE
  return 4;
#else
  constexpr int smem = tsi_scoring::smem_bytes<N, D, FP4, P>();
  auto kernel = tsi_scoring::decode_kernel<D, FP4, N, SPARSE, P>;
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int v = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, tsi_scoring::kThreads, smem);
  return e == cudaSuccess ? v : -static_cast<int>(e);
#endif
}

// Tiles in flight per program (copies issued ahead; FP8 9 KB, MXFP4 5 KB per D = 128 stage): 4 by default (3, 4
// and 6 within 1% of each other at the sparse decode target shape, 3-4 up to 5% faster than 6 at the dense one;
// H200 runs 59-60). The 64-head kernels also build 3 and 6 for benchmarks (tsi_scoring_set_depth).
constexpr int kDefaultDepthFp8 = 4, kDefaultDepthFp4 = 4;

// Calls f.template operator()<P>() for the depth selected for (FP4, N).
template <bool FP4, int N, class F>
auto with_depth(F&& f) {
  constexpr int def = FP4 ? kDefaultDepthFp4 : kDefaultDepthFp8;
  if constexpr (N == 64) {
    const int depth = g_depth ? g_depth : def;
    if (depth == 3) return f.template operator()<3>();
    if (depth == 4) return f.template operator()<4>();
    return f.template operator()<6>();
  } else {
    return f.template operator()<def>();
  }
}

template <int D, bool FP4, int N, bool SPARSE>
cudaError_t launch_n(const Params& p, int rows, int progs, cudaStream_t stream) {
  return with_depth<FP4, N>([&]<int P>() { return launch_p<D, FP4, N, SPARSE, P>(p, rows, progs, stream); });
}

template <int D, bool FP4, bool SPARSE>
cudaError_t launch_d(const Params& p, int N, int rows, int progs, cudaStream_t stream) {
  if (N == 16) return launch_n<D, FP4, 16, SPARSE>(p, rows, progs, stream);
  if (N == 32) return launch_n<D, FP4, 32, SPARSE>(p, rows, progs, stream);
  return launch_n<D, FP4, 64, SPARSE>(p, rows, progs, stream);
}

template <int D, bool FP4, int N, bool SPARSE>
int occupancy_of() {
  return with_depth<FP4, N>([&]<int P>() { return occupancy_p<D, FP4, N, SPARSE, P>(); });
}

template <bool FP4, bool SPARSE>
int occupancy_fs(int D, int N) {
  if (D == 64) return N == 16 ? occupancy_of<64, FP4, 16, SPARSE>()
                    : N == 32 ? occupancy_of<64, FP4, 32, SPARSE>() : occupancy_of<64, FP4, 64, SPARSE>();
  return N == 16 ? occupancy_of<128, FP4, 16, SPARSE>()
       : N == 32 ? occupancy_of<128, FP4, 32, SPARSE>() : occupancy_of<128, FP4, 64, SPARSE>();
}

int heads_pad(int H) { return H <= 16 ? 16 : H <= 32 ? 32 : 64; }

}  // namespace

extern "C" {

int tsi_scoring_version() { return kVersion; }
#ifdef TSI_EMULATE
int tsi_scoring_emulated() { return 1; }  // a CPU emulation build: host pointers, kernels run on std::threads
#else
int tsi_scoring_emulated() { return 0; }
#endif
int tsi_scoring_max_heads() { return 64; }
int tsi_scoring_max_tiles() { return tsi_scoring::kMaxTiles; }
int tsi_scoring_tile() { return tsi_scoring::kTileN; }

// Tiles in flight per program for the 64-head kernels (3, 4 or 6; 0 = the default). Returns the previous value.
// For benchmarks that compare depths (results are identical, bit for bit).
int tsi_scoring_set_depth(int depth) {
  const int prev = g_depth;
  g_depth = (depth == 3 || depth == 4 || depth == 6) ? depth : 0;
  return prev;
}

// CTAs of the variant one SM holds at once (the occupancy calculator; < 0: a CUDA error code, negated).
int tsi_scoring_ctas_per_sm(int D, int fp4, int H, int sparse) {
  const int N = heads_pad(H);
  if (fp4) return sparse ? occupancy_fs<true, true>(D, N) : occupancy_fs<true, false>(D, N);
  return sparse ? occupancy_fs<false, true>(D, N) : occupancy_fs<false, false>(D, N);
}

const char* tsi_scoring_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// logits[r, c] of paged_mqa_logits (cand == null) or paged_sparse_mqa_logits, `tiles` tiles of 64 columns per
// program (1..tsi_scoring_max_tiles()). Returns a cudaError_t code; cudaErrorInvalidValue for arguments
// outside what the kernels take (the Python side checks them first).
int tsi_paged_scores(const void* q, const void* q_scale, const void* w, long long w_stride, int w_bf16,
                     const void* kv, long long page_stride, int nb_cache, int block_size, const void* context_lens,
                     const void* block_table, long long bt_stride, int nreq, int mb, const void* req_indices,
                     const void* cand, int ncand, int cbs, void* out, long long out_stride, int out_bf16, int R,
                     int H, int D, int fp4, int L, int tiles, size_t stream) {
  const int lbs = log2_exact(block_size), lcbs = cand ? log2_exact(cbs) : 0;
  if (R < 0 || L < 0 || H < 1 || H > 64 || (D != 64 && D != 128) || lbs < 0 || lcbs < 0 || tiles < 1 ||
      tiles > tsi_scoring::kMaxTiles || nreq < 1 || mb < 1)
    return static_cast<int>(cudaErrorInvalidValue);
  if (R == 0 || L == 0) return 0;
  Params p;
  p.q = static_cast<const uint8_t*>(q);
  p.q_scale = static_cast<const int32_t*>(q_scale);
  p.w = w;
  p.kv = static_cast<const uint8_t*>(kv);
  p.context_lens = static_cast<const int32_t*>(context_lens);
  p.block_table = static_cast<const int32_t*>(block_table);
  p.req_indices = static_cast<const int32_t*>(req_indices);
  p.cand = static_cast<const int32_t*>(cand);
  p.out = out;
  p.page_stride = page_stride;
  p.out_stride = out_stride;
  p.w_stride = w_stride;
  p.bt_stride = bt_stride;
  p.H = H;
  p.L = L;
  p.nreq = nreq;
  p.mb = mb;
  p.nb_cache = nb_cache;
  p.lbs = lbs;
  p.ncand = ncand;
  p.lcbs = lcbs;
  p.cols = tiles * tsi_scoring::kTileN;
  p.w_bf16 = w_bf16;
  p.out_bf16 = out_bf16;
  const int progs = (L + p.cols - 1) / p.cols;
  if (progs > 65535) return static_cast<int>(cudaErrorInvalidValue);
  const int N = heads_pad(H);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const bool sparse = cand != nullptr;
  if (fp4) {
    if (D == 64) return sparse ? launch_d<64, true, true>(p, N, R, progs, st) : launch_d<64, true, false>(p, N, R, progs, st);
    return sparse ? launch_d<128, true, true>(p, N, R, progs, st) : launch_d<128, true, false>(p, N, R, progs, st);
  }
  if (D == 64) return sparse ? launch_d<64, false, true>(p, N, R, progs, st) : launch_d<64, false, false>(p, N, R, progs, st);
  return sparse ? launch_d<128, false, true>(p, N, R, progs, st) : launch_d<128, false, false>(p, N, R, progs, st);
}

}  // extern "C"
