// C ABI of libsparse_indexer_topk.so: launch functions over raw device pointers, so one build serves
// every torch version (the Python side passes tensor.data_ptr() and the current stream). Every
// function returns a cudaError_t code (0 = success); nothing synchronizes and nothing allocates, so
// the launches can be captured in CUDA graphs. The launch configuration depends only on the shapes.
#include <cstddef>

#include "topk_kernels.cuh"  // namespace tsi: CTAs of TSI_THREADS (512) threads

// The same kernels for CTAs of TSI_WIDE_THREADS threads (namespace tsi_wide), for streamed dense rows of small
// batches (see g_wide_mode): twice the warps per SM in the pass, each thread with the two-CTA kernel's registers
// and tiles per batch. (Emulation builds pass a smaller TSI_WIDE_THREADS.)
#ifndef TSI_WIDE_THREADS
#define TSI_WIDE_THREADS 1024
#endif
#ifndef TSI_WIDE_UB1  // tiles per batch of the wide kernel's sampled pass (4: 64 KB in flight per CTA)
#define TSI_WIDE_UB1 4
#endif
#undef TSI_NS
#undef TSI_THREADS
#undef TSI_U1
#undef TSI_UB1
#define TSI_NS tsi_wide
#define TSI_THREADS TSI_WIDE_THREADS
#define TSI_U1 2
#define TSI_UB1 TSI_WIDE_UB1
#include "topk_kernels.cuh"

namespace {

using tsi::Params;

constexpr int kVersion = 6;

int log2_exact(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return (1 << l) == v ? l : -1;
}

int sm_count(int dev);

// The head of each dense row that the sampled pass asks L2 for while it computes its threshold (sampled_mode), in
// KB: wave_prefetch_kb(dev) where the launch's rows all run at once (one CTA per SM at most, so HBM is otherwise
// idle then), else TSI_PREFETCH_KB (later rows' passes keep HBM busy, and 264 CTAs' heads must not crowd L2).
#ifndef TSI_PREFETCH_KB
#define TSI_PREFETCH_KB 64
#endif

#ifndef TSI_EMULATE
// A device attribute, or 0 if the query fails (its error cleared, so that it does not surface as the next
// launch's). A property query: capture-safe.
int device_attr(cudaDeviceAttr attr, int dev) {
  int v = 0;
  if (cudaDeviceGetAttribute(&v, attr, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    v = 0;
  }
  return v;
}
#endif

// The one-wave head prefetch in KB: TSI_PREFETCH_WAVE_KB where a build sets it (the prefetch_N variants), else by
// the device's peak HBM bandwidth, because the best size went opposite ways on the two GPUs measured (128 x 128K,
// read flush, NOTES.md): on an H100 (3.35 TB/s; runs 112-114) 256 KB took 36.3-36.6 us against 36.7-37.0 at 64 KB,
// on an H200 (4.9 TB/s; runs 144-145) 64 KB took 31.0-31.1 us against 31.7-31.9 at 256. Under the write flush the
// sizes were within 0.5 us on both. Devices at 4 TB/s or more (including SM100, not measured) take 64 KB.
int wave_prefetch_kb(int dev) {
#ifdef TSI_PREFETCH_WAVE_KB
  (void)dev;
  return TSI_PREFETCH_WAVE_KB;
#elif !defined(TSI_EMULATE)
  static int cache[64] = {0};
  if (cache[dev] == 0) {
    // memory clock (kHz) x bus width (bits) x 2 (double data rate); 0 if a query failed
    const double bytes_per_s = 2.0 * 1e3 * device_attr(cudaDevAttrMemoryClockRate, dev) *
                               device_attr(cudaDevAttrGlobalMemoryBusWidth, dev) / 8;
    cache[dev] = bytes_per_s >= 4e12 ? 64 : 256;
  }
  return cache[dev];
#else
  (void)dev;
  return 256;
#endif
}

// Params::prefetch_bytes for a launch of `ctas` CTAs (one wave if they fit on the SMs at once).
int head_prefetch_bytes(int dev, long long ctas) {
  return 1024 * (ctas <= sm_count(dev) ? wave_prefetch_kb(dev) : TSI_PREFETCH_KB);
}

// Kernel's dynamic shared-memory limit raised to `smem` bytes and, with carveout >= 0, its preferred shared-memory
// carveout set (percent), once per device: not stream operations, so capture-safe. Nothing to set in emulation.
template <auto Kernel>
cudaError_t kernel_attrs(int dev, int smem, int carveout = -1) {
#ifndef TSI_EMULATE
  static bool done[64] = {false};
  if (done[dev]) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess && carveout >= 0)
    e = cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout);
  if (e != cudaSuccess) return e;
  done[dev] = true;
#else
  (void)dev;
  (void)smem;
  (void)carveout;
#endif
  return cudaSuccess;
}

