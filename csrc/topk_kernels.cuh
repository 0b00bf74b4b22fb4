// Exact, deterministic per-row top-k selection: topk, sparse_topk, block_topk.
//
// One CTA per row (or one cluster, below). Every score is mapped to an order-preserving uint32 key
// (fp32 bits; bf16 widened exactly), NaN mapped to 1 (below -inf), 0 meaning "not an element". Selection =
// the r best elements by (key descending, element index ascending); output = their positions in index
// order, -1 padded.
//
// Per row, chosen on the device from the row's length:
//  * SMEM mode (at most SMEM_KEYS elements): one read of the row writes every key to shared memory
//    and builds the coarse 11-bit histogram; refinement passes (11, 11, 10 bits) and the final ordered
//    compaction run on shared memory only.
//  * SAMPLED mode (longer rows, tried first): a sample of the row gives a threshold; one pass buffers
//    the elements above it, the exact selection runs on the buffer (sampled_mode). Else STREAM mode.
//  * STREAM mode: pass 1 builds the coarse histogram; pass 2 (in reverse order, so the part of the row
//    read last is still in L2) writes the winners above the threshold bin and the threshold bin's
//    elements, both in index order, to shared memory; refinement runs on that buffer and the two
//    sorted lists are merged into the output. When the threshold bin holds more than CAND_CAP
//    elements the buffer is never trusted: the row is rescanned from global memory, filtered by the
//    fixed key prefix, until the key is exact, and a final ordered pass writes the output.
//  * CLUSTER mode (dense topk rows of SMEM_KEYS < width <= CLUSTER_MAX * SMEM_KEYS, chosen on the host
//    from the width): a cluster of CTAs splits the row into shared-memory slices (topk_cluster_kernel).
// Ties at the threshold key go to the lowest indices through block-wide prefix counts in index order
// or bitmaps over the row (never through atomics order), so results are bitwise reproducible.
//
// The kernels are written for one CTA size and set of tuning constants (the TSI_* macros below) in namespace
// TSI_NS (default tsi). topk.cu includes this file a second time with other values in another namespace
// (tsi_wide: CTAs of TSI_WIDE_THREADS threads for decode batches), so everything from the namespace on is
// included once per instantiation, and the prelude up to it once.
#ifndef TSI_TOPK_PRELUDE
#define TSI_TOPK_PRELUDE

#include <utility>

#ifdef TSI_EMULATE
#include "emu/cuda_emu.h"
#else
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>
#define TSI_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
// Thread-block clusters (SM90+): rank in the cluster, cluster-wide barrier (with release/acquire of
// shared memory), and a pointer to the same shared-memory object in another CTA of the cluster.
__device__ __forceinline__ unsigned tsi_cluster_rank() { return cooperative_groups::this_cluster().block_rank(); }
__device__ __forceinline__ void tsi_cluster_sync() { cooperative_groups::this_cluster().sync(); }
template <class T>
__device__ __forceinline__ T* tsi_cluster_map(T* p, unsigned rank) {
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
}
#endif

// Phase timing for development (-DTSI_PHASE_TIMING builds only): thread 0 of block 0 records clock64() at
// numbered points of its row; tsi_topk_phase_cycles() reads them back. Compiled out otherwise.
// TSI_SPAN (once at the top of a kernel): thread 0 of blocks < SPAN_BLOCKS records %globaltimer at its start
// and its end in g_span, for the spread of CTA start and end times (tsi_topk_phase_spans()).
#if defined(TSI_PHASE_TIMING) && !defined(TSI_EMULATE)
namespace tsi_phase {  // shared by every instantiation of the kernels
__device__ unsigned long long g_phase[32];
constexpr int SPAN_BLOCKS = 4096;
__device__ unsigned long long g_span[2 * SPAN_BLOCKS];
#define TSI_MARK(i)                                                                 \
  do {                                                                              \
    if (blockIdx.x == 0 && threadIdx.x == 0) ::tsi_phase::g_phase[(i)] = clock64(); \
  } while (0)
__device__ __forceinline__ unsigned long long tsi_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
struct SpanGuard {
  __device__ SpanGuard() {
    if (threadIdx.x == 0 && blockIdx.x < SPAN_BLOCKS) g_span[2 * blockIdx.x] = tsi_globaltimer();
  }
  __device__ ~SpanGuard() {
    if (threadIdx.x == 0 && blockIdx.x < SPAN_BLOCKS) g_span[2 * blockIdx.x + 1] = tsi_globaltimer();
  }
};
}  // namespace tsi_phase
#define TSI_SPAN ::tsi_phase::SpanGuard tsi_span_guard_
#else
#define TSI_MARK(i) \
  do {              \
  } while (0)
#define TSI_SPAN \
  do {           \
  } while (0)
#endif

// Development truncation for benchmarks (benchmarks/variants/truncate_*.flags; the output is wrong):
// -DTSI_TOPK_STOP=n ends every row after its phase n, so that such a build's time against the default build's is
// what the later phases cost at the shape's occupancy (with two CTAs per SM, phase timing of one CTA cannot
// say). Shared-memory rows: 1 after the load and its histogram, 2 after the threshold (the bitmap path's sweep,
// refinement and marks; rows whose threshold bin is too large for it, e.g. massive ties, run to the end).
// Sampled rows: 1 after the sample's threshold, 2 after the pass, 3 after the exact threshold. 0 (the default)
// compiles none of it.
#ifndef TSI_TOPK_STOP
#define TSI_TOPK_STOP 0
#endif

namespace tsi_common {
struct Params {
  const void* logits;
  long long row_stride;  // elements
  int rows;
  int width;             // columns
  const int* lengths;
  const int* blocks;     // sparse: candidate block ids [rows, nblk]
  int nblk;
  int cbs;
  int lcbs;              // log2(cbs)
  int* out;              // [rows, kk]
  int kk;                // k (topk, sparse_topk) or number of output blocks (block_topk)
  int sampled;           // 1: streamed rows try the sampled threshold first (see sampled_mode)
  int prefetch_bytes;    // head of each dense row sampled_mode asks L2 for (the launch sets it: topk.cu)
};
}  // namespace tsi_common

#endif  // TSI_TOPK_PRELUDE

#ifndef TSI_NS
#define TSI_NS tsi
#endif
#ifndef TSI_THREADS
#define TSI_THREADS 512
#endif
#ifndef TSI_CAND_CAP
#define TSI_CAND_CAP 8192
#endif
#ifndef TSI_LIST_CAP
#define TSI_LIST_CAP 4096
#endif
#ifndef TSI_U1  // tiles per batch, one CTA per SM
#define TSI_U1 4
#endif
#ifndef TSI_U2  // tiles per batch, two CTAs per SM
#define TSI_U2 2
#endif
#ifndef TSI_UB1  // tiles per batch of the sampled pass that buffers in any order (no block scan), one CTA per SM
#define TSI_UB1 8
#endif
#ifndef TSI_UB2  // the same, two CTAs per SM
#define TSI_UB2 4
#endif

namespace TSI_NS {

constexpr int THREADS = TSI_THREADS;
constexpr int NWARPS = THREADS / 32;
constexpr int NBINS = 2048;
constexpr int CAND_CAP = TSI_CAND_CAP;  // threshold-bin elements buffered in STREAM mode
constexpr int LIST_CAP = TSI_LIST_CAP;  // max output width (k, or num_blocks for block_topk)
constexpr int REGION_WORDS = 2 * CAND_CAP + 2 * LIST_CAP;
constexpr int SMEM_KEYS = REGION_WORDS - CAND_CAP;  // SMEM mode: one key per element, then the staged output
constexpr int MAX_U = TSI_U1 > TSI_U2 ? TSI_U1 : TSI_U2;  // tiles per ordered scan (see stream())
constexpr unsigned FULL = 0xffffffffu;

static_assert(THREADS % 32 == 0 && NBINS % THREADS == 0 && (NBINS / 2) % THREADS == 0, "thread count");
static_assert(NWARPS <= 32, "at most 32 warps");
static_assert(SMEM_KEYS % 32 == 0 && CAND_CAP % 16 == 0, "16-byte aligned shared-memory arrays, K in whole octets");

enum Kind { DENSE = 0, SPARSE = 1, BLOCK = 2 };

using Params = ::tsi_common::Params;

struct Smem {
  uint32_t hist[NBINS + 32];  // the digit histogram, then one sink word per lane (hist_inc)
  alignas(8) uint32_t scan[2][MAX_U * NWARPS];
  uint32_t ctl[8];
  alignas(16) uint32_t region[REGION_WORDS];
};

// ------------------------------------------------------------------------------------------------
// Keys
// ------------------------------------------------------------------------------------------------

// Order-preserving key of fp32 bits: -0 == +0, NaN (any payload) = 1 < key(-inf) = 0x007fffff.
// Branch-free: this runs once per score in every streaming pass.
// Five instructions (an add, a NaN test, the flip): -0 + +0 is +0 under round-to-nearest, and nvcc keeps the add
// (it is not an identity in IEEE arithmetic; this file is never built with fast-math).
__device__ __forceinline__ uint32_t f32_key(uint32_t b) {
  const float x = __uint_as_float(b) + 0.0f;
  b = __float_as_uint(x);
  const uint32_t k = b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
  return x != x ? 1u : k;
}

template <typename T> struct DT;
template <> struct DT<float> {
  static constexpr int V = 4;  // elements per 16-byte chunk
  static constexpr int SIZE = 4;
  __device__ static __forceinline__ uint32_t bits(const uint32_t (&w)[4], int j) { return w[j]; }
  __device__ static __forceinline__ void put(uint32_t (&w)[4], int j, uint32_t v) { w[j] = v; }
  __device__ static __forceinline__ uint32_t load1(const char* p, long long col) {
    return *reinterpret_cast<const uint32_t*>(p + col * 4);
  }
};
struct bf16_tag {};
template <> struct DT<bf16_tag> {
  static constexpr int V = 8;
  static constexpr int SIZE = 2;
  __device__ static __forceinline__ uint32_t bits(const uint32_t (&w)[4], int j) {
    return (j & 1) ? (w[j >> 1] & 0xffff0000u) : (w[j >> 1] << 16);
  }
  __device__ static __forceinline__ void put(uint32_t (&w)[4], int j, uint32_t v) {
    w[j >> 1] |= (j & 1) ? (v << 16) : v;
  }
  __device__ static __forceinline__ uint32_t load1(const char* p, long long col) {
    return *reinterpret_cast<const uint16_t*>(p + col * 2);
  }
};

struct Raw {
  uint32_t w[4];
};

__device__ __forceinline__ Raw load16(const char* p) {
  uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  Raw r;
  r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
  return r;
}

// ------------------------------------------------------------------------------------------------
// Element sources. An item is what one thread loads per step; elems() turns it into E keys in index
// order (key 0: no element), index(item, j) gives the j-th one's element index. elems() is
// warp-collective. Only sparse rows have key-0 slots inside [0, m) (columns of -1 blocks etc.).
// ------------------------------------------------------------------------------------------------

// Chunked row access shared by the sources: chunk c covers columns [c*V - h, c*V - h + V), where h is
// the row start's misalignment in elements; only chunks fully inside [0, ncols) use a vector load.
template <typename T>
struct Chunks {
  static constexpr int V = DT<T>::V;
  const char* row;   // row start
  const char* abase; // 16-byte aligned start at or before row
  int h;
  int ncols;
  int nchunks;
  __device__ void init(const Params& p, int r, int ncols_, int col_off = 0) {
    row = static_cast<const char*>(p.logits) + ((long long)r * p.row_stride + col_off) * DT<T>::SIZE;
    uintptr_t a = reinterpret_cast<uintptr_t>(row);
    h = (int)((a & 15u) / DT<T>::SIZE);
    abase = row - h * DT<T>::SIZE;
    ncols = ncols_;
    nchunks = ncols_ > 0 ? (h + ncols_ + V - 1) / V : 0;
  }
  // Chunks [c0, c0 + n) all lie inside [0, ncols): load_full() may be used for them (one uniform test per
  // batch instead of the edge checks per chunk).
  __device__ __forceinline__ bool full(int c0, int n) const {
    return c0 >= (h > 0 ? 1 : 0) && (long long)(c0 + n) * V <= (long long)ncols + h;
  }
  __device__ __forceinline__ Raw load_full(int c) const { return load16(abase + (long long)c * 16); }
  // Asks L2 for the first `bytes` of the row's chunks (clipped to them), one 128-byte line per thread and step.
  __device__ __forceinline__ void prefetch_l2(int bytes) const {
#ifndef TSI_EMULATE
    const long long end = (long long)nchunks * 16 < bytes ? (long long)nchunks * 16 : bytes;
    for (long long o = 128LL * threadIdx.x; o < end; o += 128LL * THREADS)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(abase + o));
#else
    (void)bytes;
#endif
  }
  __device__ __forceinline__ Raw load(int c) const {
    Raw r;
    r.w[0] = r.w[1] = r.w[2] = r.w[3] = 0u;
    if (c < 0 || c >= nchunks) return r;
    long long col0 = (long long)c * V - h;
    if (col0 >= 0 && col0 + V <= ncols) return load16(abase + (long long)c * 16);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      long long col = col0 + j;
      if (col >= 0 && col < ncols) DT<T>::put(r.w, j, DT<T>::load1(row, col));
    }
    return r;
  }
};

template <typename T>
struct DenseSrc {
  using Elem = T;
  static constexpr int KIND = DENSE;
  static constexpr int E = DT<T>::V;
  Chunks<T> ch;
  int m;        // element indices [0, m)
  int off = 0;  // position of element 0 (a cluster CTA's slice of the row starts at off)
  __device__ static int valid(const Params& p, int r) {
    const int len = p.lengths[r];
    return len < 0 ? 0 : (len > p.width ? p.width : len);
  }
  __device__ DenseSrc(const Params& p, int r) {
    m = valid(p, r);
    ch.init(p, r, m);
  }
  // Slice q of S columns: positions [q * S, min((q + 1) * S, n)).
  __device__ DenseSrc(const Params& p, int r, int q, int S) {
    const int n = valid(p, r);
    off = q * S;
    m = n - off < 0 ? 0 : (n - off > S ? S : n - off);
    ch.init(p, r, m, off);
  }
  __device__ __forceinline__ int items() const { return ch.nchunks; }
  __device__ __forceinline__ Raw load(int c) const { return ch.load(c); }
  __device__ __forceinline__ bool full(int c0, int n) const { return ch.full(c0, n); }
  __device__ __forceinline__ Raw load_full(int c) const { return ch.load_full(c); }
  __device__ __forceinline__ void elems(const Raw& raw, int c, uint32_t (&key)[E]) const {
    const int col0 = c * E - ch.h;  // items past nchunks have col0 >= m
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const uint32_t k = f32_key(DT<T>::bits(raw.w, j));
      key[j] = (uint32_t)(col0 + j) < (uint32_t)m ? k : 0u;
    }
  }
  // elems() of an item of a batch that full() accepted: every column lies inside the row.
  __device__ __forceinline__ void elems_inside(const Raw& raw, uint32_t (&key)[E]) const {
#pragma unroll
    for (int j = 0; j < E; ++j) key[j] = f32_key(DT<T>::bits(raw.w, j));
  }
  __device__ __forceinline__ int index(int c, int j) const { return c * E - ch.h + j; }
  __device__ __forceinline__ int pos(int i) const { return off + i; }
  // Bit j: element j of the item has key >= tau, for a positive threshold tau > key(+0) given as the score
  // tf = float(tau & 0x7fffffff): key(x) >= tau <=> x >= tf as floats, which NaN, +-0 and negatives fail
  // (columns outside the row were loaded as +0 bits). One float compare per element (no flush-to-zero: this
  // file is never built with fast-math); the integer range test it replaces, (bits - tlo) <= span, compiled
  // to ~4.3 instructions per element against ~2.8 (sm_90a SASS of the sampled pass).
  __device__ __forceinline__ uint32_t pos_mask(const Raw& raw, float tf) const {
    uint32_t mk = 0u;
#pragma unroll
    for (int j = 0; j < E; ++j) mk |= (uint32_t)(__uint_as_float(DT<T>::bits(raw.w, j)) >= tf) << j;
    return mk;
  }
  // Bits of element j of a loaded item, for a j known only at run time (selects, not a dynamically indexed
  // register array, which would go to local memory).
  __device__ __forceinline__ uint32_t bits_in(const Raw& raw, int j) const {
    uint32_t b = DT<T>::bits(raw.w, 0);
#pragma unroll
    for (int q = 1; q < E; ++q) b = j == q ? DT<T>::bits(raw.w, q) : b;
    return b;
  }
  // Its key, where it passed pos_mask (a positive score: f32_key is the sign bit set).
  __device__ __forceinline__ uint32_t pos_key_in(const Raw& raw, int j) const { return bits_in(raw, j) | 0x80000000u; }
};

