// Read-path probe (development; no selection, no scoring): how fast can one CTA per row stream a 512 KB row,
// with per-thread 16-byte loads (the top-k pass today) or with TMA bulk copies (cp.async.bulk) into a
// shared-memory ring, and how fast do the two gather the sparse decode's 1 KB candidate blocks?
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a scripts/bulk_read_probe.cu -o /tmp/bulk_read_probe
//   /tmp/bulk_read_probe [clean]  (one line per variant: median us of 30 runs, L2 flushed before each by a
//                                 memset, or with `clean` by a read of 512 MB)
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <random>
#include <vector>

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));       \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  asm volatile(
      "{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }" ::"r"(smem_u32(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ float fold(uint4 v, float a) {
  return fmaxf(fmaxf(a, fmaxf(__uint_as_float(v.x), __uint_as_float(v.y))),
               fmaxf(__uint_as_float(v.z), __uint_as_float(v.w)));
}

// Dense rows, per-thread loads: batches of U 16-byte chunks per thread, the next batch in flight (the top-k pass).
template <int U>
__global__ void __launch_bounds__(512, 1) ldg_rows(const float* x, int ncols, int split, float* out) {
  const int r = blockIdx.x / split, part = blockIdx.x % split;
  const int per = ncols / split;
  const uint4* row = reinterpret_cast<const uint4*>(x + (long long)r * ncols + (long long)part * per);
  const int n = per / 4, step = 512 * U, nb = n / step;
  uint4 buf[U];
  float a = -1e30f;
#pragma unroll
  for (int u = 0; u < U; ++u) buf[u] = __ldg(row + u * 512 + threadIdx.x);
  for (int b = 0; b < nb; ++b) {
    uint4 cur[U];
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = buf[u];
    if (b + 1 < nb)
#pragma unroll
      for (int u = 0; u < U; ++u) buf[u] = __ldg(row + (b + 1) * step + u * 512 + threadIdx.x);
#pragma unroll
    for (int u = 0; u < U; ++u) a = fold(cur[u], a);
  }
  if (a == 12345.f) out[blockIdx.x] = a;
}

// Dense rows, TMA bulk copies: thread 0 keeps STAGES chunks of CHUNK bytes in flight; the CTA folds a chunk and
// releases its stage with a barrier.
template <int STAGES, int CHUNK>
__global__ void __launch_bounds__(512, 1) bulk_rows(const float* x, int ncols, int split, float* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  unsigned char* ring = smem + 128;
  const int r = blockIdx.x / split, part = blockIdx.x % split;
  const int per = ncols / split;
  const char* row = reinterpret_cast<const char*>(x + (long long)r * ncols + (long long)part * per);
  const int nc = per * 4 / CHUNK;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES && s < nc; ++s) {
      mbar_expect(&full[s], CHUNK);
      bulk_g2s(ring + s * CHUNK, row + (long long)s * CHUNK, CHUNK, &full[s]);
    }
  float a = -1e30f;
  for (int c = 0; c < nc; ++c) {
    const int s = c % STAGES;
    mbar_wait(&full[s], (unsigned)(c / STAGES) & 1u);
    const uint4* st = reinterpret_cast<const uint4*>(ring + s * CHUNK);
#pragma unroll
    for (int i = threadIdx.x; i < CHUNK / 16; i += 512) a = fold(st[i], a);
    __syncthreads();
    if (threadIdx.x == 0 && c + STAGES < nc) {
      mbar_expect(&full[s], CHUNK);
      bulk_g2s(ring + s * CHUNK, row + (long long)(c + STAGES) * CHUNK, CHUNK, &full[s]);
    }
  }
  if (a == 12345.f) out[blockIdx.x] = a;
}

// The best plain read: every SM, grid-stride.
__global__ void __launch_bounds__(256) plain_read(const uint4* x, long long n, float* out) {
  float a = -1e30f;
  const long long stride = (long long)gridDim.x * 256 * 4;
  for (long long i = (long long)blockIdx.x * 1024 + threadIdx.x; i < n; i += stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = i + u * 256 < n ? __ldg(x + i + u * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) a = fold(v[u], a);
  }
  if (a == 12345.f) out[blockIdx.x] = a;
}

// Sparse decode pattern: page of 64 tokens = 64 x 128 value bytes, then 64 x 4 scale bytes (8448 B); a candidate
// block of 8 tokens = 1 KB of values + 32 B of scales. Program (row, part): blocks [part * NB, (part + 1) * NB).
constexpr int PAGE = 8448, VAL = 1024, SCL = 32;
__device__ __forceinline__ long long blk_page(const int* bt, const int* cand, int r, int i, int nblk, int mb,
                                              int* sub) {
  const int blk = cand[(long long)r * nblk + i];
  *sub = blk & 7;
  return bt[(long long)r * mb + (blk >> 3)];
}

// Per-warp loads: a warp takes a block (32 lanes x 2 x 16 B of values; lanes 0-1 the scales), U blocks in flight.
template <int U>
__global__ void __launch_bounds__(128) ldg_gather(const unsigned char* cache, const int* bt, const int* cand, int nblk,
                                                  int mb, int NB, float* out) {
  const int r = blockIdx.x, part = blockIdx.y, w = threadIdx.x >> 5, l = threadIdx.x & 31;
  float a = -1e30f;
  for (int i0 = part * NB + w * U; i0 < (part + 1) * NB; i0 += 4 * U) {
    uint4 v[U][3];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int sub;
      const long long pg = blk_page(bt, cand, r, i0 + u, nblk, mb, &sub);
      const unsigned char* p = cache + pg * PAGE;
      v[u][0] = __ldg(reinterpret_cast<const uint4*>(p + sub * VAL) + l);
      v[u][1] = __ldg(reinterpret_cast<const uint4*>(p + sub * VAL) + 32 + l);
      v[u][2] = l < 2 ? __ldg(reinterpret_cast<const uint4*>(p + 64 * 128 + sub * SCL) + l) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) a = fold(v[u][2], fold(v[u][1], fold(v[u][0], a)));
  }
  if (a == 12345.f) out[r] = a;
}

// Bulk copies: thread 0 issues two copies per block (its values, its scales), BPS blocks a stage, STAGES stages in
// flight; the CTA folds a stage and releases it with a barrier.
template <int STAGES, int BPS>
__global__ void __launch_bounds__(128) bulk_gather(const unsigned char* cache, const int* bt, const int* cand, int nblk,
                                                   int mb, int NB, float* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  unsigned char* ring = smem + 256;
  constexpr int SB = BPS * (VAL + SCL);
  const int r = blockIdx.x, part = blockIdx.y;
  const int nst = NB / BPS;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int st, int s) {  // thread 0 only
    mbar_expect(&full[s], SB);
    for (int b = 0; b < BPS; ++b) {
      int sub;
      const long long pg = blk_page(bt, cand, r, part * NB + st * BPS + b, nblk, mb, &sub);
      const unsigned char* p = cache + pg * PAGE;
      bulk_g2s(ring + s * SB + b * VAL, p + sub * VAL, VAL, &full[s]);
      bulk_g2s(ring + s * SB + BPS * VAL + b * SCL, p + 64 * 128 + sub * SCL, SCL, &full[s]);
    }
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES && s < nst; ++s) issue(s, s);
  float a = -1e30f;
  for (int st = 0; st < nst; ++st) {
    const int s = st % STAGES;
    mbar_wait(&full[s], (unsigned)(st / STAGES) & 1u);
    const uint4* p = reinterpret_cast<const uint4*>(ring + s * SB);
    for (int i = threadIdx.x; i < SB / 16; i += 128) a = fold(p[i], a);
    __syncthreads();
    if (threadIdx.x == 0 && st + STAGES < nst) issue(st + STAGES, s);
  }
  if (a == 12345.f) out[r] = a;
}