// One CTA of `threads` threads per row, `smem` bytes of dynamic shared memory.
template <auto Kernel, int threads, int smem>
cudaError_t launch_rows(const Params& p_in, cudaStream_t stream, int dev) {
  Params p = p_in;
  p.prefetch_bytes = head_prefetch_bytes(dev, p.rows);
  if (cudaError_t e = kernel_attrs<Kernel>(dev, smem); e != cudaSuccess) return e;
#ifndef TSI_EMULATE
  Kernel<<<p.rows, threads, smem, stream>>>(p);
  return cudaGetLastError();
#else
  (void)stream;
  (void)dev;
  tsi_emu::launch(p.rows, threads, smem, [p]() { Kernel(p); });
  return cudaSuccess;
#endif
}

template <class Src, int MINB>
cudaError_t launch_variant(const Params& p, cudaStream_t stream, int dev) {
  return launch_rows<tsi::topk_kernel<Src, MINB>, tsi::THREADS, (int)sizeof(tsi::Smem)>(p, stream, dev);
}

// Multiprocessor count per device, read once (a property query: capture-safe).
int sm_count(int dev) {
#ifndef TSI_EMULATE
  static int cache[64] = {0};
  if (cache[dev] == 0) {
    const int v = device_attr(cudaDevAttrMultiProcessorCount, dev);
    cache[dev] = v > 0 ? v : 132;
  }
  return cache[dev];
#else
  (void)dev;
  return tsi_emu::sm_count();
#endif
}

cudaError_t current_device(int* dev) {
  *dev = 0;
#ifndef TSI_EMULATE
  cudaError_t e = cudaGetDevice(dev);
  if (e != cudaSuccess) return e;
  if (*dev < 0 || *dev >= 64) return cudaErrorInvalidDevice;
#endif
  return cudaSuccess;
}

// The variant depends only on the row count: two CTAs per SM pay off once every SM has two rows.
template <class Src>
cudaError_t launch_on(const Params& p, cudaStream_t stream, int dev) {
  if (p.rows >= 2 * sm_count(dev)) return launch_variant<Src, 2>(p, stream, dev);
  return launch_variant<Src, 1>(p, stream, dev);
}

template <class Src>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  int dev;
  if (cudaError_t e = current_device(&dev); e != cudaSuccess) return e;
  return launch_on<Src>(p, stream, dev);
}

// Wide CTAs for dense topk rows (tsi_wide): 0 = never, 1 = auto (the default: streamed rows, width > smem_keys,
// in batches of at most SMs / 2 rows), 2 = every dense topk launch that does not take the cluster kernel (tests).
// Measured on the H200 (NOTES.md, session 16, run 91): 32 and 64 x 128K rows 7% and 6% faster, 64 x 1M 2%, but
// 128 x 128K within +-0.8 us either way (k 512-2048): where every SM has a row, 32 warps do not stream it faster.
int g_wide_mode = 1;

template <typename T> struct WideElem { using type = T; };
template <> struct WideElem<tsi::bf16_tag> { using type = tsi_wide::bf16_tag; };

template <typename T>
cudaError_t launch_dense(const Params& p, cudaStream_t stream, int dev) {
  const bool wide = g_wide_mode == 2 || (g_wide_mode == 1 && p.width > tsi::SMEM_KEYS && 2 * p.rows <= sm_count(dev));
  if (!wide) return launch_on<tsi::DenseSrc<T>>(p, stream, dev);
  using Src = tsi_wide::DenseSrc<typename WideElem<T>::type>;
  return launch_rows<tsi_wide::topk_kernel<Src, 1>, tsi_wide::THREADS, (int)sizeof(tsi_wide::Smem)>(p, stream, dev);
}