template <typename T>
struct SparseSrc {
  using Elem = T;
  static constexpr int KIND = SPARSE;
  static constexpr int E = DT<T>::V;
  Chunks<T> ch;
  const int* blk;
  long long len;
  int cbs, lcbs;
  int m;
  __device__ SparseSrc(const Params& p, int r) {
    int l = p.lengths[r];
    len = l < 0 ? 0 : l;
    blk = p.blocks + (long long)r * p.nblk;
    cbs = p.cbs;
    lcbs = p.lcbs;
    m = p.width;
    ch.init(p, r, p.width);
  }
  __device__ __forceinline__ int items() const { return ch.nchunks; }
  __device__ __forceinline__ Raw load(int c) const { return ch.load(c); }
  __device__ __forceinline__ bool full(int c0, int n) const { return ch.full(c0, n); }
  __device__ __forceinline__ Raw load_full(int c) const { return ch.load_full(c); }
  // Valid columns at the start of candidate block id b: 0 for a -1 block, fewer than cbs for the block the
  // row's length cuts.
  __device__ __forceinline__ int valid_in(int b) const {
    if (b < 0) return 0;
    const long long r = len - (long long)b * cbs;
    return r <= 0 ? 0 : (r >= cbs ? cbs : (int)r);
  }
  __device__ __forceinline__ void elems(const Raw& raw, int c, uint32_t (&key)[E]) const {
    elems_with(raw, c, key, [&](int b) { return valid_in(__ldg(blk + b)); });
  }
  // elems() given valid(b) = valid_in(block id of candidate b).
  template <class Valid>
  __device__ __forceinline__ void elems_with(const Raw& raw, int c, uint32_t (&key)[E], Valid&& valid) const {
    int col0 = c * E - ch.h;
    // A chunk spans at most two candidate blocks (cbs >= E): their valid prefixes, once per chunk.
    int first = col0 < 0 ? 0 : col0;
    int last = col0 + E - 1 >= m ? m - 1 : col0 + E - 1;
    bool any = c < ch.nchunks && first <= last;
    const int vfirst = any ? valid(first >> lcbs) : 0;
    const int vlast = any ? valid(last >> lcbs) : 0;
    int jfirst = first >> lcbs;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      int col = col0 + j;
      bool in = any && col >= 0 && col < m;
      int v = ((col >> lcbs) == jfirst) ? vfirst : vlast;
      bool ok = in && (col & (cbs - 1)) < v;
      key[j] = ok ? f32_key(DT<T>::bits(raw.w, j)) : 0u;
    }
  }
  __device__ __forceinline__ int index(int c, int j) const { return c * E - ch.h + j; }
  __device__ __forceinline__ int pos(int i) const {
    long long p = (long long)__ldg(blk + (i >> lcbs)) * cbs + (i & (cbs - 1));
    return (int)p;
  }
};

// A sparse row whose candidates' valid prefixes are computed once into shared memory (by keys_to_smem: fill_table,
// or from ids copied by cp.async on the async load): the load then reads them from shared memory instead of
// waiting on two dependent global loads per chunk (on the H200 those waits were the largest stall of
// sparse_topk's shared-memory rows; NOTES.md).
template <typename T>
struct SparseTabSrc : SparseSrc<T> {
  int* tv;  // shared memory: valid_in(block id) per candidate block of the row
  int nb;   // candidate blocks of the row
  __device__ SparseTabSrc(const SparseSrc<T>& s, int* tv_)
      : SparseSrc<T>(s), tv(tv_), nb((s.m + s.cbs - 1) >> s.lcbs) {}
  __device__ __forceinline__ void elems(const Raw& raw, int c, uint32_t (&key)[SparseSrc<T>::E]) const {
    this->elems_with(raw, c, key, [&](int b) { return tv[b]; });
  }
  // Each thread's block ids, copied into the table, to their valid prefixes in place (the async load).
  __device__ __forceinline__ void ids_to_prefixes() const {
    for (int b = threadIdx.x; b < nb; b += THREADS) tv[b] = this->valid_in(tv[b]);
  }
  // The table from global loads (before the streamed load).
  __device__ void fill_table() const {
    for (int b = threadIdx.x; b < nb; b += THREADS) tv[b] = this->valid_in(__ldg(this->blk + b));
  }
};

// block_topk, rows whose start is 16-byte aligned: G = cbs*size/16 consecutive lanes load one block
// (consecutive chunks) and reduce its max key with shuffles; the group's first lane owns the element.
template <typename T>
struct BlockVecSrc {
  static constexpr int KIND = BLOCK;
  static constexpr int E = 1;
  Chunks<T> ch;
  int G;  // chunks per block (power of two, <= 16)
  int m;  // valid blocks ceil(n / cbs)
  __device__ BlockVecSrc(const Params& p, int r) {
    int len = p.lengths[r];
    int n = len < 0 ? 0 : (len > p.width ? p.width : len);
    m = (n + p.cbs - 1) >> p.lcbs;
    G = p.cbs / DT<T>::V;
    ch.init(p, r, n);
    ch.nchunks = m * G;  // whole groups, so every block's lanes are present
  }
  __device__ __forceinline__ int items() const { return ch.nchunks; }
  __device__ __forceinline__ Raw load(int c) const { return ch.load(c); }
  __device__ __forceinline__ bool full(int c0, int n) const { return ch.full(c0, n); }
  __device__ __forceinline__ Raw load_full(int c) const { return ch.load_full(c); }
  __device__ __forceinline__ void elems(const Raw& raw, int c, uint32_t (&key)[1]) const {
    constexpr int V = DT<T>::V;
    uint32_t mx = 0u;
    int col0 = c * V;  // h == 0 for this source
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const uint32_t k = f32_key(DT<T>::bits(raw.w, j));
      mx = (col0 + j < ch.ncols && k > mx) ? k : mx;  // items past nchunks have col0 >= ncols
    }
    for (int o = 1; o < G; o <<= 1) {
      uint32_t y = __shfl_xor_sync(FULL, mx, o);
      mx = y > mx ? y : mx;
    }
    bool lead = (c & (G - 1)) == 0 && c < ch.nchunks;
    key[0] = lead ? mx : 0u;
  }
  __device__ __forceinline__ int index(int c, int) const { return c / G; }
  __device__ __forceinline__ int pos(int i) const { return i; }
};

// block_topk fallback for rows not 16-byte aligned: one thread per block, scalar loads.
template <typename T>
struct BlockScalarSrc {
  static constexpr int KIND = BLOCK;
  static constexpr int E = 1;
  const char* row;
  int n, cbs, m;
  __device__ BlockScalarSrc(const Params& p, int r) {
    row = static_cast<const char*>(p.logits) + (long long)r * p.row_stride * DT<T>::SIZE;
    int len = p.lengths[r];
    n = len < 0 ? 0 : (len > p.width ? p.width : len);
    cbs = p.cbs;
    m = (n + cbs - 1) >> p.lcbs;
  }
  __device__ __forceinline__ int items() const { return m; }
  __device__ __forceinline__ bool full(int, int) const { return false; }
  __device__ __forceinline__ Raw load_full(int b) const { return load(b); }
  __device__ __forceinline__ Raw load(int b) const {
    Raw r;
    r.w[0] = r.w[1] = r.w[2] = r.w[3] = 0u;
    if (b < 0 || b >= m) return r;
    uint32_t mx = 0u;
    long long c0 = (long long)b * cbs;
    long long c1 = c0 + cbs < n ? c0 + cbs : n;
    for (long long c = c0; c < c1; ++c) {
      uint32_t bits = DT<T>::load1(row, c);
      if (DT<T>::SIZE == 2) bits <<= 16;
      uint32_t k = f32_key(bits);
      mx = k > mx ? k : mx;
    }
    r.w[0] = mx;
    return r;
  }
  __device__ __forceinline__ void elems(const Raw& raw, int b, uint32_t (&key)[1]) const {
    key[0] = b < m ? raw.w[0] : 0u;
  }
  __device__ __forceinline__ int index(int b, int) const { return b; }
  __device__ __forceinline__ int pos(int i) const { return i; }
};

// ------------------------------------------------------------------------------------------------
// Block-wide primitives (every thread of the CTA must call them, in the same order)
// ------------------------------------------------------------------------------------------------

// Inclusive prefix sum over lanes [0, W) of a warp (lanes >= W get sums they do not use). Warp-collective.
template <int W = 32, typename T>
__device__ __forceinline__ T warp_incl_scan(T x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < W; o <<= 1) {
    const T y = __shfl_up_sync(FULL, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// Exclusive prefix over threads in thread order; *total = sum over the CTA. `tmp` must not be
// reused before the next __syncthreads() that follows this call (callers alternate two buffers).
__device__ __forceinline__ uint32_t block_excl_scan(uint32_t v, uint32_t* tmp, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t x = warp_incl_scan(v);
  if (lane == 31) tmp[warp] = x;
  __syncthreads();
  const uint32_t t = lane < NWARPS ? tmp[lane] : 0u;
  const uint32_t sw = warp_incl_scan(t);
  *total = __shfl_sync(FULL, sw, 31);
  return __shfl_sync(FULL, sw - t, warp) + x - v;
}

// Exclusive prefix of U counts per thread in (u, thread) order -- item u*THREADS + tid -- with a single
// barrier. tmp: U * NWARPS words, same reuse rule as block_excl_scan.
template <int U>
__device__ __forceinline__ void block_excl_scan_multi(const uint32_t (&v)[U], uint32_t (&ex)[U], uint32_t* total,
                                                      uint32_t* tmp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x[U];
#pragma unroll
  for (int u = 0; u < U; ++u) x[u] = v[u];
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint32_t y = __shfl_up_sync(FULL, x[u], o);
      if (lane >= o) x[u] += y;
    }
  }
  if (lane == 31) {
#pragma unroll
    for (int u = 0; u < U; ++u) tmp[u * NWARPS + warp] = x[u];
  }
  __syncthreads();
  uint32_t run = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t t = lane < NWARPS ? tmp[u * NWARPS + lane] : 0u;
    const uint32_t sw = warp_incl_scan(t);
    ex[u] = run + __shfl_sync(FULL, sw - t, warp) + x[u] - v[u];
    run += __shfl_sync(FULL, sw, 31);
  }
  *total = run;
}

// block_excl_scan_multi for small counts (each v[u] <= E, U <= 4): within a warp the U counts travel packed
// in 32 / U-bit fields of one 32-bit value (warp sums <= 32 * E fit), across warps in 16-bit fields of one
// 64-bit value (CTA sums <= THREADS * E fit), so the CTA scans once instead of U times.
template <int U, int E>
__device__ __forceinline__ void block_excl_scan_small(const uint32_t (&v)[U], uint32_t (&ex)[U], uint32_t* total,
                                                      uint32_t* tmp32) {
  constexpr int FB = 32 / U;  // field width inside a warp
  constexpr uint32_t FMASK = FB == 32 ? 0xffffffffu : ((1u << (FB % 32)) - 1u);
  static_assert(U >= 1 && U <= 4 && (U == 1 || 32 * E < (1 << (FB % 32))) && THREADS * E < 65536, "packed fields");
  static_assert(2 * NWARPS <= MAX_U * NWARPS, "scratch for one 64-bit word per warp");
  unsigned long long* tmp = reinterpret_cast<unsigned long long*>(tmp32);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t mine = 0u;
#pragma unroll
  for (int u = 0; u < U; ++u) mine |= v[u] << (FB * u);
  const uint32_t x = warp_incl_scan(mine);
  if (lane == 31) {
    unsigned long long w = 0ull;
#pragma unroll
    for (int u = 0; u < U; ++u)
      w |= (unsigned long long)((x >> (FB * u)) & FMASK) << (16 * u);
    tmp[warp] = w;
  }
  __syncthreads();
  const unsigned long long t = lane < NWARPS ? tmp[lane] : 0ull;
  const unsigned long long sw = warp_incl_scan<NWARPS>(t);
  const unsigned long long tot = __shfl_sync(FULL, sw, NWARPS - 1);
  const unsigned long long wex = __shfl_sync(FULL, sw - t, warp);
  const uint32_t lex = x - mine;  // this thread's exclusive prefix inside the warp, packed
  uint32_t run = 0u;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t lf = (lex >> (FB * u)) & FMASK;
    ex[u] = run + (uint32_t)((wex >> (16 * u)) & 0xffffu) + lf;
    run += (uint32_t)((tot >> (16 * u)) & 0xffffu);
  }
  *total = run;
}

// Reserves cnt slots for this thread in a buffer filled at *count: one shared-memory atomic per warp, slots
// contiguous per warp, warps in any order. Returns the thread's first slot; *after = the counter value right
// after this warp's reservation (the same in every lane). Warp-collective.
__device__ __forceinline__ uint32_t warp_reserve(uint32_t* count, uint32_t cnt, uint32_t* after) {
  const int lane = threadIdx.x & 31;
  const uint32_t incl = warp_incl_scan(cnt);
  const uint32_t wt = __shfl_sync(FULL, incl, 31);
  uint32_t wbase = 0u;
  if (lane == 0 && wt != 0u) wbase = atomicAdd(count, wt);
  wbase = __shfl_sync(FULL, wbase, 0);
  *after = wbase + wt;
  return wbase + incl - cnt;
}

// Appends a thread's nonzero keys to dst at *count (any order: for buffers whose histograms are all that is
// used). Warp-collective.
template <int N>
__device__ __forceinline__ void append_nonzero(uint32_t* dst, uint32_t* count, const uint32_t (&key)[N]) {
  uint32_t n = 0u, after;
#pragma unroll
  for (int j = 0; j < N; ++j) n += key[j] != 0u;
  uint32_t o = warp_reserve(count, n, &after);
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (key[j] != 0u) dst[o++] = key[j];
}

// Counts one element in bin b where ok. Lanes without an element add to their own sink word past the
// histogram instead of skipping the atomic: a conditional shared-memory atomic compiles to a branch and a
// reconvergence point around it (ptxas does so even for a predicated `red` in inline PTX), five instructions
// where a select and the atomic do (NOTES.md, Nsight Compute). The sinks (bank = lane) never conflict with
// each other, and the hardware merges lanes that hit one bin, so a warp whose keys all share a bin costs no
// more than any other (measured: the old per-warp one-bin test gained nothing on all-equal rows).
__device__ __forceinline__ void hist_inc(Smem& sm, uint32_t b, bool ok) {
  atomicAdd(&sm.hist[ok ? b : NBINS + (threadIdx.x & 31u)], 1u);
}

__device__ __forceinline__ void clear_hist(Smem& sm) {
  // Unrolled over the known count: as a loop from threadIdx.x, ptxas built a general trip-count loop around it.
#pragma unroll
  for (int q = 0; q < NBINS / THREADS; ++q) sm.hist[q * THREADS + threadIdx.x] = 0u;
}

template <int E>
__device__ __forceinline__ void hist_add(Smem& sm, const uint32_t (&bin)[E], const bool (&ok)[E]) {
#pragma unroll
  for (int j = 0; j < E; ++j) hist_inc(sm, bin[j], ok[j]);
}

// Digit of a key at prefix length L (0, 11, 22 bits fixed): bits [31:21], [20:10], [9:0].
__device__ __forceinline__ int digit_shift(int L) { return L == 0 ? 21 : (L == 11 ? 10 : 0); }
__device__ __forceinline__ uint32_t digit_mask(int L) { return L == 22 ? 0x3ffu : 0x7ffu; }
__device__ __forceinline__ bool has_prefix(uint32_t key, int L, uint32_t P) {
  return key != 0u && (L == 0 || (key >> (32 - L)) == P);
}

template <int E>
__device__ __forceinline__ void hist_keys(Smem& sm, const uint32_t (&key)[E], int L, uint32_t P) {
  uint32_t bin[E];
  bool ok[E];
  const int s = digit_shift(L);
  const uint32_t msk = digit_mask(L);
#pragma unroll
  for (int j = 0; j < E; ++j) {
    ok[j] = has_prefix(key[j], L, P);
    bin[j] = (key[j] >> s) & msk;
  }
  hist_add<E>(sm, bin, ok);
}