struct Timer {
  void* flush;
  size_t fbytes = 512ull << 20;
  cudaEvent_t e0, e1;
  Timer() {
    CK(cudaMalloc(&flush, fbytes));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
  }
  bool clean = false;  // flush by reading (L2 left holding clean lines) instead of by writing (dirty lines)
  float* sink = nullptr;
  template <class F>
  float median_us(F&& f) {
    std::vector<float> t;
    if (!sink) CK(cudaMalloc(&sink, 1 << 20));
    for (int i = 0; i < 33; ++i) {
      if (clean)
        plain_read<<<132 * 8, 256>>>((const uint4*)flush, fbytes / 16, sink);
      else
        CK(cudaMemsetAsync(flush, i, fbytes));
      CK(cudaEventRecord(e0));
      f();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 3) t.push_back(ms * 1000.f);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

template <class K>
void set_smem(K k, int bytes) {
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("# %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  Timer T;
  T.clean = argc > 1 && argv[1][0] == 'c';
  printf("# L2 flushed before each run by %s\n",
         T.clean ? "reading 512 MB (clean lines)" : "writing 512 MB (cudaMemset: dirty lines)");
  float* out;
  CK(cudaMalloc(&out, 1 << 20));
  const int R = 128, NC = 131072;
  float* x;
  const size_t xb = (size_t)R * NC * 4;
  CK(cudaMalloc(&x, xb));
  CK(cudaMemset(x, 0, xb));
  auto rep = [&](const char* name, double bytes, float us) {
    printf("%-44s %8.2f us  %5.2f TB/s\n", name, us, bytes / us / 1e6);
  };
  rep("dense 128x128K plain read, 132x8 CTAs", xb,
      T.median_us([&] { plain_read<<<prop.multiProcessorCount * 8, 256>>>((const uint4*)x, xb / 16, out); }));
  rep("dense ldg rows U=4 (1 CTA/row)", xb, T.median_us([&] { ldg_rows<4><<<R, 512>>>(x, NC, 1, out); }));
  rep("dense ldg rows U=8 (1 CTA/row, the pass)", xb, T.median_us([&] { ldg_rows<8><<<R, 512>>>(x, NC, 1, out); }));
  rep("dense ldg rows U=8, 2 CTAs/row", xb, T.median_us([&] { ldg_rows<8><<<2 * R, 512>>>(x, NC, 2, out); }));
#define BULK(S, C, SPLIT)                                                                                   \
  do {                                                                                                      \
    set_smem(bulk_rows<S, C>, 128 + S * C);                                                                 \
    rep("dense bulk rows " #S "x" #C " split " #SPLIT, xb,                                                  \
        T.median_us([&] { bulk_rows<S, C><<<SPLIT * R, 512, 128 + S * C>>>(x, NC, SPLIT, out); }));         \
  } while (0)
  BULK(4, 16384, 1);
  BULK(8, 16384, 1);
  BULK(4, 32768, 1);
  BULK(6, 32768, 1);
  BULK(3, 65536, 1);
  BULK(12, 8192, 1);
  BULK(6, 16384, 2);
  CK(cudaFree(x));

  // Sparse decode gather pattern.
  const int MB = 2048, NBLK = 2048;  // pages per row (128K / 64), candidate blocks per row
  const long long npages = (long long)R * MB;
  unsigned char* cache;
  CK(cudaMalloc(&cache, npages * PAGE));
  CK(cudaMemset(cache, 0, npages * PAGE));
  std::mt19937 g(1);
  std::vector<int> pages(npages), bt(npages), cand((size_t)R * NBLK);
  for (long long i = 0; i < npages; ++i) pages[i] = (int)i;
  std::shuffle(pages.begin(), pages.end(), g);
  for (long long i = 0; i < npages; ++i) bt[i] = pages[i];
  std::vector<int> all(MB * 8);
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < MB * 8; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), g);
    std::sort(all.begin(), all.begin() + NBLK);
    for (int i = 0; i < NBLK; ++i) cand[(size_t)r * NBLK + i] = all[i];
  }
  int *dbt, *dcand;
  CK(cudaMalloc(&dbt, npages * 4));
  CK(cudaMalloc(&dcand, cand.size() * 4));
  CK(cudaMemcpy(dbt, bt.data(), npages * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dcand, cand.data(), cand.size() * 4, cudaMemcpyHostToDevice));
  const double gb = (double)R * NBLK * (VAL + SCL);
  for (int parts : {8, 16}) {
    const int NB = NBLK / parts;
    char name[96];
    snprintf(name, sizeof name, "gather ldg U=2, %d programs/row", parts);
    rep(name, gb, T.median_us([&] { ldg_gather<2><<<dim3(R, parts), 128>>>(cache, dbt, dcand, NBLK, MB, NB, out); }));
    snprintf(name, sizeof name, "gather ldg U=4, %d programs/row", parts);
    rep(name, gb, T.median_us([&] { ldg_gather<4><<<dim3(R, parts), 128>>>(cache, dbt, dcand, NBLK, MB, NB, out); }));
#define GBULK(S, B)                                                                          \
  do {                                                                                       \
    const int sm = 256 + S * B * (VAL + SCL);                                                \
    set_smem(bulk_gather<S, B>, sm);                                                         \
    snprintf(name, sizeof name, "gather bulk %dx%d blocks, %d programs/row", S, B, parts);  \
    rep(name, gb, T.median_us([&] {                                                          \
      bulk_gather<S, B><<<dim3(R, parts), 128, sm>>>(cache, dbt, dcand, NBLK, MB, NB, out);  \
    }));                                                                                     \
  } while (0)
    GBULK(4, 8);
    GBULK(8, 8);
    GBULK(6, 16);
    GBULK(12, 4);
  }
  return 0;
}