// Cluster mode for dense rows (topk_cluster_kernel): 0 = never, 1 = auto (default), 2 = for every width it
// covers (see tsi_topk_set_cluster_mode).
int g_cluster_mode = 1;

// Cluster size and slice width for `rows` dense rows of `width` columns; C = 0 for the one-CTA kernel.
// Auto: clusters while all of them fit on the SMs at one CTA each (rows * C <= SMs), for rows the split kernel does
// not take (tsi_topk asks split_shape first: since session 28 that leaves small batches of widths below
// 2 x smem_keys, or GPUs where the resident-cluster query fails). Measured on the H200 against the one-CTA kernel
// with the sampled threshold (NOTES.md): 1 x 128K 26 vs 37 us and 8 x 128K 30 vs 37 us, but 32 x 128K 53 vs 38 us
// and 128 x 128K 151 vs 45 us, where a slice's shared-memory passes and cluster barriers cost more than the one-CTA
// kernel's single streamed read.
void cluster_shape(int rows, int width, int dev, int* C, int* S) {
  *C = 0;
  *S = 0;
  if (g_cluster_mode == 0 || width <= tsi::SMEM_KEYS || width > tsi::CLUSTER_MAX * tsi::SMEM_KEYS) return;
  const int c = (width + tsi::SMEM_KEYS - 1) / tsi::SMEM_KEYS;
  if (g_cluster_mode == 1 && (long long)rows * c > (long long)sm_count(dev)) return;
  *C = c;
  *S = (((width + c - 1) / c) + 31) & ~31;  // <= SMEM_KEYS (a multiple of 32: the K layout's zero fill)
}

#ifndef TSI_EMULATE
// A launch of `grid` CTAs of `threads` threads in clusters of C (attr: the caller's storage for the cluster attribute).
cudaLaunchConfig_t cluster_config(int grid, int threads, int smem, int C, cudaStream_t stream,
                                  cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid, 1, 1);
  cfg.blockDim = dim3((unsigned)threads, 1, 1);
  cfg.dynamicSmemBytes = (size_t)smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = (unsigned)C;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}
#endif

// Kernel(p, S, C) on p.rows clusters of C CTAs of `threads` threads and `smem` bytes of dynamic shared memory (the
// cluster and split kernels; their attributes are the caller's).
template <auto Kernel>
cudaError_t launch_clusters(const Params& p, cudaStream_t stream, int C, int S, int threads, int smem) {
#ifndef TSI_EMULATE
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(p.rows * C, threads, smem, C, stream, &attr);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, Kernel, p, S, C);
  return e != cudaSuccess ? e : cudaGetLastError();
#else
  (void)stream;
  tsi_emu::launch_cluster(p.rows * C, C, threads, smem, [p, S, C]() { Kernel(p, S, C); });
  return cudaSuccess;
#endif
}

template <typename T>
cudaError_t launch_cluster(const Params& p, cudaStream_t stream, int dev, int C, int S) {
  const int smem = (int)(offsetof(tsi::Smem, region) + (size_t)(S + tsi::NBINS) * 4);
  const int most = (int)(offsetof(tsi::Smem, region) + (size_t)(tsi::SMEM_KEYS + tsi::NBINS) * 4);
  if (cudaError_t e = kernel_attrs<tsi::topk_cluster_kernel<T>>(dev, most); e != cudaSuccess) return e;
  return launch_clusters<tsi::topk_cluster_kernel<T>>(p, stream, C, S, tsi::THREADS, smem);
}

// Split mode for dense rows (topk_split_kernel: C CTAs of tsi_wide::THREADS threads in a cluster stream one row,
// each its slice; see tsi_topk_set_split_mode): 0 = never, 1 = auto (the default), 2 / 3 / 4 = C = 2 / 4 / 8
// for every dense topk launch of rows longer than smem_keys (before the cluster kernel: tests and benchmarks).
int g_split_mode = 1;
unsigned g_split_launches = 0;  // (tests check that a mode reaches the kernel)

constexpr int kSplitSmem = (int)sizeof(tsi_wide::Smem);