// Finds the bin B holding the need-th best element: count(bins > B) < need <= count(bins >= B), with
// need = min(need, total). ctl[0..3] = B, count above B, count in B, total. Leaves hist zero (bins
// [0, NB) were read and cleared). Ends with a barrier.
// TWO_LEVEL: instead of a block scan (every warp scanning its lanes, then the warp totals), the warp totals
// (one REDUX each) locate the warp holding the bin and only that warp scans its lanes: ~15 fewer instructions
// per thread. The shared-memory rows of topk and sparse_topk take it (4096 x 16K -1.3%, sparse_topk -1%, H100 run
// 140); the streamed rows and block_topk's rows do not: there it cost registers ptxas spilled (the 128 x 128K rows
// +1.5%, run 137; block_topk +2.5%, run 139).
template <int NB, bool TWO_LEVEL = false>
__device__ void find_bin(Smem& sm, uint32_t need) {
  constexpr int PER = NB / THREADS;
  const int b0 = threadIdx.x * PER;
  uint32_t h[PER];
  uint32_t s = 0u;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    h[j] = sm.hist[b0 + j];
    sm.hist[b0 + j] = 0u;  // leaves hist zero for the next digit (smem_hist), no clear + barrier
    s += h[j];
  }
  // The bin holding the need-th best, among this thread's bins, given the count in the bins above them.
  auto pick = [&](uint32_t cum, uint32_t need) {
#pragma unroll
    for (int j = PER - 1; j >= 0; --j) {
      if (need > 0u && cum < need && cum + h[j] >= need) {
        sm.ctl[0] = b0 + j;
        sm.ctl[1] = cum;
        sm.ctl[2] = h[j];
      }
      cum += h[j];
    }
  };
  uint32_t tot;
  if constexpr (TWO_LEVEL) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t* const tmp = sm.scan[0];
    const uint32_t ws = __reduce_add_sync(FULL, s);
    if (lane == 0) tmp[warp] = ws;
    __syncthreads();
    // inclusive prefix of the warp totals over lanes < NWARPS
    const uint32_t pre = warp_incl_scan<NWARPS>(lane < NWARPS ? tmp[lane] : 0u);
    tot = __shfl_sync(FULL, pre, NWARPS - 1);
    const uint32_t above = tot - __shfl_sync(FULL, pre, warp);  // elements in the warps after this one
    if (need > tot) need = tot;
    if (need > 0u && above < need && need <= above + ws) {  // warp-uniform: this warp holds the bin
      const uint32_t q = warp_incl_scan(s);  // inclusive prefix over the warp's lanes
      pick(above + ws - q, need);
    }
  } else {
    const uint32_t ex = block_excl_scan(s, sm.scan[0], &tot);
    if (need > tot) need = tot;
    pick(tot - ex - s, need);  // elements in bins above this thread's bins
  }
  if (threadIdx.x == 0) sm.ctl[3] = tot;
  __syncthreads();
}

struct Thresh {
  uint32_t tkey;        // select key > tkey, ...
  uint32_t need_eq;     // ... and the first need_eq elements (index order) with key == tkey
  bool marked = false;  // the selection is already in the bitmaps (warp_select with Marks)
};

// Bitmaps of the selection over element indices (G: key > tkey, Q: key == tkey) and the element index of each
// buffered key, for warp_select to mark while it resolves (see mark_selected).
struct Marks {
  const uint32_t* I;
  uint32_t* G;
  uint32_t* Q;
};

__device__ Thresh warp_select(Smem& sm, const uint32_t* keys, int count, uint32_t lo, uint32_t span, uint32_t need,
                              const Marks* mk);

// Refines the threshold. Precondition: hist holds the digit histogram at prefix length L among the
// elements with prefix P, and 1 <= need <= their count; or, with have_bin, find_bin<NBINS>(sm, need) has
// just read that histogram (ctl holds its result). next_hist(L, P) must rebuild hist for the next digit
// from the zero histogram find_bin leaves, and end with a barrier. With the elements' keys in shared memory
// (keys, count: zero for no element), a bin of at most 32 keys is finished by warp_select (marking the
// selection where mk is given).
template <bool TWO_LEVEL = false, class NextHist>
__device__ Thresh resolve(Smem& sm, int L, uint32_t P, uint32_t need, NextHist&& next_hist, bool have_bin = false,
                          const uint32_t* keys = nullptr, int count = 0, const Marks* mk = nullptr) {
  while (true) {
    const int w = (L == 22) ? 10 : 11;
    if (have_bin) have_bin = false;
    else if (w == 11) find_bin<NBINS, TWO_LEVEL>(sm, need);
    else find_bin<NBINS / 2, TWO_LEVEL>(sm, need);
    const uint32_t B = sm.ctl[0], above = sm.ctl[1], cnt = sm.ctl[2];
    P = (P << w) | B;
    L += w;
    need -= above;
    Thresh t;
    if (cnt == need) {  // the whole bin is taken: no tie to break
      unsigned long long lo = (unsigned long long)P << (32 - L);
      t.tkey = (uint32_t)((lo > 1ull ? lo : 1ull) - 1ull);
      t.need_eq = 0u;
      return t;
    }
    if (L == 32) {
      t.tkey = P;
      t.need_eq = need;
      return t;
    }
    if (keys != nullptr && cnt <= 32u) {
      const uint32_t lo = P << (32 - L), span = (1u << (32 - L)) - 1u;  // 11 <= L <= 22
      return lo == 0u ? warp_select(sm, keys, count, 1u, span - 1u, need, mk)
                      : warp_select(sm, keys, count, lo, span, need, mk);
    }
    next_hist(L, P);
  }
}

__device__ __forceinline__ bool is_gt(uint32_t key, const Thresh& t) { return key > t.tkey; }
__device__ __forceinline__ bool is_eq(uint32_t key, const Thresh& t) { return t.need_eq > 0u && key == t.tkey; }

// Ordered selection of one tile of shared-memory keys: each thread holds E consecutive keys, threads in
// index order. Calls emit(rank, j) for each selected key. run_gt/run_eq: counts in earlier tiles.
// Per-tile counts are at most THREADS*E < 2^16, so both counts share one 32-bit scan.
template <int E, class Emit>
__device__ __forceinline__ void select_tile(Smem& sm, int& par, const uint32_t (&key)[E], const Thresh& t,
                                            uint32_t& run_gt, uint32_t& run_eq, Emit&& emit) {
  static_assert(THREADS * E < 65536, "packed tile counts");
  static_assert(E <= 32, "one mask bit per key");
  if (t.need_eq == 0u) {
    // Uniform: no tie at the threshold (the usual case). One comparison per key, and the emit loop runs over
    // the selected keys only (a mask), not over all E with a test each.
    uint32_t mask = 0u;
#pragma unroll
    for (int j = 0; j < E; ++j) mask |= (uint32_t)(key[j] > t.tkey) << j;
    uint32_t tot;
    uint32_t r = run_gt + block_excl_scan((uint32_t)__popc(mask), sm.scan[par], &tot);
    par ^= 1;
    while (mask) {
      emit(r++, __ffs((int)mask) - 1);
      mask &= mask - 1u;
    }
    run_gt += tot;
    return;
  }
  uint32_t ngt = 0u, neq = 0u;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    ngt += is_gt(key[j], t);
    neq += is_eq(key[j], t);
  }
  uint32_t tot;
  const uint32_t ex = block_excl_scan((ngt << 16) | neq, sm.scan[par], &tot);
  par ^= 1;
  if (ngt | neq) {
    uint32_t gt = run_gt + (ex >> 16), eq = run_eq + (ex & 0xffffu);
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if (is_gt(key[j], t)) {
        emit(gt + (eq < t.need_eq ? eq : t.need_eq), j);
        ++gt;
      } else if (is_eq(key[j], t)) {
        if (eq < t.need_eq) emit(gt + eq, j);
        ++eq;
      }
    }
  }
  run_gt += tot >> 16;
  run_eq += tot & 0xffffu;
}

// Layout of a row's keys in shared memory (K of smem_rows and the cluster kernel): 16-byte group g lives at
// group g ^ ((g >> 3) & 7). smem_select's loads (lane t reads group 4t + q) then spread over all eight
// 16-byte bank groups instead of two (a 4-way conflict over the ideal before; NOTES.md), while thread-consecutive
// groups (the load's stores) stay permuted within aligned octets. The permutation keeps every aligned 32 keys
// in place as a set, so order-free passes (histograms, counts) read K plainly over m rounded up to 32.
__device__ __forceinline__ int kgroup(int g) { return g ^ ((g >> 3) & 7); }
__device__ __forceinline__ int kslot(int i) { return (kgroup(i >> 2) << 2) | (i & 3); }
__device__ __forceinline__ int round32(int m) { return (m + 31) & ~31; }

// The words of 16-byte groups g0 .. g0 + N - 1 of an array in that layout, into registers (four per group).
template <int N>
__device__ __forceinline__ void load_kgroups(const uint32_t* base, int g0, uint32_t (&w)[4 * N]) {
#pragma unroll
  for (int q = 0; q < N; ++q) {
    const uint4 v = *reinterpret_cast<const uint4*>(base + 4 * kgroup(g0 + q));
    w[4 * q] = v.x;
    w[4 * q + 1] = v.y;
    w[4 * q + 2] = v.z;
    w[4 * q + 3] = v.w;
  }
}

// Ordered selection over `count` keys in shared memory (16 consecutive keys per thread per tile), stored in
// the K layout above if SWZ; emit(rank, index) for each selected key.
template <bool SWZ = false, class Emit>
__device__ void smem_select(Smem& sm, int& par, const uint32_t* keys, int count, const Thresh& t, Emit&& emit) {
  constexpr int PER = 16;
  uint32_t rg = 0, re = 0;
  for (int base = 0; base < count; base += THREADS * PER) {
    const int i0 = base + (int)threadIdx.x * PER;
    const bool inside = base + THREADS * PER <= count;  // uniform: whole tiles skip the bounds tests
    uint32_t key[PER];
#pragma unroll
    for (int q = 0; q < PER / 4; ++q) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      const int g = (i0 >> 2) + q;
      if (inside || i0 + 4 * q < count) v = *reinterpret_cast<const uint4*>(keys + 4 * (SWZ ? kgroup(g) : g));
      key[4 * q] = v.x; key[4 * q + 1] = v.y; key[4 * q + 2] = v.z; key[4 * q + 3] = v.w;
    }
    if (!inside) {
#pragma unroll
      for (int j = 0; j < PER; ++j) key[j] = i0 + j < count ? key[j] : 0u;
    }
    select_tile<PER>(sm, par, key, t, rg, re, [&](uint32_t rank, int j) { emit(rank, i0 + j); });
  }
}

// Histogram over `count` keys in shared memory, added to the zero histogram find_bin leaves (after its final
// barrier): bin_of(key, bin) says whether the key counts and sets its bin. Ends with a barrier. Whole 16-byte
// groups without per-key bounds tests, the last count % 4 keys by one thread: the sweep runs once or twice per
// shared-memory row over all its keys, and its per-key instructions were a quarter of that kernel's (NOTES.md).
template <class BinOf>
__device__ void smem_hist_by(Smem& sm, const uint32_t* keys, int count, BinOf&& bin_of) {
  const int nv = count >> 2;
  for (int v = threadIdx.x; v < nv; v += THREADS) {
    const uint4 q = *reinterpret_cast<const uint4*>(keys + 4 * v);
    const uint32_t key[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b;
      const bool ok = bin_of(key[j], b);
      hist_inc(sm, b, ok);
    }
  }
  if (threadIdx.x == 0)
    for (int i = nv * 4; i < count; ++i) {
      uint32_t b;
      if (bin_of(keys[i], b)) atomicAdd(&sm.hist[b], 1u);
    }
  __syncthreads();
}

// The digit at prefix length L of the keys with prefix P.
__device__ void smem_hist(Smem& sm, const uint32_t* keys, int count, int L, uint32_t P) {
  const int s = digit_shift(L);
  const uint32_t msk = digit_mask(L);
  const uint32_t pmask = L == 0 ? 0u : 0xffffffffu << (32 - L);  // has_prefix without the L == 0 branch
  const uint32_t pval = L == 0 ? 0u : P << (32 - L);
  smem_hist_by(sm, keys, count, [&](uint32_t key, uint32_t& b) {
    b = (key >> s) & msk;
    return key != 0u && (key & pmask) == pval;
  });
}

// The threshold of the need-th best of the keys in [lo, lo + span] (lo >= 1), at most 32 of them, among the
// `count` keys in shared memory (need >= 1, need <= their number): one sweep gathers them (with their element
// indices) into hist[0, 64) (counted in hist[NBINS - 1]; find_bin leaves all of hist zero, and this leaves it
// so again), and one warp ranks them by comparing each with every other. Replaces the remaining histogram
// levels (a sweep and a find_bin each, three barriers) whenever the threshold's bin holds few keys, which a bin
// of a digit spanning the keys' range usually does. With mk, the same sweep also marks the keys above the bin
// (all selected) in the bitmaps and the warp marks the bin's selected keys, so that no mark_selected sweep
// follows (the result says marked). Starts after find_bin; ends with a barrier.
__device__ Thresh warp_select(Smem& sm, const uint32_t* keys, int count, uint32_t lo, uint32_t span, uint32_t need,
                              const Marks* mk) {
  uint32_t* list = sm.hist;
  const uint32_t top = lo + span;  // no wrap: keys <= key(+inf) = 2^32 - 2^23 and spans < 2^22
  for (int i = threadIdx.x; i < count; i += THREADS) {
    const uint32_t key = keys[i];
    if (key - lo <= span) {
      const uint32_t slot = atomicAdd(&sm.hist[NBINS - 1], 1u);
      list[slot] = key;
      if (mk != nullptr) list[32 + slot] = mk->I[i];
    } else if (mk != nullptr && key > top) {
      const uint32_t idx = mk->I[i];
      atomicOr(&mk->G[idx >> 5], 1u << (idx & 31u));
    }
  }
  __syncthreads();
  TSI_MARK(22);
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const uint32_t n = sm.hist[NBINS - 1];
    const uint32_t v = (uint32_t)lane < n ? list[lane] : 0u;  // 0 is below every key here (lo >= 1)
    const uint32_t idx = mk != nullptr ? list[32 + lane] : 0u;
    __syncwarp();
    list[lane] = 0u;
    list[32 + lane] = 0u;
    if (lane == 0) sm.hist[NBINS - 1] = 0u;
    uint32_t gt = 0u, eq = 0u;  // keys above v, keys equal to v (v itself included)
#pragma unroll 8
    for (int o = 0; o < 32; ++o) {
      const uint32_t w = __shfl_sync(FULL, v, o);
      gt += w > v;
      eq += w == v;
    }
    const bool hit = (uint32_t)lane < n && gt < need && need <= gt + eq;
    const unsigned who = __ballot_sync(FULL, hit);
    const int first = __ffs((int)who) - 1;
    // Every key equal to the threshold key taken: select key > it - 1, no tie to break.
    const uint32_t tv = __shfl_sync(FULL, v, first), tg = __shfl_sync(FULL, gt, first);
    const uint32_t te = __shfl_sync(FULL, eq, first);
    const uint32_t tkey = need == tg + te ? tv - 1u : tv, need_eq = need == tg + te ? 0u : need - tg;
    if (lane == 0) {
      sm.ctl[0] = tkey;
      sm.ctl[1] = need_eq;
    }
    if (mk != nullptr && (uint32_t)lane < n) {
      if (v > tkey) atomicOr(&mk->G[idx >> 5], 1u << (idx & 31u));
      else if (need_eq > 0u && v == tkey) atomicOr(&mk->Q[idx >> 5], 1u << (idx & 31u));
    }
  }
  __syncthreads();
  Thresh t;
  t.tkey = sm.ctl[0];
  t.need_eq = sm.ctl[1];
  t.marked = mk != nullptr;
  return t;
}

// The threshold of the need-th best of the c keys in shared memory (1 <= need <= c), all in [lo, hi], lo >= 1:
// a radix select on key - lo whose first digit spans [lo, hi] (2048 bins of 2^s keys), then finer digits of 11
// bits, until the threshold's bin holds at most 32 keys (warp_select) or one key value. A buffer of keys above
// a sampled threshold falls in a few bins of the top digit of the key itself; bins spanning its actual range
// hold ~10 keys each near the k-th best of random rows. hist must be zero (find_bin leaves it so). mk: as
// warp_select. Ends with a barrier.
__device__ Thresh buffer_resolve(Smem& sm, const uint32_t* keys, int c, uint32_t lo, uint32_t hi, uint32_t need,
                                 const Marks* mk = nullptr) {
  while (true) {
    const uint32_t span = hi - lo;
    const int s = span < (uint32_t)NBINS ? 0 : 21 - __clz((int)span);  // span >> s < NBINS
    smem_hist_by(sm, keys, c, [&](uint32_t key, uint32_t& b) {
      const uint32_t r = key - lo;
      b = r >> s;
      return r <= span;
    });
    TSI_MARK(20);
    find_bin<NBINS>(sm, need);
    TSI_MARK(21);
    const uint32_t B = sm.ctl[0], above = sm.ctl[1], cnt = sm.ctl[2];
    need -= above;
    lo += B << s;
    const uint32_t top = lo + ((1u << s) - 1u);  // no wrap: keys <= key(+inf) = 2^32 - 2^23, s <= 21
    hi = top < hi ? top : hi;
    Thresh t;
    if (cnt == need || lo == hi) {  // the whole bin taken (no tie to break), or a bin of one key value
      t.tkey = cnt == need ? lo - 1u : lo;
      t.need_eq = cnt == need ? 0u : need;
      return t;
    }
    if (cnt <= 32u) return warp_select(sm, keys, c, lo, hi - lo, need, mk);
  }
}

// Expected number of elements at or above a sampled threshold: T = floor(sqrt(k * cap)), as far from k as
// from cap by ratio, so that the buffer of cap elements usually holds all T and T >= k.
__device__ __forceinline__ int target_count(int kk, int cap) {
  const int p = kk * cap;  // kk <= cap <= 8192: all products < 2^31
  int T = (int)sqrtf((float)p);  // within one of the answer; no search loop on the row's critical path
  while (T * T > p) --T;
  while ((T + 1) * (T + 1) <= p) ++T;
  return T;
}

// tau = the lower edge of the 22-bit bin holding the j-th best of the sv sample keys in keys[] (1 <= j <= sv),
// from two histogram levels; hist already holds the sample's top digit (built while the sample was gathered).
__device__ uint32_t sample_tau(Smem& sm, const uint32_t* keys, int sv, uint32_t j) {
  find_bin<NBINS>(sm, j);
  TSI_MARK(23);
  const uint32_t B1 = sm.ctl[0];
  const uint32_t need = j - sm.ctl[1];
  smem_hist(sm, keys, sv, 11, B1);
  TSI_MARK(24);
  find_bin<NBINS>(sm, need);
  const uint32_t tau = (B1 << 21) | (sm.ctl[0] << 10);
  return tau == 0u ? 1u : tau;  // key 0 is "no element"
}

// Output in index order through bitmaps over element indices [0, 32 * W): G = selected for key > tkey,
// Q = key == tkey (only the first need_eq of them in index order are taken). emit(rank, index) for each
// selected element; ranks count G and taken Q elements before it. One block scan; ends without a barrier.
// MAXPW: the most words per thread (W <= MAXPW * THREADS).
template <int MAXPW, class Emit>
__device__ void bitmap_emit(Smem& sm, const uint32_t* G, const uint32_t* Q, int W, uint32_t need_eq, Emit&& emit) {
  // Thread t owns words [t * PW, t * PW + n), read once into registers: 16-byte loads where PW is the full
  // MAXPW (one word per load at a stride of PW words would hit the same banks PW ways).
  const int PW = (W + THREADS - 1) / THREADS;
  const int w0 = (int)threadIdx.x * PW;
  const int n = W - w0 < 0 ? 0 : (W - w0 < PW ? W - w0 : PW);
  uint32_t g[MAXPW], q[MAXPW];
  bool vec = false;
  if constexpr (MAXPW % 4 == 0) vec = n == MAXPW;
  if (vec) {
#pragma unroll
    for (int j = 0; j < MAXPW; j += 4) {
      const uint4 a = *reinterpret_cast<const uint4*>(G + w0 + j);
      const uint4 b = need_eq ? *reinterpret_cast<const uint4*>(Q + w0 + j) : make_uint4(0u, 0u, 0u, 0u);
      g[j] = a.x; g[j + 1] = a.y; g[j + 2] = a.z; g[j + 3] = a.w;
      q[j] = b.x; q[j + 1] = b.y; q[j + 2] = b.z; q[j + 3] = b.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < MAXPW; ++j) {
      g[j] = j < n ? G[w0 + j] : 0u;
      q[j] = j < n && need_eq ? Q[w0 + j] : 0u;
    }
  }
  uint32_t ng = 0u, nq = 0u;
#pragma unroll
  for (int j = 0; j < MAXPW; ++j) {
    ng += (uint32_t)__popc(g[j]);
    nq += (uint32_t)__popc(q[j]);
  }
  uint32_t tot;
  const uint32_t ex = block_excl_scan((ng << 16) | nq, sm.scan[0], &tot);  // both counts <= CAND_CAP < 2^16
  const uint32_t gt = ex >> 16, eq = ex & 0xffffu;
  // The selected ties are the first need_eq in index order: this thread's share is a prefix of its own, merged into
  // its "greater" words so that the walk below has one branch-free body (interleaving the two bitmaps bit by bit
  // took ~17 instructions and two branches per output; now 9: NOTES.md, run 132).
  uint32_t take = eq < need_eq ? need_eq - eq : 0u;
  if (take < nq) {
#pragma unroll
    for (int j = 0; j < MAXPW; ++j) {
      const uint32_t c = (uint32_t)__popc(q[j]);
      if (take >= c) {
        take -= c;
      } else {
        uint32_t keep = 0u;
        for (; take > 0u; --take) {
          const uint32_t low = q[j] & (0u - q[j]);
          keep |= low;
          q[j] ^= low;
        }
        q[j] = keep;
      }
    }
  }
  uint32_t rank = gt + (eq < need_eq ? eq : need_eq);
#pragma unroll
  for (int j = 0; j < MAXPW; ++j) {
    uint32_t sel = g[j] | q[j];
    const int base = 32 * (w0 + j);
    while (sel != 0u) {
      emit(rank++, base + __ffs((int)sel) - 1);
      sel &= sel - 1u;
    }
  }
}

// Sets the bitmap bits of the c buffered candidates (keys K, element indices I) that the threshold selects.
// Starts without a barrier, ends with one.
__device__ void mark_selected(uint32_t* G, uint32_t* Q, const uint32_t* K, const uint32_t* I, int c, const Thresh& t) {
  for (int i = threadIdx.x; i < c; i += THREADS) {
    const uint32_t key = K[i], idx = I[i];
    if (is_gt(key, t)) atomicOr(&G[idx >> 5], 1u << (idx & 31u));
    else if (is_eq(key, t)) atomicOr(&Q[idx >> 5], 1u << (idx & 31u));
  }
  __syncthreads();
}

// Streams items [0, n) in batches of U tiles (item = base + u*THREADS + tid); the next batch's loads
// are in flight while f(cur, base) runs. REV walks the batches from last to first. f is called
// uniformly by all threads and returns whether to go on (a uniform value), so a pass can stop early.
template <int U, bool REV, class Src, class F>
__device__ __forceinline__ void stream_while(const Src& src, F&& f) {
  const int n = src.items();
  const int per = THREADS * U;
  const int nb = (n + per - 1) / per;
  if (nb == 0) return;
  Raw buf[U];
  int b = REV ? nb - 1 : 0;
#pragma unroll
  for (int u = 0; u < U; ++u) buf[u] = src.load(b * per + u * THREADS + (int)threadIdx.x);
  for (int it = 0; it < nb; ++it) {
    const int bn = REV ? b - 1 : b + 1;
    Raw cur[U];
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = buf[u];
    if (it + 1 < nb) {
      if (src.full(bn * per, per)) {  // uniform: batches inside the row skip the edge checks
        if constexpr (requires { src.ch.abase; }) {  // one address, the tiles at constant offsets from it
          const char* q = src.ch.abase + (long long)(bn * per + (int)threadIdx.x) * 16;
#pragma unroll
          for (int u = 0; u < U; ++u) buf[u] = load16(q + u * (THREADS * 16));
        } else {
#pragma unroll
          for (int u = 0; u < U; ++u) buf[u] = src.load_full(bn * per + u * THREADS + (int)threadIdx.x);
        }
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) buf[u] = src.load(bn * per + u * THREADS + (int)threadIdx.x);
      }
    }
    if (!f(cur, b * per)) return;
    b = bn;
  }
}

template <int U, bool REV, class Src, class F>
__device__ __forceinline__ void stream(const Src& src, F&& f) {
  stream_while<U, REV>(src, [&](const Raw (&cur)[U], int base) {
    f(cur, base);
    return true;
  });
}

template <int U, class Src>
__device__ __forceinline__ void batch_keys(const Src& src, const Raw (&cur)[U], int base,
                                           uint32_t (&key)[U][Src::E]) {
#pragma unroll
  for (int u = 0; u < U; ++u) src.elems(cur[u], base + u * THREADS + (int)threadIdx.x, key[u]);
}

// Histogram pass over the row in global memory: digit at prefix length L among keys with prefix P.
template <int U, class Src>
__device__ void global_hist(Smem& sm, const Src& src, int L, uint32_t P) {
  stream<U, false>(src, [&](const Raw (&cur)[U], int base) {
    uint32_t key[U][Src::E];
    batch_keys<U>(src, cur, base, key);
#pragma unroll
    for (int u = 0; u < U; ++u) hist_keys<Src::E>(sm, key[u], L, P);
  });
}

__device__ __forceinline__ int lower_bound(const uint32_t* a, int n, uint32_t v) {
  int lo = 0, hi = n;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (a[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// ------------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void pad_out(int* out, int from, int kk) {
  for (int i = from + threadIdx.x; i < kk; i += THREADS) out[i] = -1;
}

// A dense row of at most k valid elements: every valid position, then -1, without reading the row. Returns whether
// the row was such a one (then it is done).
template <class Src>
__device__ __forceinline__ bool dense_all_valid(const Src& src, int* out, int kk) {
  if constexpr (Src::KIND != DENSE) {
    return false;
  } else {
    if (src.m > kk) return false;
    for (int i = threadIdx.x; i < kk; i += THREADS) out[i] = i < src.m ? i : -1;
    return true;
  }
}

// Final pass over the row in global memory, in index order: writes the selected positions.
template <int U, class Src>
__device__ void final_global(Smem& sm, int& par, const Src& src, const Thresh& t, int* out) {
  static_assert(U * THREADS * Src::E < 65536, "packed batch counts");
  uint32_t rg = 0, re = 0;
  stream<U, false>(src, [&](const Raw (&cur)[U], int base) {
    uint32_t key[U][Src::E];
    batch_keys<U>(src, cur, base, key);
    uint32_t cnt[U], ex[U], tot;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint32_t ngt = 0u, neq = 0u;
#pragma unroll
      for (int j = 0; j < Src::E; ++j) {
        ngt += is_gt(key[u][j], t);
        neq += is_eq(key[u][j], t);
      }
      cnt[u] = (ngt << 16) | neq;
    }
    block_excl_scan_multi<U>(cnt, ex, &tot, sm.scan[par]);
    par ^= 1;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (cnt[u] == 0u) continue;
      const int c = base + u * THREADS + (int)threadIdx.x;
      uint32_t gt = rg + (ex[u] >> 16), eq = re + (ex[u] & 0xffffu);
#pragma unroll
      for (int j = 0; j < Src::E; ++j) {
        if (is_gt(key[u][j], t)) {
          out[gt + (eq < t.need_eq ? eq : t.need_eq)] = src.pos(src.index(c, j));
          ++gt;
        } else if (is_eq(key[u][j], t)) {
          if (eq < t.need_eq) out[gt + eq] = src.pos(src.index(c, j));
          ++eq;
        }
      }
    }
    rg += tot >> 16;
    re += tot & 0xffffu;
  });
}

// A shared-memory base for copies at constant offsets from it: the address conversion done once (per copy it cost
// a special-register read and ~5 instructions more: sm_90a SASS of keys_to_smem_async).
struct SmemBase {
  unsigned char* p;
  unsigned s;  // its shared-window address (unused in emulation)
  __device__ explicit SmemBase(void* ptr) : p(static_cast<unsigned char*>(ptr)) {
#ifdef TSI_EMULATE
    s = 0u;
#else
    s = (unsigned)__cvta_generic_to_shared(ptr);
#endif
  }
};

// cp.async (SM80+): N = 16 or 4 bytes from global to shared memory without passing through registers (16-byte
// copies skip L1: .cg; smaller ones must use .ca); commit groups and their waits are per thread. The emulator
// lands each group at the wait that covers it (tsi_emu::async_copy). This form copies to b + off from gmem + GOFF,
// a compile-time offset, so that copies from one global base need no address arithmetic of their own (it is an
// immediate of the instruction).
template <int N, int GOFF>
__device__ __forceinline__ void cp_async_at(const SmemBase& b, unsigned off, const void* gmem) {
  static_assert(N == 16 || N == 4, "cp.async sizes used here");
#ifdef TSI_EMULATE
  tsi_emu::async_copy(b.p + off, static_cast<const unsigned char*>(gmem) + GOFF, N, N);
#else
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1+%2], 16;\n" ::"r"(b.s + off), "l"(gmem), "n"(GOFF) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1+%2], 4;\n" ::"r"(b.s + off), "l"(gmem), "n"(GOFF) : "memory");
#endif
}

// One cp.async of N bytes from gmem to smem.
template <int N>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
  cp_async_at<N, 0>(SmemBase(smem), 0u, gmem);
}