// The split kernel's dynamic shared-memory limit, once per device (not a stream operation: capture-safe).
cudaError_t split_attrs(int dev) {
  const cudaError_t e = kernel_attrs<tsi_wide::topk_split_kernel<float>>(dev, kSplitSmem);
  return e != cudaSuccess ? e : kernel_attrs<tsi_wide::topk_split_kernel<tsi_wide::bf16_tag>>(dev, kSplitSmem);
}

// How many clusters of C split-kernel CTAs can be resident at once (a GPC holds whole clusters, so on a GPU whose
// GPCs have unequal SM counts this is less than SMs / C), read once per device and C (an occupancy query, not a
// stream operation: capture-safe). 0 where it cannot be read.
int split_clusters(int dev, int C) {
#ifndef TSI_EMULATE
  static int cache[64][4] = {};
  const int i = C == 2 ? 1 : (C == 4 ? 2 : 3);
  if (cache[dev][i] == 0) {
    int n = 0;
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config(C, tsi_wide::THREADS, kSplitSmem, C, nullptr, &attr);
    if (split_attrs(dev) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, tsi_wide::topk_split_kernel<float>, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed query must not be reported by the next launch: it only disables auto
      n = 0;
    }
    cache[dev][i] = n > 0 ? n : -1;
  }
  return cache[dev][i] > 0 ? cache[dev][i] : 0;
#else
  (void)dev;
  return tsi_emu::sm_count() / C;
#endif
}

// Cluster size and slice width of the split kernel for `rows` dense rows of `width` columns; C = 0: not split.
// Auto: batches of at most SMs / 4 rows (past that, one CTA per row already streams the batch at a good share of
// HBM bandwidth: 48 and 64 rows x 128K were 2% and 10% slower split in two on an H100, NOTES.md "Session 28"), with the
// most CTAs per row (8, 4 or 2) whose clusters all fit on the GPU at once and whose slices keep at least smem_keys
// columns. (A cluster size whose clusters do not all fit runs a second wave: 16 rows x 8 CTAs and 32 x 4 took
// 1.2-1.3x the one-CTA time.)
void split_shape(int rows, int width, int dev, int* C, int* S) {
  *C = 0;
  *S = 0;
  if (g_split_mode == 0 || width <= tsi::SMEM_KEYS) return;
  int c = 0;
  if (g_split_mode >= 2) {
    c = 1 << (g_split_mode - 1);
  } else {
    if ((long long)rows * 4 > sm_count(dev)) return;
    for (int cc = tsi::CLUSTER_MAX; cc >= 2 && c == 0; cc /= 2)
      if (width / cc >= tsi::SMEM_KEYS && rows <= split_clusters(dev, cc)) c = cc;
    if (c == 0) return;
  }
  *C = c;
  *S = (((width + c - 1) / c) + 31) & ~31;
}

template <typename T>
cudaError_t launch_split(const Params& p_in, cudaStream_t stream, int dev, int C, int S) {
  using Elem = typename WideElem<T>::type;
  Params p = p_in;
  p.prefetch_bytes = head_prefetch_bytes(dev, (long long)p.rows * C);
  if (cudaError_t e = split_attrs(dev); e != cudaSuccess) return e;
  ++g_split_launches;
  return launch_clusters<tsi_wide::topk_split_kernel<Elem>>(p, stream, C, S, tsi_wide::THREADS, kSplitSmem);
}

// Streamed rows try the sampled threshold first (one read of the row; see sampled_mode): 1 = on (default).
int g_sampled = 1;

// The fields every op sets; sparse_topk and block_topk add theirs.
Params row_params(const void* logits, long long row_stride, int rows, int width, const int* lengths, int* out,
                  int kk) {
  Params p{};
  p.logits = logits;
  p.row_stride = row_stride;
  p.rows = rows;
  p.width = width;
  p.lengths = lengths;
  p.out = out;
  p.kk = kk;
  p.sampled = g_sampled;
  return p;
}

bool aligned16(const void* ptr, long long stride, int esize) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0 && ((stride * esize) & 15) == 0;
}