// f(std::integral_constant<int, I>{}) for I = 0 .. N - 1, in order (compile-time indices, e.g. for cp_async_at;
// read them as decltype(arg)::value: the constant's conversion operator is host-only for nvcc).
template <int N, class F>
__device__ __forceinline__ void unrolled(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef TSI_EMULATE
  tsi_emu::async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef TSI_EMULATE
  tsi_emu::async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Histogram decrements, for columns counted by the load and then taken out again (a sparse row's invalid columns).
// A decrement compiles to ATOMS.ADD, which serialises the lanes of a warp on one address; only increments are
// aggregated in hardware (ATOMS.POPC.INC: run 153). The columns taken out mostly share one bin (the scorer writes
// -inf there), so each thread sums its decrements per run of equal bins, and flush() sends the warp's runs on its
// first pending bin as one atomic.
struct DecRuns {
  uint32_t bin = 0u, n = 0u;  // the pending run
  __device__ __forceinline__ void add(Smem& sm, uint32_t b) {
    if (b != bin) {
      if (n != 0u) atomicAdd(&sm.hist[bin], 0u - n);
      bin = b;
      n = 0u;
    }
    ++n;
  }
  // Every lane of the warp calls it.
  __device__ __forceinline__ void flush(Smem& sm) {
    const uint32_t pending = __ballot_sync(FULL, n != 0u);
    if (pending == 0u) return;  // the same for the whole warp
    const int first = __ffs((int)pending) - 1;
    const uint32_t lb = __shfl_sync(FULL, bin, first);
    const bool merged = n != 0u && bin == lb;
    const uint32_t sum = __reduce_add_sync(FULL, merged ? n : 0u);
    if (n != 0u && !merged) atomicAdd(&sm.hist[bin], 0u - n);
    if ((int)(threadIdx.x & 31u) == first) atomicAdd(&sm.hist[lb], 0u - sum);
  }
};

// keys_to_smem for fp32 rows whose element 0 is 16-byte aligned (dense rows, and sparse rows: SparseTabSrc):
// every chunk of 4 scores inside the row is copied straight into its key slot by cp.async, the whole row at once
// (64 KB in flight per CTA instead of two 16-byte tiles per thread through registers: the streamed load was bound
// by bytes in flight, 5.7 us per row with two CTAs per SM, NOTES.md), in four commit groups; each thread converts
// its own chunks in place (raw bits to keys) and counts them as its groups land, so no barrier separates a copy
// from its conversion; a sparse row then takes its invalid columns out again (a short request's row copies and
// counts only its valid chunks instead: below; H100 runs 157-158, NOTES.md). A sparse row's candidate block ids
// go first, by cp.async as well, into its table of valid prefixes: global loads of them before the copies would
// delay the row by a DRAM latency, and after the copies they would wait behind the whole row (NOTES.md, run 37).
template <class Src>
__device__ void keys_to_smem_async(Smem& sm, const Src& src, uint32_t* K) {
  static_assert(Src::E == 4, "fp32 chunks");
  constexpr int NU = SMEM_KEYS / 4 / THREADS;  // chunks per thread (a row has at most SMEM_KEYS keys)
  constexpr int G = NU >= 4 ? 4 : NU;
  constexpr int PER = NU / G;
  static_assert(NU % G == 0 && G >= 1 && G <= 4, "commit groups");
  const int m = src.m, nfull = m >> 2, tid = (int)threadIdx.x;
  // A sparse row whose request is shorter than its candidate columns (a short context: its list ends in -1 blocks)
  // copies the first quarter of its row (group 0) as any row does, then learns its valid prefixes and copies only
  // the other chunks that hold valid columns (vc[u] of them, a prefix of the chunk: a chunk never spans two
  // blocks). A 4K-token request in 16K candidate columns so reads a quarter of its row and needs no decrements.
  // Other rows copy the whole row without waiting on their ids (that wait would delay every full row by a memory
  // latency); group 0 goes first so that a full row's copies wait only on its length.
  int vc[NU];
#pragma unroll
  for (int u = 0; u < NU; ++u) vc[u] = 4;
  if constexpr (Src::KIND == SPARSE) {
    // ids per thread at most (candidate blocks of at least 8 columns)
    constexpr int NB = (SMEM_KEYS / 8 + THREADS - 1) / THREADS;
    const SmemBase tb(src.tv + tid);
    unrolled<NB>([&](auto qc) {
      constexpr int q = decltype(qc)::value;
      if (q * THREADS + tid < src.nb) cp_async_at<4, 4 * q * THREADS>(tb, 4u * q * THREADS, src.blk + tid);
    });
    cp_async_commit();
  }
  // Chunk c = u * THREADS + tid lands at group kgroup(c) = u * THREADS + kgroup(tid) (THREADS is a multiple of 64),
  // so one shared and one global base per thread serve all its copies, at constant offsets (ptxas spent ~10
  // instructions per copy on its addresses: sm_90a SASS, NOTES.md run 129).
  static_assert(THREADS % 64 == 0, "one swizzle per thread");
  const SmemBase kb(K + 4 * kgroup(tid));
  const char* const gb = src.ch.abase + 16LL * tid;
  uint4* const q0 = reinterpret_cast<uint4*>(K + 4 * kgroup(tid));
  auto copy_group = [&](auto gc) {  // group g's copies (vc[u] == 0: no valid column, so "no element" instead)
    unrolled<PER>([&](auto jc) {
      constexpr int u = decltype(gc)::value * PER + decltype(jc)::value;
      if (u * THREADS + tid < nfull) {
        if (vc[u] != 0) cp_async_at<16, 16 * u * THREADS>(kb, 16u * u * THREADS, gb);
        else q0[u * THREADS] = make_uint4(0u, 0u, 0u, 0u);
      }
    });
    cp_async_commit();
  };
  copy_group(std::integral_constant<int, 0>{});
  bool first = false;
  if constexpr (Src::KIND == SPARSE) {
    first = src.len < (long long)m;
    if (first) {
      cp_async_wait<1>();  // the ids (group 0's copies may still be in flight)
      src.ids_to_prefixes();
      __syncthreads();
#pragma unroll
      for (int u = 0; u < NU; ++u) {
        const int c = u * THREADS + tid;
        const int v = c < nfull ? src.tv[(4 * c) >> src.lcbs] - ((4 * c) & (src.cbs - 1)) : 0;
        vc[u] = v <= 0 ? 0 : (v >= 4 ? 4 : v);
      }
    }
  }
  unrolled<G - 1>([&](auto gc) { copy_group(std::integral_constant<int, decltype(gc)::value + 1>{}); });
  clear_hist(sm);
  if (tid == 0) sm.ctl[4] = 0u;
  for (int i = 4 * nfull + tid; i < round32(m); i += THREADS) K[kslot(i)] = 0u;  // past the copies: tail + padding
  if constexpr (Src::KIND == SPARSE) {  // this thread's block ids have landed: their valid prefixes, in place
    if (!first) {
      cp_async_wait<G>();
      src.ids_to_prefixes();
    }
  }
  __syncthreads();  // the histogram is clear and a sparse row's valid prefixes are stored before the counts
  if (tid == 0 && 4 * nfull < m) {  // the partial last chunk
    if constexpr (Src::KIND == DENSE) {
      for (int i = 4 * nfull; i < m; ++i) {
        const uint32_t key = f32_key(DT<float>::load1(src.ch.row, i));
        K[kslot(i)] = key;
        atomicAdd(&sm.hist[key >> 21], 1u);
      }
    } else {
      uint32_t key[4];
      src.elems(src.load(nfull), nfull, key);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (4 * nfull + j < m) K[kslot(4 * nfull + j)] = key[j];
      hist_keys<4>(sm, key, 0, 0u);
    }
  }
  // Chunk u of this thread sits u * THREADS groups after its first (as for the copies). Threads whose chunks all lie
  // inside the row (all but the last few) convert them without a bounds test, so the conversion is straight-line code.
  auto as_landed = [&](auto&& f) {  // f(u) for each chunk u of this thread, as its commit group lands
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g == 0) cp_async_wait<G - 1>();
      else if (g == 1) cp_async_wait<(G > 1 ? G - 2 : 0)>();
      else if (g == 2) cp_async_wait<(G > 2 ? G - 3 : 0)>();
      else cp_async_wait<0>();
#pragma unroll
      for (int j = 0; j < PER; ++j) f(g * PER + j);
    }
  };
  auto convert = [&](bool check) {
    as_landed([&](int u) {
      if (!check || u * THREADS + tid < nfull) {
        uint4* q = q0 + u * THREADS;
        uint4 v = *q;
        // Every column as an element (a sparse row's invalid ones are taken out below, after the barrier).
        v.x = f32_key(v.x); v.y = f32_key(v.y); v.z = f32_key(v.z); v.w = f32_key(v.w);
        *q = v;
        atomicAdd(&sm.hist[v.x >> 21], 1u);
        atomicAdd(&sm.hist[v.y >> 21], 1u);
        atomicAdd(&sm.hist[v.z >> 21], 1u);
        atomicAdd(&sm.hist[v.w >> 21], 1u);
      }
    });
  };
  // The copied chunks of a validity-first row: their valid prefix as elements, the rest "no element" (key 0,
  // not counted).
  auto convert_valid = [&]() {
    as_landed([&](int u) {
      if (u < PER ? u * THREADS + tid < nfull : vc[u] != 0) {  // group 0: copied whatever vc says
        uint4* q = q0 + u * THREADS;
        const uint4 v = *q;
        const uint32_t key[4] = {vc[u] > 0 ? f32_key(v.x) : 0u, vc[u] > 1 ? f32_key(v.y) : 0u,
                                 vc[u] > 2 ? f32_key(v.z) : 0u, vc[u] > 3 ? f32_key(v.w) : 0u};
        *q = make_uint4(key[0], key[1], key[2], key[3]);
        hist_keys<4>(sm, key, 0, 0u);
      }
    });
  };
  if (first) convert_valid();
  else if ((NU - 1) * THREADS + tid < nfull) convert(false);
  else convert(true);
  __syncthreads();
  if (first) return;
  if constexpr (Src::KIND == SPARSE) {
    // The copied columns of candidate blocks that are not wholly valid (-1 ids, the block the row's length cuts)
    // become "no element" and leave the histogram: a pass over the row's block table instead of a validity test
    // per chunk (most rows have no such column, or a few). The partial last chunk (thread 0) is already exact.
    const int ncopied = 4 * nfull;
    DecRuns dec;
    for (int b = tid; b < src.nb; b += THREADS) {
      const int v = src.tv[b];
      if (v < src.cbs) {
        const int end = (b + 1) << src.lcbs < ncopied ? (b + 1) << src.lcbs : ncopied;
        for (int i = (b << src.lcbs) + v; i < end; ++i) {
          dec.add(sm, K[kslot(i)] >> 21);
          K[kslot(i)] = 0u;
        }
      }
    }
    dec.flush(sm);
    __syncthreads();
  }
}

// Sparse fp32 rows through keys_to_smem_async (on by default since run 37, NOTES.md; -DTSI_SPARSE_ASYNC=0 builds
// the streamed load for them, for comparisons).
#ifndef TSI_SPARSE_ASYNC
#define TSI_SPARSE_ASYNC 1
#endif

// One read of the row: every key to K[0, m) in shared memory (in the layout of kslot), zeros in K[m, m rounded
// up to 32), the coarse histogram to sm.hist (and ctl[4] = 0). Ends with a barrier. This loop was the largest
// share of the shared-memory rows' instructions (NOTES.md), hence: keys stored 16 bytes at a time where the row's
// element 0 starts an item's group of 4 (fp32 rows 16-byte aligned, bf16 rows 8-byte aligned; keys past m are 0,
// so those stores also pad), and dense batches inside the row skip the per-key bounds tests. Dense fp32 rows
// with element 0 16-byte aligned take keys_to_smem_async instead (and sparse ones in TSI_SPARSE_ASYNC builds).
template <int U, class Src>
__device__ void keys_to_smem(Smem& sm, const Src& src, uint32_t* K) {
  if constexpr (Src::E == 4 && (Src::KIND == DENSE || (TSI_SPARSE_ASYNC && Src::KIND == SPARSE))) {
    if (src.ch.h == 0) {
      keys_to_smem_async(sm, src, K);
      return;
    }
  }
  if constexpr (Src::KIND == SPARSE) src.fill_table();  // ordered before the load loop by the barrier below
  const int m = src.m;
  constexpr bool VEC = Src::E % 4 == 0;
  const bool vec = VEC && (src.index(0, 0) & 3) == 0;
  const int stored = vec ? (m + 3) & ~3 : m;  // K[0, stored) is written by the pass
  clear_hist(sm);
  if (threadIdx.x == 0) sm.ctl[4] = 0u;
  for (int i = stored + (int)threadIdx.x; i < round32(m); i += THREADS) K[kslot(i)] = 0u;
  __syncthreads();
  stream<U, false>(src, [&](const Raw (&cur)[U], int base) {
    auto store = [&](int u, const uint32_t (&key)[Src::E]) {
      const int c = base + u * THREADS + (int)threadIdx.x;
      if (VEC && vec) {
#pragma unroll
        for (int q = 0; q < (VEC ? Src::E / 4 : 0); ++q) {
          const int i = src.index(c, 4 * q);  // a multiple of 4: i < stored implies i + 3 < stored
          if ((uint32_t)i < (uint32_t)stored)
            *reinterpret_cast<uint4*>(K + kslot(i)) =
                make_uint4(key[4 * q], key[4 * q + 1], key[4 * q + 2], key[4 * q + 3]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < Src::E; ++j) {
          const int i = src.index(c, j);
          if ((key[j] != 0u || Src::KIND == SPARSE) && (uint32_t)i < (uint32_t)m) K[kslot(i)] = key[j];
        }
      }
    };
    if constexpr (Src::KIND == DENSE) {
      if (src.full(base, U * THREADS)) {  // every key is an element: no validity anywhere
#pragma unroll
        for (int u = 0; u < U; ++u) {
          uint32_t key[Src::E];
          src.elems_inside(cur[u], key);
          store(u, key);
#pragma unroll
          for (int j = 0; j < Src::E; ++j) atomicAdd(&sm.hist[key[j] >> 21], 1u);
        }
        return;
      }
    }
    uint32_t key[U][Src::E];
    batch_keys<U>(src, cur, base, key);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      store(u, key[u]);
      hist_keys<Src::E>(sm, key[u], 0, 0u);
    }
  });
  __syncthreads();
}

// Sorts v[0, n) ascending in shared memory if it is not already strictly ascending (NONE = no position, sorts
// last); returns whether it sorted. v[n, P) is scratch, P = n rounded up to a power of two. Starts and ends with
// a barrier.
constexpr uint32_t NONE = 0xffffffffu;
__device__ bool sort_if_unordered(Smem& sm, uint32_t* v, int n) {
  if (threadIdx.x == 0) sm.ctl[7] = 0u;
  __syncthreads();
  uint32_t bad = 0u;
  for (int i = threadIdx.x; i + 1 < n; i += THREADS) {
    const uint32_t a = v[i], b = v[i + 1];
    bad |= (uint32_t)(a != NONE && b != NONE && a >= b);
  }
  if (bad) atomicAdd(&sm.ctl[7], 1u);
  __syncthreads();
  if (sm.ctl[7] == 0u) return false;
  int P = 1;
  while (P < n) P <<= 1;
  for (int i = n + threadIdx.x; i < P; i += THREADS) v[i] = NONE;
  __syncthreads();
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < P; i += THREADS) {
        const int j = i ^ stride;
        if (j > i) {
          const bool up = (i & size) == 0;
          const uint32_t a = v[i], b = v[j];
          if ((a > b) == up) { v[i] = b; v[j] = a; }
        }
      }
      __syncthreads();
    }
  }
  return true;
}

// Writes out[0, kk) from stage[0, r) (the selection's element indices, in index order): positions, then -1.
// sparse_topk rows: positions sorted where the row's candidate list is out of order (see
// sort_positions_if_unordered). Starts with a barrier. Where out and stage are 16-byte aligned and kk a multiple
// of 4, each thread moves four consecutive outputs with one 16-byte shared load and one 16-byte store (a word per
// thread per trip took ~16 more instructions per thread at k 2048: sm_90a SASS; sparse_topk -1.4%, block_topk
// -2.6% on an H100, NOTES.md run 137); else consecutive threads write consecutive outputs.
template <class Src>
__device__ void write_staged(Smem& sm, const Src& src, uint32_t* stage, int r, int* out, int kk) {
  const bool vec = ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(stage)) & 15u) == 0u &&
                   (kk & 3) == 0;
  __syncthreads();
  if constexpr (Src::KIND == SPARSE) {
    for (int i = threadIdx.x; i < r; i += THREADS) stage[i] = (uint32_t)src.pos((int)stage[i]);
    sort_if_unordered(sm, stage, r);
  }
  // The position of staged output i (a sparse row's stage holds positions already).
  auto position = [&](int i, uint32_t s) {
    if constexpr (Src::KIND == SPARSE) return i < r ? (int)s : -1;
    else return i < r ? src.pos((int)s) : -1;
  };
  if (vec) {
#pragma unroll 1  // kk <= 4 * THREADS is one trip: unrolled, ptxas put a remainder loop before it
    for (int i = 4 * (int)threadIdx.x; i < kk; i += 4 * THREADS) {
      const uint4 s = *reinterpret_cast<const uint4*>(stage + i);
      *reinterpret_cast<uint4*>(out + i) = make_uint4((uint32_t)position(i, s.x), (uint32_t)position(i + 1, s.y),
                                                      (uint32_t)position(i + 2, s.z), (uint32_t)position(i + 3, s.w));
    }
  } else {
    for (int i = threadIdx.x; i < kk; i += THREADS) out[i] = position(i, stage[i]);
  }
}

// Shared-memory rows whose threshold bin is small (the usual case: 16K random scores put ~1000 keys in the bin
// of the 2048th best): one sweep over the row's keys, thread t on keys [32t, 32t + 32), writes word t of a bitmap
// of the keys above the bin and appends the bin's keys (with their indices) to a buffer while counting their
// next digit; the threshold is refined on that buffer alone, the selected bin keys are marked in the bitmaps,
// and the output comes from them in index order through one block scan. This replaces a filtered histogram
// sweep over all keys per finer digit and an ordered selection over all keys (a block scan per 8K keys).
// Thread t's eight 16-byte loads (groups 8t + q, stored at 8t + (q ^ (t & 7))) meet each bank group once per
// eight lanes: conflict-free. ctl[0..2] hold find_bin's result for the top digit (B, count above B, count in
// B <= BIN_CAP), ctl[4] = 0 (keys_to_smem), hist is zero; 0 < need - above <= count in B. Ends without a barrier.
constexpr int SMEM_WORDS = SMEM_KEYS / 32;  // bitmap words of a shared-memory row
constexpr int BIN_CAP = (REGION_WORDS - SMEM_KEYS - LIST_CAP - 2 * SMEM_WORDS) / 2 & ~3;
static_assert(SMEM_WORDS <= THREADS && SMEM_WORDS % 4 == 0 && LIST_CAP % 4 == 0 && BIN_CAP >= 32,
              "one bitmap word per thread; 16-byte aligned bin buffer");

template <bool TWO_LEVEL, class Emit>
__device__ void smem_bitmap_select(Smem& sm, const uint32_t* K, int m, uint32_t need, Emit&& emit) {
  uint32_t* G = sm.region + SMEM_KEYS + LIST_CAP;  // past the staged output
  uint32_t* Q = G + SMEM_WORDS;
  uint32_t* BK = Q + SMEM_WORDS;
  uint32_t* BI = BK + BIN_CAP;
  const uint32_t B = sm.ctl[0], c = sm.ctl[2];
  need -= sm.ctl[1];
  const uint32_t lo = B << 21, hi = lo | 0x1fffffu;
  const uint32_t lo1 = lo == 0u ? 1u : lo;  // key 0 is "no element"
  const int W = (m + 31) >> 5;
  const int tid = (int)threadIdx.x;
  uint32_t gw = 0u, bm = 0u;
  if (tid < W) {
    // Both bitmaps as "greater than" tests, each over all 32 keys in its own loop: ptxas then packs the
    // predicates seven at a time (P2R) for most of them; interleaved, and with the bin's test written as "<=",
    // it spent a select and an OR per key (~40 more instructions per thread). The bin's keys are those not below
    // it and not above it: "not below" as a "greater than" test of its own (a range test on key - lo1 cost a
    // subtract per key; a "less than" test lost the packing: run 133).
    uint32_t notbelow = 0u, key[32];
    load_kgroups<8>(K, 8 * tid, key);
#pragma unroll
    for (int j = 0; j < 32; ++j) gw |= (uint32_t)(key[j] > hi) << j;
#pragma unroll
    for (int j = 0; j < 32; ++j) notbelow |= (uint32_t)(key[j] > lo1 - 1u) << j;
    bm = notbelow & ~gw;
    G[tid] = gw;
    Q[tid] = 0u;
  }
  uint32_t after;
  uint32_t o = warp_reserve(&sm.ctl[4], (uint32_t)__popc(bm), &after);
  // kslot(32 * tid + j) == 32 * tid + (j ^ 4 * (tid & 7)) for j < 32 (the thread's 8 groups swizzled by tid & 7),
  // which ptxas cannot derive: spelled out, a gathered key's address takes three instructions instead of six.
  const uint32_t* const Kt = K + 32 * tid;
  const int swz = (tid & 7) << 2;
  while (bm != 0u) {
    const int j = __ffs((int)bm) - 1;
    bm &= bm - 1u;
    const uint32_t key = Kt[j ^ swz];
    BK[o] = key;
    BI[o] = (uint32_t)(32 * tid + j);
    ++o;
    atomicAdd(&sm.hist[(key >> 10) & 0x7ffu], 1u);
  }
  __syncthreads();
  const Marks mk{BI, G, Q};
  const Thresh t = resolve<TWO_LEVEL>(
      sm, 11, B, need, [&](int L, uint32_t P) { smem_hist(sm, BK, (int)c, L, P); }, false, BK, (int)c, &mk);
  TSI_MARK(13);
  if (!t.marked) mark_selected(G, Q, BK, BI, (int)c, t);
  if constexpr (TSI_TOPK_STOP == 2) return;
  bitmap_emit<1>(sm, G, Q, W, t.need_eq, emit);
}