// Three CTAs per SM for batches of shared-memory rows (tsi::topk_tri_kernel: 16-bit keys in shared memory, ~73 KB
// per CTA instead of ~107): 0 = off (the default: 5-14% slower than two CTAs per SM on an H100, NOTES.md run 96),
// 1 = auto (batches of at least 2 x SMs rows, where the one-CTA-per-row kernel runs two CTAs per SM), 2 = whenever
// the rows qualify (tests).
// Rows qualify when their starts and stride are 16-byte aligned, width <= smem_keys and k <= tri_max_k.
int g_tri_mode = 0;

constexpr int kTriSmem = (int)(offsetof(tsi::Smem, region) + sizeof(uint32_t) * tsi::SMEM_KEYS);

bool tri_rows(const Params& p, int dtype, int dev) {
  if (g_tri_mode == 0 || p.width > tsi::SMEM_KEYS || p.kk > tsi::TRI_LIST ||
      !aligned16(p.logits, p.row_stride, dtype == 0 ? 4 : 2))
    return false;
  return g_tri_mode == 2 || p.rows >= 2 * sm_count(dev);
}

// The three-CTA kernel's attributes, once per device (not stream operations: capture-safe): its dynamic shared
// memory, and all of the SM's unified L1 / shared memory as shared memory (three CTAs need it).
template <class Src>
cudaError_t launch_tri_attrs(int dev) {
  return kernel_attrs<tsi::topk_tri_kernel<Src>>(dev, kTriSmem, 100);
}

// Launches of the three-CTA kernel so far (tests check that the mode they set reaches it).
unsigned g_tri_launches = 0;

template <class Src>
cudaError_t launch_tri(const Params& p, cudaStream_t stream, int dev) {
  if (cudaError_t e = launch_tri_attrs<Src>(dev); e != cudaSuccess) return e;
  ++g_tri_launches;
#ifndef TSI_EMULATE
  tsi::topk_tri_kernel<Src><<<p.rows, tsi::THREADS, kTriSmem, stream>>>(p);
  return cudaGetLastError();
#else
  (void)stream;
  tsi_emu::launch(p.rows, tsi::THREADS, kTriSmem, [p]() { tsi::topk_tri_kernel<Src>(p); });
  return cudaSuccess;
#endif
}

}  // namespace

extern "C" {

int tsi_topk_version() { return kVersion; }

int tsi_topk_max_k() { return tsi::LIST_CAP; }

// Tuning constants, exported so tests can aim at each path: rows of at most smem_keys elements are
// selected in shared memory; longer rows buffer at most cand_cap threshold-bin elements.
int tsi_topk_smem_keys() { return tsi::SMEM_KEYS; }
int tsi_topk_cand_cap() { return tsi::CAND_CAP; }

// Development builds with -DTSI_PHASE_TIMING: the clock64() values block 0 recorded at its numbered points
// (out: 32 values; see TSI_MARK in topk_kernels.cuh), then clears them. Returns -1 in other builds.
int tsi_topk_phase_cycles(unsigned long long* out) {
#if defined(TSI_PHASE_TIMING) && !defined(TSI_EMULATE)
  static const unsigned long long zero[32] = {};
  const cudaError_t e = cudaMemcpyFromSymbol(out, tsi_phase::g_phase, sizeof(tsi_phase::g_phase));
  return (int)(e != cudaSuccess ? e : cudaMemcpyToSymbol(tsi_phase::g_phase, zero, sizeof(zero)));
#else
  (void)out;
  return -1;
#endif
}

// Development builds with -DTSI_PHASE_TIMING: %globaltimer (ns) at the start and the end of thread 0 of each of
// the first n blocks (n <= 4096) of the last launches, as out[2 * b], out[2 * b + 1]; then clears them. Returns -1
// in other builds.
int tsi_topk_phase_spans(unsigned long long* out, int n) {
#if defined(TSI_PHASE_TIMING) && !defined(TSI_EMULATE)
  if (n < 0 || n > tsi_phase::SPAN_BLOCKS) return (int)cudaErrorInvalidValue;
  static unsigned long long zero[2 * tsi_phase::SPAN_BLOCKS] = {};
  const cudaError_t e = cudaMemcpyFromSymbol(out, tsi_phase::g_span, sizeof(unsigned long long) * 2 * n);
  return (int)(e != cudaSuccess ? e : cudaMemcpyToSymbol(tsi_phase::g_span, zero, sizeof(zero)));
#else
  (void)out;
  (void)n;
  return -1;
#endif
}

const char* tsi_topk_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// topk over columns [0, lengths[r]) of logits [rows, width] (row stride in elements, unit column
// stride). dtype: 0 = float32, 1 = bfloat16. out: int32 [rows, k] contiguous.
int tsi_topk(const void* logits, long long row_stride, int rows, int width, int dtype, const int* lengths,
             int k, int* out, uintptr_t stream) {
  if (k < 1 || k > tsi::LIST_CAP || rows < 0 || width < 0 || row_stride < width || (dtype != 0 && dtype != 1))
    return cudaErrorInvalidValue;
  const Params p = row_params(logits, row_stride, rows, width, lengths, out, k);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (rows == 0) return cudaSuccess;
  int dev;
  if (cudaError_t e = current_device(&dev); e != cudaSuccess) return e;
  int C, S;
  split_shape(rows, width, dev, &C, &S);
  if (C > 0)
    return dtype == 0 ? launch_split<float>(p, s, dev, C, S) : launch_split<tsi::bf16_tag>(p, s, dev, C, S);
  cluster_shape(rows, width, dev, &C, &S);
  if (C > 0)
    return dtype == 0 ? launch_cluster<float>(p, s, dev, C, S) : launch_cluster<tsi::bf16_tag>(p, s, dev, C, S);
  if (tri_rows(p, dtype, dev))
    return dtype == 0 ? launch_tri<tsi::DenseSrc<float>>(p, s, dev)
                      : launch_tri<tsi::DenseSrc<tsi::bf16_tag>>(p, s, dev);
  return dtype == 0 ? launch_dense<float>(p, s, dev) : launch_dense<tsi::bf16_tag>(p, s, dev);
}

// Cluster mode of tsi_topk (dense rows of smem_keys < width <= cluster_max * smem_keys columns, one
// read of the row by a cluster of CTAs): 0 = off (one CTA per row), 1 = auto (the default: clusters when
// rows * cluster size <= SMs), 2 = always. Returns the previous mode; a value
// outside 0..2 only queries. For benchmarks and tests; not thread-safe against launches.
int tsi_topk_set_cluster_mode(int mode) {
  const int prev = g_cluster_mode;
  if (mode >= 0 && mode <= 2) g_cluster_mode = mode;
  return prev;
}
int tsi_topk_cluster_max() { return tsi::CLUSTER_MAX; }

// Split mode of tsi_topk (dense rows longer than smem_keys streamed by a cluster of CTAs, each its slice; see
// g_split_mode): 0 = off, 1 = auto (the default), 2 / 3 / 4 = clusters of 2 / 4 / 8 CTAs for every such launch.
// Results are identical in every mode. Returns the previous mode; a value outside 0..4 only queries. For
// benchmarks and tests; not thread-safe against launches.
int tsi_topk_set_split_mode(int mode) {
  const int prev = g_split_mode;
  if (mode >= 0 && mode <= 4) g_split_mode = mode;
  return prev;
}
int tsi_topk_split_launches() { return (int)(g_split_launches & 0x7fffffffu); }

// Wide-CTA mode of tsi_topk (dense rows that do not take the cluster kernel; one CTA of tsi_topk_wide_threads()
// threads per row instead of TSI_THREADS): 0 = off, 1 = auto (the default: rows longer than smem_keys in batches
// of at most SMs / 2 rows), 2 = always. Results are identical in every mode. Returns the previous
// mode; a value outside 0..2 only queries. For benchmarks and tests; not thread-safe against launches.
int tsi_topk_set_wide_mode(int mode) {
  const int prev = g_wide_mode;
  if (mode >= 0 && mode <= 2) g_wide_mode = mode;
  return prev;
}
int tsi_topk_wide_threads() { return tsi_wide::THREADS; }

// Three-CTA mode of tsi_topk and tsi_sparse_topk (see g_tri_mode): 0 = off (the default), 1 = auto, 2 = always for
// qualifying rows. Results are identical in every mode. Returns the previous mode; a value outside 0..2 only
// queries. For benchmarks and tests; not thread-safe against launches.
int tsi_topk_set_tri_mode(int mode) {
  const int prev = g_tri_mode;
  if (mode >= 0 && mode <= 2) g_tri_mode = mode;
  return prev;
}
int tsi_topk_tri_max_k() { return tsi::TRI_LIST; }
int tsi_topk_tri_launches() { return (int)(g_tri_launches & 0x7fffffffu); }

// CTAs per SM that the three-CTA kernel (dense fp32 rows) reaches on the current device, or -1 where that cannot
// be queried (emulation builds). For benchmarks: the kernel is built for three.
int tsi_topk_tri_blocks_per_sm() {
#ifndef TSI_EMULATE
  int dev, n = 0;
  if (current_device(&dev) != cudaSuccess || launch_tri_attrs<tsi::DenseSrc<float>>(dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, tsi::topk_tri_kernel<tsi::DenseSrc<float>>, tsi::THREADS,
                                                    kTriSmem) != cudaSuccess)
    return -1;
  return n;
#else
  return -1;
#endif
}

// Streamed rows (more than smem_keys elements, one CTA per row): 1 = try the sampled threshold first (the
// default: one read of the row when the sample's threshold buffers between k and cand_cap elements, else
// the two-pass path), 0 = always the two-pass path. The result is the same either way. Returns the
// previous setting; a value other than 0 or 1 only queries. For benchmarks and tests.
int tsi_topk_set_sampled(int on) {
  const int prev = g_sampled;
  if (on == 0 || on == 1) g_sampled = on;
  return prev;
}

// sparse_topk over logits [rows, nblk * cbs]: column c is position blocks[r, c / cbs] * cbs + c % cbs,
// valid when that block id is >= 0 and the position < lengths[r]. out: int32 [rows, k].
int tsi_sparse_topk(const void* logits, long long row_stride, int rows, int dtype, const int* blocks, int nblk,
                    int cbs, const int* lengths, int k, int* out, uintptr_t stream) {
  const int lcbs = log2_exact(cbs);
  if (k < 1 || k > tsi::LIST_CAP || rows < 0 || nblk < 1 || lcbs < 3 || cbs > 64 ||
      row_stride < (long long)nblk * cbs || (dtype != 0 && dtype != 1))
    return cudaErrorInvalidValue;
  Params p = row_params(logits, row_stride, rows, nblk * cbs, lengths, out, k);
  p.blocks = blocks;
  p.nblk = nblk;
  p.cbs = cbs;
  p.lcbs = lcbs;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (rows == 0) return cudaSuccess;
  int dev;
  if (cudaError_t e = current_device(&dev); e != cudaSuccess) return e;
  if (tri_rows(p, dtype, dev))
    return dtype == 0 ? launch_tri<tsi::SparseSrc<float>>(p, s, dev)
                      : launch_tri<tsi::SparseSrc<tsi::bf16_tag>>(p, s, dev);
  return dtype == 0 ? launch_on<tsi::SparseSrc<float>>(p, s, dev) : launch_on<tsi::SparseSrc<tsi::bf16_tag>>(p, s, dev);
}

// block_topk: the min(nbk, ceil(n / cbs)) best blocks of cbs columns by their max valid logit
// (n = clamp(lengths[r], 0, width)). out: int32 [rows, nbk].
int tsi_block_topk(const void* logits, long long row_stride, int rows, int width, int dtype, const int* lengths,
                   int cbs, int* out, int nbk, uintptr_t stream) {
  const int lcbs = log2_exact(cbs);
  if (nbk < 1 || nbk > tsi::LIST_CAP || rows < 0 || width < 0 || row_stride < width || lcbs < 3 || cbs > 64 ||
      (dtype != 0 && dtype != 1))
    return cudaErrorInvalidValue;
  Params p = row_params(logits, row_stride, rows, width, lengths, out, nbk);
  p.cbs = cbs;
  p.lcbs = lcbs;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const bool vec = aligned16(logits, row_stride, dtype == 0 ? 4 : 2);
  if (dtype == 0)
    return vec ? launch<tsi::BlockVecSrc<float>>(p, s) : launch<tsi::BlockScalarSrc<float>>(p, s);
  return vec ? launch<tsi::BlockVecSrc<tsi::bf16_tag>>(p, s) : launch<tsi::BlockScalarSrc<tsi::bf16_tag>>(p, s);
}

}  // extern "C"