template <int U, class Src>
__device__ void smem_rows(Smem& sm, const Src& src, int* out, int kk) {
  uint32_t* K = sm.region;
  uint32_t* stage = sm.region + SMEM_KEYS;  // the selection's element indices (kk <= LIST_CAP <= CAND_CAP)
  const int m = src.m;
  int par = 0;
  // block_topk's rows keep the block scan: with the two-level search its two-CTA kernels spilled (find_bin).
  constexpr bool TWO_LEVEL = Src::KIND != BLOCK;
  TSI_MARK(10);
  keys_to_smem<U>(sm, src, K);
  TSI_MARK(11);
  if constexpr (TSI_TOPK_STOP == 1) return;
  find_bin<NBINS, TWO_LEVEL>(sm, (uint32_t)kk);
  TSI_MARK(12);
  const uint32_t total = sm.ctl[3];
  const int r = total <= (uint32_t)kk ? (int)total : kk;
  if (total > (uint32_t)kk && sm.ctl[2] <= (uint32_t)BIN_CAP) {
    smem_bitmap_select<TWO_LEVEL>(sm, K, m, (uint32_t)kk, [&](uint32_t rank, int i) { stage[rank] = (uint32_t)i; });
    TSI_MARK(15);
    if constexpr (TSI_TOPK_STOP == 2) return;
    write_staged(sm, src, stage, r, out, kk);
    TSI_MARK(14);
    return;
  }
  Thresh t;
  t.tkey = 0u;
  t.need_eq = 0u;
  // Threshold bins too large for the bitmap path (massive ties): each finer digit's histogram sweeps all keys,
  // filtered by the fixed prefix (no buffer can hold the bin).
  if (total > (uint32_t)kk)
    t = resolve<TWO_LEVEL>(
        sm, 0, 0u, (uint32_t)kk, [&](int L, uint32_t P) { smem_hist(sm, K, round32(m), L, P); },
        /*have_bin=*/true, K, round32(m));
  __syncthreads();
  TSI_MARK(13);
  smem_select<true>(sm, par, K, m, t, [&](uint32_t rank, int i) { stage[rank] = (uint32_t)i; });
  write_staged(sm, src, stage, r, out, kk);
  TSI_MARK(14);
}

// Shared-memory rows. Sparse rows put their candidates' valid prefixes in shared memory (keys_to_smem fills the
// table), in the staging area past the keys (free until the selection, which comes after the load that reads them).
template <int U, class Src>
__device__ void smem_mode(Smem& sm, const Src& src, int* out, int kk) {
  if constexpr (Src::KIND == SPARSE) {
    static_assert(REGION_WORDS - SMEM_KEYS >= SMEM_KEYS / 8, "one valid count per block of at least 8 keys");
    smem_rows<U>(sm, SparseTabSrc<typename Src::Elem>(src, reinterpret_cast<int*>(sm.region + SMEM_KEYS)), out, kk);
  } else {
    smem_rows<U>(sm, src, out, kk);
  }
}

// Sampled threshold (streamed rows): one read of the row instead of two, and no histogram atomics over
// the whole row (shared-memory atomics of a whole row's histogram, which many lanes of a warp aim at the
// same few bins, bound the two-pass path more than HBM did: NOTES.md). A sample of the row (TILES tiles
// spread over it) gives a key tau whose expected count over the row is T = sqrt(k * CAND_CAP), between
// k and CAND_CAP by the same factor; one ordered pass writes every element with key >= tau (index
// order, with keys) to shared memory and stops as soon as more than CAND_CAP are seen; the exact
// selection runs on that buffer. Exact whenever k <= count <= CAND_CAP: the k best elements all have
// keys >= the k-th best key >= tau, so all of them are buffered, in index order (ties go to the lowest
// index as everywhere). Otherwise (an unrepresentative sample, massive ties, fewer valid elements than
// k) it returns false and the two-pass path runs: the result never depends on the sample, only the time.
template <class Src>
struct Sample {
  static constexpr int KEYS = CAND_CAP / 2;  // sample keys at most
  // Sampled items per tile: at most 512, so that wider CTAs (TSI_THREADS=1024) still sample two spread tiles
  static constexpr int WIDE = THREADS < 512 ? THREADS : 512;
  static constexpr int ITEMS = KEYS / Src::E < WIDE ? KEYS / Src::E : WIDE;
  static constexpr int TILES = KEYS / (ITEMS * Src::E) > 0 ? KEYS / (ITEMS * Src::E) : 1;
  static_assert(TILES * ITEMS * Src::E <= CAND_CAP, "the sample fits the key buffer");
};

// Rows of at most BITMAP_ELEMS elements buffer their candidates in any order (one shared-memory atomic per
// warp and batch, no block-wide scan or barrier per batch) and are put in index order at the end by bitmaps
// over the row (two of LIST_CAP words after the key and index buffers); longer rows keep the ordered pass.
// (TSI_BITMAP_ELEMS lowers the limit for experiments: benchmarks/variants/ordered_pass_128k.flags.)
#ifndef TSI_BITMAP_ELEMS
#define TSI_BITMAP_ELEMS (32 * TSI_LIST_CAP)
#endif
constexpr int BITMAP_ELEMS = TSI_BITMAP_ELEMS;
static_assert(BITMAP_ELEMS <= 32 * LIST_CAP, "the two bitmaps hold LIST_CAP words each");

// One batch of the sampled pass: buffers the batch's elements with key >= tau (fast: from the raw-bit test)
// with their keys at the end of the buffer, and keeps the largest buffered key in mx. ANY_ORDER: slots
// reserved per warp (no barrier; the counter is sm.ctl[4]); else in index order through one block scan (the
// counter is run). Returns whether the buffer still holds every element so far (warp-uniform, resp.
// CTA-uniform).
template <int U, bool ANY_ORDER, class Src>
__device__ __forceinline__ bool sampled_batch(Smem& sm, const Src& src, const Raw (&cur)[U], int base, bool fast,
                                              uint32_t tau, int& par, uint32_t& run, uint32_t& mx) {
  static_assert(U * THREADS * Src::E < 65536, "batch counts");
  uint32_t* candK = sm.region;
  uint32_t* candI = sm.region + CAND_CAP;
  uint32_t key[U][Src::E];
  uint32_t mask[U], cnt[U];
  if constexpr (Src::KIND == DENSE) {
    if (fast) {
      const float tf = __uint_as_float(tau & 0x7fffffffu);  // the positive score whose key is tau
#pragma unroll
      for (int u = 0; u < U; ++u) mask[u] = src.pos_mask(cur[u], tf);
    }
  }
  if (!fast) {
    batch_keys<U>(src, cur, base, key);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      mask[u] = 0u;
#pragma unroll
      for (int jj = 0; jj < Src::E; ++jj) mask[u] |= (uint32_t)(key[u][jj] >= tau) << jj;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) cnt[u] = (uint32_t)__popc(mask[u]);
  uint32_t o[U];
  bool go_on;
  if constexpr (ANY_ORDER) {
    uint32_t all = 0u, after;
#pragma unroll
    for (int u = 0; u < U; ++u) all += cnt[u];
    o[0] = warp_reserve(&sm.ctl[4], all, &after);
#pragma unroll
    for (int u = 1; u < U; ++u) o[u] = o[u - 1] + cnt[u - 1];
    go_on = after <= (uint32_t)CAND_CAP;
  } else {
    uint32_t ex[U], tot;
    block_excl_scan_small<U, Src::E>(cnt, ex, &tot, sm.scan[par]);
    par ^= 1;
#pragma unroll
    for (int u = 0; u < U; ++u) o[u] = run + ex[u];
    run += tot;
    go_on = run <= (uint32_t)CAND_CAP;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (mask[u] == 0u) continue;
    const int c = base + u * THREADS + (int)threadIdx.x;
    uint32_t oo = o[u];
    if (fast) {  // a loop over the set bits only (about 3% of elements)
      if constexpr (Src::KIND == DENSE) {
        uint32_t mk = mask[u];
        while (mk != 0u) {
          const int jj = __ffs((int)mk) - 1;
          mk &= mk - 1u;
          const uint32_t kv = src.pos_key_in(cur[u], jj);
          mx = kv > mx ? kv : mx;
          if (oo < (uint32_t)CAND_CAP) {
            candK[oo] = kv;
            candI[oo] = (uint32_t)src.index(c, jj);
          }
          ++oo;
        }
      }
    } else {  // static indices: key[][] stays in registers
#pragma unroll
      for (int jj = 0; jj < Src::E; ++jj) {
        if (((mask[u] >> jj) & 1u) == 0u) continue;
        mx = key[u][jj] > mx ? key[u][jj] : mx;
        if (oo < (uint32_t)CAND_CAP) {
          candK[oo] = key[u][jj];
          candI[oo] = (uint32_t)src.index(c, jj);
        }
        ++oo;
      }
    }
  }
  return go_on;
}

// sampled_mode for one CTA per row, and for a split CTA (topk_split_kernel below): its slice, rank and cluster size.
struct NoSplit {
  static constexpr bool ON = false;
};
template <class Slice>
struct SplitPart {
  static constexpr bool ON = true;
  Slice slice;  // the CTA's columns (its index() gives the row's columns)
  int q, C;
};
template <class Src, class Split>
__device__ __forceinline__ const auto& pass_src(const Src& src, const Split& sp) {
  if constexpr (Split::ON)
    return sp.slice;
  else
    return src;
}

// After a split CTA's pass (cnt: what it buffered, counted past CAND_CAP where it stopped; ctl[6]: its largest
// key): the CTAs exchange their counts, and where the union is usable (every buffer complete, kk <= total <=
// CAND_CAP) each pushes its buffer into rank 0's, after the buffers of the ranks before it (remote stores: no CTA
// waits on another's loads), in rank order, so the union is in index order wherever each buffer is; rank 0's
// ctl[6] becomes the union's largest key. Every CTA reads the same counts, so every CTA decides the same; every
// CTA must call it. Returns, in rank 0, the union's count (CAND_CAP + 1 where it is not usable). Ends with the
// cluster barrier after which no CTA touches another's shared memory.
__device__ uint32_t split_union(Smem& sm, uint32_t cnt, int kk, int q, int C) {
  if (threadIdx.x == 0) sm.ctl[5] = cnt;
  tsi_cluster_sync();
  uint32_t total = 0u, base = 0u;
  bool ok = true;
  for (int r = 0; r < C; ++r) {
    const uint32_t c = *tsi_cluster_map(&sm.ctl[5], (unsigned)r);
    ok = ok && c <= (uint32_t)CAND_CAP;
    const uint32_t cc = c <= (uint32_t)CAND_CAP ? c : (uint32_t)CAND_CAP + 1u;
    if (r < q) base += cc;
    total += cc;
  }
  ok = ok && total >= (uint32_t)kk && total <= (uint32_t)CAND_CAP;
  uint32_t* candK = sm.region;
  uint32_t* candI = sm.region + CAND_CAP;
  if (ok && q != 0) {
    uint32_t* dk = tsi_cluster_map(candK, 0u) + base;
    uint32_t* di = tsi_cluster_map(candI, 0u) + base;
    for (uint32_t i = threadIdx.x; i < cnt; i += THREADS) {
      dk[i] = candK[i];
      di[i] = candI[i];
    }
  }
  if (q == 0) {
    uint32_t mx = 0u;
    for (int r = 0; r < C; ++r) {
      const uint32_t m = *tsi_cluster_map(&sm.ctl[6], (unsigned)r);
      mx = m > mx ? m : mx;
    }
    __syncthreads();  // every thread has read ctl[6] before thread 0 rewrites it
    if (threadIdx.x == 0) sm.ctl[6] = mx;
  }
  tsi_cluster_sync();  // the last access to another CTA's shared memory: CTAs may exit after this
  return ok ? total : (uint32_t)CAND_CAP + 1u;
}

template <int U, int UB, class Src, class Split = NoSplit>
__device__ bool sampled_mode(Smem& sm, const Src& src, int* out, int kk, int prefetch_bytes,
                             const Split& sp = Split()) {
  static_assert(U * THREADS * Src::E < 65536, "batch counts");
  using S = Sample<Src>;
  const int n = src.items();
  const int ntiles = (n + THREADS - 1) / THREADS;
  if (ntiles < 2 * S::TILES) return false;
  uint32_t* candK = sm.region;
  uint32_t* candI = sm.region + CAND_CAP;
  uint32_t* G = sm.region + 2 * CAND_CAP;
  uint32_t* Q = G + LIST_CAP;
  TSI_MARK(0);
  clear_hist(sm);
  if (threadIdx.x == 0) sm.ctl[4] = 0u;
  __syncthreads();
  // The sample's keys, compacted in any order (only their histograms are used), and their top digit's histogram.
  Raw raw[S::TILES];  // every tile's load in flight before the first is used
#pragma unroll
  for (int s = 0; s < S::TILES; ++s)
    raw[s] = src.load((int)(((2LL * s + 1) * ntiles) / (2 * S::TILES)) * THREADS + (int)threadIdx.x);
  // The head of the row, on its way to L2 while the sample and its threshold take their few microseconds (HBM
  // otherwise idle then, at one row per SM): the pass starts on it. (Prefetching ahead of the pass all along,
  // one or more 64 KB batches ahead, was slower: NOTES.md, run 76.)
  if constexpr (Split::ON)
    sp.slice.ch.prefetch_l2(prefetch_bytes);  // (a split CTA's pass starts on its slice)
  else if constexpr (Src::KIND == DENSE)
    src.ch.prefetch_l2(prefetch_bytes);
#pragma unroll
  for (int s = 0; s < S::TILES; ++s) {
    const int c = (int)(((2LL * s + 1) * ntiles) / (2 * S::TILES)) * THREADS + (int)threadIdx.x;
    uint32_t key[Src::E];
    src.elems(raw[s], c, key);  // warp-collective: every thread calls it
#pragma unroll
    for (int j = 0; j < Src::E; ++j) key[j] = (int)threadIdx.x < S::ITEMS ? key[j] : 0u;
    append_nonzero<Src::E>(candK, &sm.ctl[4], key);
    hist_keys<Src::E>(sm, key, 0, 0u);
  }
  __syncthreads();
  TSI_MARK(1);
  const int sv = (int)sm.ctl[4];
  // The sample rank whose expected count over the row is T (the sample is TILES * ITEMS of n items).
  int j = (target_count(kk, CAND_CAP) * (S::TILES * S::ITEMS) + n - 1) / n;
  j = j < 1 ? 1 : j;
  if (j > sv) return false;
  const uint32_t tau = sample_tau(sm, candK, sv, (uint32_t)j);
  TSI_MARK(25);
  if constexpr (TSI_TOPK_STOP == 1) return true;
  // Dense rows and a positive threshold (the common case): the cheap bit test of DenseSrc::pos_mask, keys
  // computed only for the elements that pass (a loop over the set bits: about 3% of them). Other rows and
  // thresholds: keys computed for every element, as in stream_mode. (Buffering positions only and reading
  // their keys back after the pass cost a quarter more DRAM traffic: 32-byte sectors for 4-byte keys, mostly
  // evicted from L2 by then.)
  bool fast = false;
  if constexpr (Src::KIND == DENSE) fast = tau > 0x80000000u;
  const bool bitmap = src.m <= BITMAP_ELEMS;
  const int W = (src.m + 31) >> 5;
  if (threadIdx.x == 0) sm.ctl[4] = sm.ctl[6] = 0u;
  if (bitmap)
    for (int w = threadIdx.x; w < W; w += THREADS) G[w] = Q[w] = 0u;
  __syncthreads();
  TSI_MARK(2);
  int par = 0;
  uint32_t run = 0u, mx = 0u;  // mx: the largest key buffered by this thread
  const auto& ps = pass_src(src, sp);  // the row, or a split CTA's slice
  if (bitmap) {
    stream_while<UB, false>(ps, [&](const Raw (&cur)[UB], int base) {
      return sampled_batch<UB, true>(sm, ps, cur, base, fast, tau, par, run, mx);
    });
  } else {
    stream_while<U, false>(ps, [&](const Raw (&cur)[U], int base) {
      return sampled_batch<U, false>(sm, ps, cur, base, fast, tau, par, run, mx);
    });
  }
  mx = __reduce_max_sync(FULL, mx);  // the pass stops warp-uniformly
  if ((threadIdx.x & 31) == 0 && mx != 0u) atomicMax(&sm.ctl[6], mx);
  __syncthreads();
  TSI_MARK(3);
  if constexpr (TSI_TOPK_STOP == 2) return true;
  uint32_t cnt = bitmap ? sm.ctl[4] : run;
  if constexpr (Split::ON) {
    cnt = split_union(sm, cnt, kk, sp.q, sp.C);
    if (sp.q != 0) return true;
  }
  if (cnt < (uint32_t)kk || cnt > (uint32_t)CAND_CAP) return false;
  const int c = (int)cnt;
  // Every buffered key lies in [tau, the largest]: a radix select on that range (sample_tau left hist zero).
  // (Counting the first digit in the pass instead, over bins sized to the sample's range, made the pass spill
  // and run 3x slower: NOTES.md, run 77.)
  const Marks mk{candI, G, Q};
  const Thresh t = buffer_resolve(sm, candK, c, tau, sm.ctl[6], (uint32_t)kk, bitmap ? &mk : nullptr);
  __syncthreads();
  TSI_MARK(4);
  if constexpr (TSI_TOPK_STOP == 3) return true;
  if (bitmap) {
    if (!t.marked) mark_selected(G, Q, candK, candI, c, t);
    TSI_MARK(5);
    bitmap_emit<(LIST_CAP + THREADS - 1) / THREADS>(sm, G, Q, W, t.need_eq,
                                                   [&](uint32_t rank, int i) { out[rank] = src.pos(i); });
  } else {
    smem_select(sm, par, candK, c, t, [&](uint32_t rank, int i) { out[rank] = src.pos((int)candI[i]); });
  }
  TSI_MARK(6);
  return true;
}

// The exact selection without a buffer: the row is rescanned from global memory, each finer digit's histogram
// filtered by the fixed key prefix, then one ordered pass writes the output. For rows whose threshold bin (B1 of
// the top digit, c1 elements, need1 of them taken) is larger than any buffer (massive ties). hist is zero
// (find_bin leaves it so); the row has more than k elements.
template <int U, class Src>
__device__ void rescan_select(Smem& sm, int& par, const Src& src, int* out, uint32_t B1, uint32_t need1,
                              uint32_t c1) {
  Thresh t;
  if (c1 == need1) {  // the whole bin taken: select everything from it up
    t.tkey = (B1 << 21) > 1u ? (B1 << 21) - 1u : 0u;
    t.need_eq = 0u;
  } else {
    auto next_hist = [&](int L, uint32_t P) {
      __syncthreads();
      clear_hist(sm);
      __syncthreads();
      global_hist<U>(sm, src, L, P);
      __syncthreads();
    };
    next_hist(11, B1);
    t = resolve(sm, 11, B1, need1, next_hist);
  }
  __syncthreads();
  final_global<U>(sm, par, src, t, out);
}

template <int U, class Src>
__device__ void stream_mode(Smem& sm, const Src& src, int* out, int kk) {
  static_assert(U * THREADS * Src::E < 65536, "packed batch counts");
  int par = 0;
  clear_hist(sm);
  __syncthreads();
  global_hist<U>(sm, src, 0, 0u);
  __syncthreads();
  find_bin<NBINS>(sm, (uint32_t)kk);
  const uint32_t total = sm.ctl[3];
  if (total <= (uint32_t)kk) {
    Thresh t;
    t.tkey = 0u;
    t.need_eq = 0u;
    final_global<U>(sm, par, src, t, out);
    pad_out(out, (int)total, kk);
    return;
  }
  const uint32_t B1 = sm.ctl[0], above1 = sm.ctl[1], c1 = sm.ctl[2];
  const uint32_t need1 = (uint32_t)kk - above1;
  Thresh whole_bin;  // the whole threshold bin is taken: no refinement needed
  whole_bin.tkey = (B1 << 21) > 1u ? (B1 << 21) - 1u : 0u;
  whole_bin.need_eq = 0u;
  if (c1 > (uint32_t)CAND_CAP) {  // the threshold bin overflows the buffer
    rescan_select<U>(sm, par, src, out, B1, need1, c1);
    return;
  }
  // Collect, in index order: ABOVE = elements of bins > B1, CAND = elements of bin B1 (with keys).
  uint32_t* candK = sm.region;
  uint32_t* candI = sm.region + CAND_CAP;
  uint32_t* above = sm.region + 2 * CAND_CAP;
  uint32_t* sel = above + LIST_CAP;
  {
    uint32_t sa = 0, sc = 0;  // counts in batches after the current one (reverse walk)
    stream<U, true>(src, [&](const Raw (&cur)[U], int base) {
      uint32_t key[U][Src::E];
      batch_keys<U>(src, cur, base, key);
      uint32_t cnt[U], ex[U], tot;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        uint32_t na = 0u, nc = 0u;
#pragma unroll
        for (int j = 0; j < Src::E; ++j) {
          const uint32_t d = key[u][j] >> 21;
          na += key[u][j] != 0u && d > B1;
          nc += key[u][j] != 0u && d == B1;
        }
        cnt[u] = (na << 16) | nc;
      }
      block_excl_scan_multi<U>(cnt, ex, &tot, sm.scan[par]);
      par ^= 1;
      const uint32_t ta = tot >> 16, tc = tot & 0xffffu;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (cnt[u] == 0u) continue;
        const int c = base + u * THREADS + (int)threadIdx.x;
        uint32_t oa = above1 - sa - ta + (ex[u] >> 16);
        uint32_t oc = c1 - sc - tc + (ex[u] & 0xffffu);
#pragma unroll
        for (int j = 0; j < Src::E; ++j) {
          if (key[u][j] == 0u) continue;
          const uint32_t d = key[u][j] >> 21;
          if (d > B1) {
            above[oa++] = (uint32_t)src.index(c, j);
          } else if (d == B1) {
            candK[oc] = key[u][j];
            candI[oc] = (uint32_t)src.index(c, j);
            ++oc;
          }
        }
      }
      sa += ta;
      sc += tc;
    });
  }
  __syncthreads();
  // Refine inside the buffer.
  Thresh t = whole_bin;
  if (c1 != need1) {
    smem_hist(sm, candK, (int)c1, 11, B1);
    t = resolve(sm, 11, B1, need1, [&](int L, uint32_t P) { smem_hist(sm, candK, (int)c1, L, P); }, false, candK,
                (int)c1);
  }
  __syncthreads();
  smem_select(sm, par, candK, (int)c1, t, [&](uint32_t rank, int i) { sel[rank] = candI[i]; });
  __syncthreads();
  // Merge the two index-sorted lists (indices are distinct) into the output.
  const int na = (int)above1, ns = (int)need1;
  for (int i = threadIdx.x; i < na; i += THREADS) {
    const uint32_t a = above[i];
    out[i + lower_bound(sel, ns, a)] = src.pos((int)a);
  }
  for (int i = threadIdx.x; i < ns; i += THREADS) {
    const uint32_t v = sel[i];
    out[i + lower_bound(above, na, v)] = src.pos((int)v);
  }
}

// sparse_topk promises positions in ascending order. Columns are selected and written in column order,
// which is position order exactly when the row's valid block ids ascend (the contract); for a row whose
// candidate list does not (out of contract), the written prefix is sorted here (bitonic, in shared
// memory; k <= LIST_CAP <= REGION_WORDS), so the output is ascending for every input.
__device__ void sort_positions_if_unordered(Smem& sm, int* out, int kk) {
  uint32_t* v = sm.region;
  __syncthreads();  // orders this block's global writes of out[] before the reads below
  for (int i = threadIdx.x; i < kk; i += THREADS) {
    const int x = out[i];
    v[i] = x < 0 ? NONE : (uint32_t)x;
  }
  if (!sort_if_unordered(sm, v, kk)) return;
  for (int i = threadIdx.x; i < kk; i += THREADS) out[i] = v[i] == NONE ? -1 : (int)v[i];
}

// ------------------------------------------------------------------------------------------------
// Cluster mode: dense rows of SMEM_KEYS < width <= CLUSTER_MAX * SMEM_KEYS columns. The C CTAs of a
// cluster each hold one slice of S columns of the row in shared memory (so the row is read once, by C
// SMs instead of one); at every refinement level the slices' histograms are summed through distributed
// shared memory, so every CTA resolves the same threshold; then each CTA writes its slice's winners at
// the offset the slices before it take (ties to the lowest positions: a slice takes the ties the slices
// before it left). Dynamic shared memory: the Smem header, K[S], and a histogram sum buffer.
// ------------------------------------------------------------------------------------------------

constexpr int CLUSTER_MAX = 8;  // the portable cluster size

// Makes sm.hist the sum of the cluster's histograms (gsum: NBINS words of scratch). Every CTA of the
// cluster must call it; it starts and ends with barriers, and no CTA touches its own histogram before
// every CTA has finished reading it.
__device__ void cluster_hist_sum(Smem& sm, uint32_t* gsum, int C) {
  tsi_cluster_sync();
  for (int b = threadIdx.x; b < NBINS; b += THREADS) {
    uint32_t v = 0u;
    for (int q = 0; q < C; ++q) v += tsi_cluster_map(sm.hist, (unsigned)q)[b];
    gsum[b] = v;
  }
  tsi_cluster_sync();
  for (int b = threadIdx.x; b < NBINS; b += THREADS) sm.hist[b] = gsum[b];
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(THREADS, 2) topk_cluster_kernel(Params p, int S, int C) {
  using Src = DenseSrc<T>;
  constexpr int U = TSI_U2 / (Src::E == 8 ? 2 : 1);
  TSI_DYN_SMEM(smem_raw);
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int q = (int)tsi_cluster_rank();
  const int row = (int)blockIdx.x / C;
  int* out = p.out + (long long)row * p.kk;
  const int kk = p.kk;
  const int n = Src::valid(p, row);
  if (n <= kk) {  // every valid position, no read needed (the same branch in every CTA of the cluster)
    if (q == 0)
      for (int i = threadIdx.x; i < kk; i += THREADS) out[i] = i < n ? i : -1;
    return;
  }
  Src src(p, row, q, S);
  uint32_t* K = sm.region;
  uint32_t* gsum = sm.region + S;
  keys_to_smem<U>(sm, src, K);
  cluster_hist_sum(sm, gsum, C);
  find_bin<NBINS>(sm, (uint32_t)kk);
  const uint32_t total = sm.ctl[3];
  Thresh t;
  t.tkey = 0u;
  t.need_eq = 0u;
  if (total > (uint32_t)kk)
    t = resolve(
        sm, 0, 0u, (uint32_t)kk,
        [&](int L, uint32_t P) {
          smem_hist(sm, K, round32(src.m), L, P);
          cluster_hist_sum(sm, gsum, C);
        },
        true);
  // This slice's counts above the threshold and equal to it, published for the other CTAs.
  uint32_t ngt = 0u, neq = 0u;
  for (int i = threadIdx.x; i < round32(src.m); i += THREADS) {  // K's layout: any order, zeros never count
    ngt += is_gt(K[i], t);
    neq += is_eq(K[i], t);
  }
  uint32_t tot;
  block_excl_scan((ngt << 16) | neq, sm.scan[0], &tot);  // slice counts < 2^16 (S <= SMEM_KEYS)
  if (threadIdx.x == 0) {
    sm.ctl[5] = tot >> 16;
    sm.ctl[6] = tot & 0xffffu;
  }
  tsi_cluster_sync();
  uint32_t base = 0u, eq_before = 0u;
  Thresh mine = t;
  for (int r = 0; r < C; ++r) {
    const uint32_t gt_r = *tsi_cluster_map(&sm.ctl[5], (unsigned)r);
    const uint32_t eq_r = *tsi_cluster_map(&sm.ctl[6], (unsigned)r);
    const uint32_t left = t.need_eq > eq_before ? t.need_eq - eq_before : 0u;
    const uint32_t take = left < eq_r ? left : eq_r;
    if (r < q) base += gt_r + take;
    if (r == q) mine.need_eq = take;
    eq_before += eq_r;
  }
  tsi_cluster_sync();  // the last access to another CTA's shared memory: CTAs may exit after this
  int par = 1;
  smem_select<true>(sm, par, K, src.m, mine, [&](uint32_t rank, int i) { out[base + rank] = src.pos(i); });
  if (q == 0) pad_out(out, total < (uint32_t)kk ? (int)total : kk, kk);
}

// MINB = 1: 128 registers, 4 fp32 tiles of loads in flight per thread (few rows: one CTA per SM must
// keep enough bytes in flight). MINB = 2: two CTAs per SM (64 registers, 2 tiles in flight), so one
// CTA's shared-memory phases overlap the other's streaming.
template <class Src, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) topk_kernel(Params p) {
  // bf16 items carry 8 keys: half as many tiles per batch keeps them in registers.
  constexpr int U = (MINB == 1 ? TSI_U1 : TSI_U2) / (Src::E == 8 ? 2 : 1);
  constexpr int UB0 = MINB == 1 ? TSI_UB1 : TSI_UB2;
  constexpr int UB = Src::E == 8 ? (UB0 + 1) / 2 : UB0;  // no scan: more in flight
  static_assert(U <= MAX_U, "scan scratch");
  TSI_DYN_SMEM(smem_raw);
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  TSI_SPAN;
  const int row = blockIdx.x;
  Src src(p, row);
  int* out = p.out + (long long)row * p.kk;
  const int kk = p.kk;
  if (dense_all_valid(src, out, kk)) return;
  if (src.m <= SMEM_KEYS) {
    smem_mode<U>(sm, src, out, kk);  // sorts a sparse row's staged output itself
    return;
  }
  if (!(p.sampled && sampled_mode<U, UB>(sm, src, out, kk, p.prefetch_bytes))) {
    __syncthreads();
    stream_mode<U>(sm, src, out, kk);
  }
  if (Src::KIND == SPARSE) sort_positions_if_unordered(sm, out, kk);
}

// ------------------------------------------------------------------------------------------------
// Split mode: dense rows streamed by a cluster of C CTAs, for batches of fewer rows than SMs (one CTA per row
// reads its row at one SM's pace, ~36 GB/s, while most SMs idle). Every CTA takes the same sample of the whole row
// (the same keys, so the same tau: no exchange needed), then streams its slice of S columns, buffering the elements
// with key >= tau as sampled_mode does. The CTAs then push their buffers after rank 0's own through distributed
// shared memory (in rank order: split_union), and rank 0 runs sampled_mode's selection on the union: every element
// of the row with key >= tau, so it is exact whenever kk <= total <= CAND_CAP, as in sampled_mode. (Buffers in any
// order where the row has at most BITMAP_ELEMS columns; else each slice's buffer is in index order, so the union in
// rank order is too.) Otherwise, and for rows that do not sample (short valid lengths, two-pass mode), rank 0
// selects the whole row alone on the one-CTA paths. Every branch before the first cluster barrier depends only on
// the row's data, identically in every CTA, and every CTA that passes it reaches both barriers.
// ------------------------------------------------------------------------------------------------

// A slice of the row whose buffered element indices are the row's columns (DenseSrc's index() is the slice's).
template <typename T>
struct DenseSliceSrc : DenseSrc<T> {
  __device__ DenseSliceSrc(const Params& p, int r, int q, int S) : DenseSrc<T>(p, r, q, S) {}
  __device__ __forceinline__ int index(int c, int j) const { return this->off + DenseSrc<T>::index(c, j); }
};

template <typename T>
__global__ void __launch_bounds__(THREADS, 1) topk_split_kernel(Params p, int S, int C) {
  using Src = DenseSrc<T>;
  constexpr int U = TSI_U1 / (Src::E == 8 ? 2 : 1);
  constexpr int UB = Src::E == 8 ? (TSI_UB1 + 1) / 2 : TSI_UB1;
  TSI_DYN_SMEM(smem_raw);
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int q = (int)tsi_cluster_rank();
  const int row = (int)blockIdx.x / C;
  const Src src(p, row);  // the whole row: the sample, and rank 0's selection
  int* out = p.out + (long long)row * p.kk;
  const int kk = p.kk;
  if (src.m > kk && src.m > SMEM_KEYS && p.sampled &&
      sampled_mode<U, UB>(sm, src, out, kk, p.prefetch_bytes,
                          SplitPart<DenseSliceSrc<T>>{DenseSliceSrc<T>(p, row, q, S), q, C}))
    return;
  if (q != 0) return;  // (every CTA returned false before the first cluster barrier, or rank 0 after the last)
  if (dense_all_valid(src, out, kk)) return;
  if (src.m <= SMEM_KEYS) {
    smem_mode<U>(sm, src, out, kk);
    return;
  }
  __syncthreads();
  stream_mode<U>(sm, src, out, kk);
}

// ------------------------------------------------------------------------------------------------
// Three CTAs per SM: shared-memory rows with 16-bit keys (topk_tri_kernel)
// ------------------------------------------------------------------------------------------------
// Batches of fp32 or bf16 rows of at most SMEM_KEYS columns (16-byte aligned, k <= TRI_LIST; the host picks this
// kernel). topk_kernel holds such a row as 32-bit keys (~107 KB per CTA: two CTAs per SM), and its kernel time
// follows the CTA time per row, of which the selection after the load is more than half (NOTES.md, run 92): a third
// CTA per SM overlaps more of those latency-bound phases. Here an fp32 row is copied raw by cp.async into the region
// (SMEM_KEYS words: exactly one row) and converted in place, round by round, to 16-bit keys (the top half of each
// 32-bit key) in the region's first half; a bf16 row lands there directly (its 16-bit keys are its whole keys). The
// second half then holds the staged output, the bitmaps and the threshold bin's buffer (~73 KB per CTA in all). The
// top digit (11 bits) comes from the 16-bit keys, exactly; an fp32 row's threshold bin has its full keys read again
// from global memory (the row was just read: L2), and the rest is smem_bitmap_select's. Threshold bins larger than
// the buffer (massive ties) are resolved by rescanning the row (rescan_select).
constexpr int TRI_K16_WORDS = SMEM_KEYS / 2;  // the 16-bit keys
constexpr int TRI_LIST = SMEM_KEYS / 8;        // the largest k (2048 with SMEM_KEYS = 16384)
constexpr int TRI_BIN = (SMEM_KEYS - TRI_K16_WORDS - TRI_LIST - 2 * SMEM_WORDS) / 2 & ~3;  // bin buffer entries
constexpr int TRI_MINB = 3;                    // CTAs per SM the kernel is built for

// 16-bit key of fp32 bits b: the top half of f32_key(b), NaN (key 1) kept apart from "no element" (0) as 1. Its
// top 11 bits are the key's (k16 >> 5 == key >> 21). Key i lives in 16-byte group kgroup(i >> 3) of K16 (thread
// t's sweep reads groups 4t .. 4t + 3: eight lanes meet eight different bank groups).
__device__ __forceinline__ uint32_t f32_key16(uint32_t b) {
  const float x = __uint_as_float(b) + 0.0f;
  b = __float_as_uint(x);
  const uint32_t k = b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
  return x != x ? 1u : k >> 16;
}
__device__ __forceinline__ int k16_slot(int i) { return (kgroup(i >> 3) << 3) | (i & 7); }

// cp_async_wait<n> for a run-time n < 8 (the rounds of tri_load).
__device__ __forceinline__ void cp_async_wait_n(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

// One read of the row into 16-bit keys K16[0, m) (the layout of k16_slot), zeros in K16[m, m rounded up to 32),
// the coarse histogram to sm.hist, ctl[4] = 0. fp32: round u converts chunk u * THREADS + tid (4 scores) of the raw
// copy to its four 16-bit keys, stored over raw chunk (u * THREADS + tid) / 2: a chunk of round u / 2, which every
// thread read before that round's barrier (for u = 0, this round's). bf16: a chunk (8 scores) is copied to its own
// keys' slots and each thread converts its own chunks in place. A sparse row's candidate block ids are loaded into
// registers first (their DRAM latency overlaps the copies); after the conversion each thread takes the invalid
// columns of its own blocks out again. Ends with a barrier.
template <class Src>
__device__ void tri_load(Smem& sm, const Src& src, uint16_t* K16) {
  constexpr bool F32 = Src::E == 4;  // else bf16: 8 scores per chunk, already 16-bit keys' size
  static_assert(Src::E == 4 || Src::E == 8, "fp32 or bf16 chunks");
  constexpr int NU = SMEM_KEYS / Src::E / THREADS;  // rounds: one chunk per thread each
  static_assert(NU >= 1 && NU <= 8 && SMEM_KEYS % (Src::E * THREADS) == 0, "at most 8 commit groups");
  constexpr int NBT = (SMEM_KEYS / 8 + THREADS - 1) / THREADS;  // candidate blocks per thread (blocks of >= 8)
  const int m = src.m, nfull = m / Src::E, tid = (int)threadIdx.x;
  int ids[NBT];
  if constexpr (Src::KIND == SPARSE) {
#pragma unroll
    for (int j = 0; j < NBT; ++j) {
      const int b = j * THREADS + tid;
      ids[j] = b < ((m + src.cbs - 1) >> src.lcbs) ? __ldg(src.blk + b) : -1;
    }
  }
  // fp32: chunk c lands raw at words [4c, 4c + 4); bf16: at its keys' own 16-byte group, converted in place.
  uint32_t* raw = sm.region;
  auto slot = [&](int c) { return F32 ? raw + 4 * c : reinterpret_cast<uint32_t*>(K16 + 8 * kgroup(c)); };
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    const int c = u * THREADS + tid;
    if (c < nfull) cp_async<16>(slot(c), src.ch.abase + (long long)c * 16);
    cp_async_commit();
  }
  clear_hist(sm);
  if (tid == 0) sm.ctl[4] = 0u;
  __syncthreads();  // the histogram is clear before the counts
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    const int c = u * THREADS + tid;
    const bool have = c < nfull;
    cp_async_wait_n(NU - 1 - u);
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (have) v = *reinterpret_cast<const uint4*>(slot(c));
    if constexpr (F32) {
      const uint32_t k0 = f32_key16(v.x), k1 = f32_key16(v.y), k2 = f32_key16(v.z), k3 = f32_key16(v.w);
      if (have) {
        atomicAdd(&sm.hist[k0 >> 5], 1u);
        atomicAdd(&sm.hist[k1 >> 5], 1u);
        atomicAdd(&sm.hist[k2 >> 5], 1u);
        atomicAdd(&sm.hist[k3 >> 5], 1u);
      }
      // Round r's raw chunks take the stores of rounds 2r and 2r + 1: every thread reads them before any of those
      // stores. Rounds past the first half are never stored over (their reads need no barrier).
      if (u < (NU + 1) / 2) __syncthreads();
      if (have) {
        uint2 w;
        w.x = k0 | (k1 << 16);
        w.y = k2 | (k3 << 16);
        *reinterpret_cast<uint2*>(K16 + k16_slot(4 * c)) = w;
      }
    } else if (have) {  // each thread's own chunk, in place: no barrier
      uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t lo = f32_key16(w[q] << 16), hi = f32_key16(w[q] & 0xffff0000u);
        atomicAdd(&sm.hist[lo >> 5], 1u);
        atomicAdd(&sm.hist[hi >> 5], 1u);
        w[q] = lo | (hi << 16);
      }
      *reinterpret_cast<uint4*>(slot(c)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  __syncthreads();
  if constexpr (Src::KIND == DENSE) {
    if (tid == 0)
      for (int i = Src::E * nfull; i < m; ++i) {  // the partial last chunk
        const uint32_t bits = DT<typename Src::Elem>::load1(src.ch.row, i);
        const uint32_t k = f32_key16(F32 ? bits : bits << 16);
        K16[k16_slot(i)] = (uint16_t)k;
        atomicAdd(&sm.hist[k >> 5], 1u);
      }
  }
  for (int i = m + tid; i < round32(m); i += THREADS) K16[k16_slot(i)] = 0;
  if constexpr (Src::KIND == SPARSE) {  // m = nblk * cbs: no partial chunk
    DecRuns dec;
#pragma unroll
    for (int j = 0; j < NBT; ++j) {
      const int b = j * THREADS + tid;
      const int v = src.valid_in(ids[j]);  // 0 for the -1 ids past the row's blocks: their loop is empty
      const int end = (b + 1) << src.lcbs < m ? (b + 1) << src.lcbs : m;
      for (int i = (b << src.lcbs) + v; i < end; ++i) {
        uint16_t& k = K16[k16_slot(i)];
        dec.add(sm, k >> 5);
        k = 0;
      }
    }
    dec.flush(sm);
  }
  __syncthreads();
}

// The threshold bin of a tri_load row: the 16-bit keys [lo, hi] hold c elements, of which the need best are taken
// (1 <= need <= c <= TRI_BIN); every key above hi is taken. Either a bin of the top digit (11 bits, hi = lo + 31)
// or, within one too large for the buffer, a bin of all 16 bits (fine: lo = hi).
struct TriBin {
  uint32_t lo, hi, need, c;
  bool fine;
};

// Histogram of the low 5 bits of the 16-bit keys in the top-digit bin B (the 16-bit bins inside it), from the zero
// histogram find_bin leaves, over keys [0, m rounded up to 32): their 16-byte groups through kgroup (it permutes
// groups of 8 keys within 64, so unlike K's groups these are not in place within each 32 keys). Ends with a barrier.
__device__ void tri_hist16(Smem& sm, const uint16_t* K16, int m, uint32_t B) {
  const uint4* g = reinterpret_cast<const uint4*>(K16);
  for (int v = threadIdx.x; v < round32(m) / 8; v += THREADS) {
    const uint4 q = g[kgroup(v)];
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t x = (j & 1) ? w[j >> 1] >> 16 : w[j >> 1] & 0xffffu;
      hist_inc(sm, x & 31u, x != 0u && (x >> 5) == B);
    }
  }
  __syncthreads();
}

// The selection of a tri_load row: the k best of its m keys as ranks in index order, emit(rank, index), through
// the bitmaps of smem_bitmap_select. all: every element is taken (total <= k); else the threshold bin tb. Ends
// without a barrier.
template <class Src, class Emit>
__device__ void tri_bitmap_select(Smem& sm, const Src& src, const uint16_t* K16, int m, const TriBin& tb, bool all,
                                  Emit&& emit) {
  uint32_t* G = sm.region + TRI_K16_WORDS + TRI_LIST;  // past the staged output
  uint32_t* Q = G + SMEM_WORDS;
  uint32_t* BK = Q + SMEM_WORDS;
  uint32_t* BI = BK + TRI_BIN;
  const uint32_t c = tb.c, need = tb.need;  // (used past the all return only)
  const int W = (m + 31) >> 5;
  const int tid = (int)threadIdx.x;
  uint32_t gw = 0u, bm = 0u;
  if (tid < W) {
    uint32_t k[16];  // 32 keys, two per word
    load_kgroups<4>(reinterpret_cast<const uint32_t*>(K16), 4 * tid, k);
    // Key j compared in the high half of a word, with no extraction: the odd keys as they are, the even ones
    // shifted up; key > hi <=> word > (hi << 16 | 0xffff), key < lo <=> word < lo << 16. As in
    // smem_bitmap_select, each bitmap by one kind of test in its own loop; the bin is the rest (key 0, no
    // element, is below every bin: the lowest holds NaN, 16-bit key 1). With all, every key above 0 is taken.
    const uint32_t lo = all ? 0u : tb.lo, hi = all ? 0u : tb.hi;
    const uint32_t HI = hi << 16 | 0xffffu, LO = (lo == 0u ? 1u : lo) << 16;
#pragma unroll
    for (int j = 0; j < 32; ++j) gw |= (uint32_t)(((j & 1) ? k[j >> 1] : k[j >> 1] << 16) > HI) << j;
    if (!all) {
      uint32_t below = 0u;
#pragma unroll
      for (int j = 0; j < 32; ++j) below |= (uint32_t)(((j & 1) ? k[j >> 1] : k[j >> 1] << 16) < LO) << j;
      bm = ~(gw | below);
    }
    G[tid] = gw;
    Q[tid] = 0u;
  }
  if (all) {
    bitmap_emit<1>(sm, G, Q, W, 0u, emit);
    return;
  }
  uint32_t after;
  uint32_t o = warp_reserve(&sm.ctl[4], (uint32_t)__popc(bm), &after);
  while (bm != 0u) {
    const int j = __ffs((int)bm) - 1;
    bm &= bm - 1u;
    BI[o++] = (uint32_t)(32 * tid + j);
  }
  __syncthreads();
  // A top-digit bin's keys are counted by their next digit as they arrive (for resolve); buffer_resolve counts a
  // 16-bit bin's itself.
  const bool count = !tb.fine;
  if constexpr (Src::E == 4) {
    // The bin's full keys from global memory (the row was just read: L2 hits), two loads in flight per thread.
    const uint32_t* row = reinterpret_cast<const uint32_t*>(src.ch.row);
    for (int i = tid; i < (int)c; i += 2 * THREADS) {
      const int i2 = i + THREADS;
      const uint32_t a = __ldg(row + BI[i]);
      const uint32_t b = i2 < (int)c ? __ldg(row + BI[i2]) : 0u;
      const uint32_t ka = f32_key(a);
      BK[i] = ka;
      if (count) atomicAdd(&sm.hist[(ka >> 10) & 0x7ffu], 1u);
      if (i2 < (int)c) {
        const uint32_t kb = f32_key(b);
        BK[i2] = kb;
        if (count) atomicAdd(&sm.hist[(kb >> 10) & 0x7ffu], 1u);
      }
    }
  } else {  // bf16: the 16-bit keys order the scores exactly; k16 << 16 stands for the key (NaN: 1)
    for (int i = tid; i < (int)c; i += THREADS) {
      const uint32_t k = K16[k16_slot((int)BI[i])];
      const uint32_t key = k == 1u ? 1u : k << 16;
      BK[i] = key;
      if (count) atomicAdd(&sm.hist[(key >> 10) & 0x7ffu], 1u);
    }
  }
  __syncthreads();
  TSI_MARK(26);
  const Marks mk{BI, G, Q};
  Thresh t;
  if (tb.fine) {  // every key of the bin lies in [lo << 16, lo << 16 | 0xffff], but NaN's (16-bit key 1) is 1
    const uint32_t lo32 = tb.lo == 1u ? 1u : tb.lo << 16, hi32 = tb.lo == 1u ? 1u : lo32 | 0xffffu;
    t = buffer_resolve(sm, BK, (int)c, lo32, hi32, need, &mk);
  } else {
    t = resolve(sm, 11, tb.lo >> 5, need, [&](int L, uint32_t P) { smem_hist(sm, BK, (int)c, L, P); }, false, BK,
                (int)c, &mk);
  }
  TSI_MARK(13);
  if (!t.marked) mark_selected(G, Q, BK, BI, (int)c, t);
  bitmap_emit<1>(sm, G, Q, W, t.need_eq, emit);
}

template <class Src>
__global__ void __launch_bounds__(THREADS, TRI_MINB) topk_tri_kernel(Params p) {
  static_assert(TRI_K16_WORDS + TRI_LIST + 2 * SMEM_WORDS + 2 * TRI_BIN <= SMEM_KEYS && TRI_BIN >= 32,
                "the selection's buffers fit in the second half of the raw row");
  static_assert(SMEM_WORDS <= THREADS && TRI_LIST <= LIST_CAP && (TRI_LIST & (TRI_LIST - 1)) == 0,
                "one bitmap word per thread; the staged output sorts in place");
  constexpr int U = TSI_U2 / (Src::E == 8 ? 2 : 1);  // the rescan's tiles per batch (bf16 items: 8 keys)
  TSI_DYN_SMEM(smem_raw);
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);  // only region[0, SMEM_KEYS) is allocated (topk.cu: kTriSmem)
  TSI_SPAN;
  const int row = blockIdx.x;
  Src src(p, row);
  int* out = p.out + (long long)row * p.kk;
  const int kk = p.kk;
  if (dense_all_valid(src, out, kk)) return;
  uint16_t* K16 = reinterpret_cast<uint16_t*>(sm.region);
  uint32_t* stage = sm.region + TRI_K16_WORDS;
  TSI_MARK(10);
  tri_load(sm, src, K16);
  TSI_MARK(11);
  find_bin<NBINS>(sm, (uint32_t)kk);
  TSI_MARK(12);
  const uint32_t total = sm.ctl[3], B = sm.ctl[0], need = (uint32_t)kk - sm.ctl[1], c = sm.ctl[2];
  const bool all = total <= (uint32_t)kk;
  TriBin tb{B << 5, B << 5 | 31u, need, c, false};
  if (!all && c > (uint32_t)TRI_BIN && c != need) {
    // Too large for the buffer (and not all taken): the 16-bit bin inside it that holds the threshold, where the
    // 16-bit keys' 5 further bits split it (narrow value ranges, e.g. ReLU-weighted sums); ties need the rescan.
    tri_hist16(sm, K16, src.m, B);
    find_bin<NBINS>(sm, need);
    const uint32_t lo = B << 5 | sm.ctl[0];
    tb = TriBin{lo, lo, need - sm.ctl[1], sm.ctl[2], true};
  }
  if (all || tb.c <= (uint32_t)TRI_BIN) {
    tri_bitmap_select(sm, src, K16, src.m, tb, all, [&](uint32_t rank, int i) { stage[rank] = (uint32_t)i; });
    TSI_MARK(15);
    write_staged(sm, src, stage, all ? (int)total : kk, out, kk);
    TSI_MARK(14);
    return;
  }
  int par = 0;
  rescan_select<U>(sm, par, src, out, B, need, c);
  if (Src::KIND == SPARSE) sort_positions_if_unordered(sm, out, kk);
}

}  // namespace TSI_NS
