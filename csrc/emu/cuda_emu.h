// Minimal CPU emulation of the CUDA features the top-k kernels use, for developing and checking
// their logic on a machine without a GPU: one std::thread per CUDA thread, std::barrier for
// __syncthreads and for warp-synchronous intrinsics (all 32 lanes must take part, as the kernels
// guarantee). Blocks run one after another. Dynamic shared memory is filled with garbage first so
// reads of unwritten shared memory show up as wrong results. Not a performance model.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

typedef int cudaError_t;
typedef void* cudaStream_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidDevice = 101 };
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == 0 ? "no error" : (e == 1 ? "invalid argument" : "emulated CUDA error");
}

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct emu_dim3 {
  unsigned x = 0, y = 0, z = 0;
};

inline thread_local emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace tsi_emu {

struct Warp {
  std::barrier<> bar{32};
  uint64_t slot[32];
};

struct Block {
  // Shared memory is followed by a guard band: a kernel that touches bytes past the dynamic size it was launched
  // with (which the GPU reports as an illegal address, or not at all) fails the check after the block.
  static constexpr size_t kGuard = 4096;
  explicit Block(int nthreads, int smem_bytes) : bar(nthreads), smem(smem_bytes + kGuard), size(smem_bytes) {
    for (size_t i = 0; i < smem.size(); ++i) smem[i] = (unsigned char)(0xA5 ^ (i * 131));
    for (int w = 0; w < nthreads / 32; ++w) warps.emplace_back(new Warp());
  }
  ~Block() {
    for (size_t i = size; i < smem.size(); ++i)
      if (smem[i] != (unsigned char)(0xA5 ^ (i * 131))) {
        std::fprintf(stderr, "emulated kernel wrote shared memory byte %zu past its %zu launched bytes\n", i, size);
        std::abort();
      }
  }
  std::barrier<> bar;
  std::vector<unsigned char> smem;
  size_t size;  // launched dynamic shared memory bytes
  std::vector<std::unique_ptr<Warp>> warps;
  std::atomic<int> vote{0};  // __syncthreads_or / __syncthreads_and
  uint32_t scratch[2 * 4 * 128];  // emulated collective operations (the scoring kernels' wgmma)
};

inline thread_local Block* tl_block = nullptr;

// cp.async, deferred: a thread's copies are queued and land only when cp.async.wait_group lets their group
// complete (oldest first), the latest moment the GPU allows. A read of a copy's destination before the wait
// that covers it then sees the old bytes here too, so a wrong wait count fails the emulated tests instead of
// passing because the copy was already done. (src_bytes < n: the rest is zero-filled, as the PTX says.)
struct AsyncCopy {
  unsigned char* dst;
  const void* src;
  int src_bytes, n;
};
inline thread_local std::vector<std::vector<AsyncCopy>> tl_async_groups;  // committed, oldest first
inline thread_local std::vector<AsyncCopy> tl_async_open;                  // issued, not yet committed
inline void async_copy(unsigned char* dst, const void* src, int src_bytes, int n) {
  tl_async_open.push_back({dst, src, src_bytes, n});
}
inline void async_commit() {
  tl_async_groups.push_back(std::move(tl_async_open));
  tl_async_open.clear();
}
inline void async_wait(size_t pending) {
  while (tl_async_groups.size() > pending) {
    for (const AsyncCopy& c : tl_async_groups.front()) {
      std::memset(c.dst, 0, (size_t)c.n);
      if (c.src_bytes) std::memcpy(c.dst, c.src, (size_t)c.src_bytes);
    }
    tl_async_groups.erase(tl_async_groups.begin());
  }
}

// A cluster: its blocks run concurrently (every thread of every block is a std::thread), with one
// barrier across all of them and each block's shared memory visible to the others.
struct Cluster {
  Cluster(int nblocks, int nthreads) : bar(nblocks * nthreads) {}
  std::barrier<> bar;
  std::vector<Block*> blocks;
};
inline thread_local Cluster* tl_cluster = nullptr;
inline thread_local unsigned tl_cluster_rank = 0;

inline int sm_count() {
  const char* s = std::getenv("TSI_EMU_SMS");
  return s ? std::atoi(s) : 2;
}

// Gathers every lane's value (each lane passes its own), like a warp-wide all-gather.
template <class T>
inline void warp_gather(T v, T (&all)[32]) {
  Warp* w = tl_block->warps[threadIdx.x / 32].get();
  const int lane = threadIdx.x & 31;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  w->slot[lane] = bits;
  w->bar.arrive_and_wait();
  for (int i = 0; i < 32; ++i) std::memcpy(&all[i], &w->slot[i], sizeof(T));
  w->bar.arrive_and_wait();
}

// A two-dimensional grid (blockIdx.x < gx, blockIdx.y < gy), blocks one after another.
inline void launch_xy(int gx, int gy, int threads, int smem_bytes, const std::function<void()>& fn) {
  for (int y = 0; y < gy; ++y) {
    for (int b = 0; b < gx; ++b) {
      Block blk(threads, smem_bytes);
      std::vector<std::thread> ts;
      ts.reserve(threads);
      for (int t = 0; t < threads; ++t) {
        ts.emplace_back([&, t, b, y]() {
          threadIdx.x = t;
          blockIdx.x = b;
          blockIdx.y = y;
          blockDim.x = threads;
          gridDim.x = gx;
          gridDim.y = gy;
          tl_block = &blk;
          fn();
        });
      }
      for (auto& th : ts) th.join();
    }
  }
}

inline void launch(int grid, int threads, int smem_bytes, const std::function<void()>& fn) {
  launch_xy(grid, 1, threads, smem_bytes, fn);
}

// grid blocks in clusters of `cluster` consecutive blocks; clusters run one after another.
inline void launch_cluster(int grid, int cluster, int threads, int smem_bytes, const std::function<void()>& fn) {
  for (int c0 = 0; c0 < grid; c0 += cluster) {
    Cluster cl(cluster, threads);
    std::vector<std::unique_ptr<Block>> blks;
    for (int q = 0; q < cluster; ++q) {
      blks.emplace_back(new Block(threads, smem_bytes));
      cl.blocks.push_back(blks.back().get());
    }
    std::vector<std::thread> ts;
    ts.reserve((size_t)cluster * threads);
    for (int q = 0; q < cluster; ++q) {
      for (int t = 0; t < threads; ++t) {
        ts.emplace_back([&, q, t]() {
          threadIdx.x = t;
          blockIdx.x = c0 + q;
          blockDim.x = threads;
          gridDim.x = grid;
          tl_block = cl.blocks[q];
          tl_cluster = &cl;
          tl_cluster_rank = q;
          fn();
        });
      }
    }
    for (auto& th : ts) th.join();
  }
}

}  // namespace tsi_emu

inline unsigned tsi_cluster_rank() { return tsi_emu::tl_cluster_rank; }
inline void tsi_cluster_sync() { tsi_emu::tl_cluster->bar.arrive_and_wait(); }
template <class T>
inline T* tsi_cluster_map(T* p, unsigned rank) {
  const auto off = reinterpret_cast<unsigned char*>(p) - tsi_emu::tl_block->smem.data();
  return reinterpret_cast<T*>(tsi_emu::tl_cluster->blocks[rank]->smem.data() + off);
}

#define TSI_DYN_SMEM(name) unsigned char* name = tsi_emu::tl_block->smem.data()

inline void __syncthreads() { tsi_emu::tl_block->bar.arrive_and_wait(); }
// Block-wide votes: the count of threads with p, read after a barrier, reset after another.
inline int tsi_emu_block_count(int p) {
  auto* b = tsi_emu::tl_block;
  b->bar.arrive_and_wait();
  if (p) b->vote.fetch_add(1);
  b->bar.arrive_and_wait();
  const int n = b->vote.load();
  b->bar.arrive_and_wait();
  if (threadIdx.x == 0) b->vote.store(0);
  b->bar.arrive_and_wait();
  return n;
}
inline int __syncthreads_or(int p) { return tsi_emu_block_count(p != 0) > 0; }
inline int __syncthreads_and(int p) { return tsi_emu_block_count(p == 0) == 0; }

template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned d) {
  T all[32];
  tsi_emu::warp_gather(v, all);
  const unsigned lane = threadIdx.x & 31;
  return lane >= d ? all[lane - d] : v;
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned d) {
  T all[32];
  tsi_emu::warp_gather(v, all);
  const unsigned lane = threadIdx.x & 31;
  return lane + d < 32 ? all[lane + d] : v;
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int o) {
  T all[32];
  tsi_emu::warp_gather(v, all);
  return all[(threadIdx.x & 31) ^ (unsigned)o];
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  T all[32];
  tsi_emu::warp_gather(v, all);
  return all[src & 31];
}
inline bool __all_sync(unsigned, bool p) {
  int all[32];
  tsi_emu::warp_gather((int)p, all);
  for (int i = 0; i < 32; ++i)
    if (!all[i]) return false;
  return true;
}
inline unsigned __reduce_min_sync(unsigned, unsigned v) {
  unsigned all[32];
  tsi_emu::warp_gather(v, all);
  unsigned m = all[0];
  for (int i = 1; i < 32; ++i) m = all[i] < m ? all[i] : m;
  return m;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  unsigned all[32];
  tsi_emu::warp_gather(v, all);
  unsigned m = all[0];
  for (int i = 1; i < 32; ++i) m = all[i] > m ? all[i] : m;
  return m;
}
inline unsigned __ballot_sync(unsigned, int p) {
  int all[32];
  tsi_emu::warp_gather(p, all);
  unsigned b = 0u;
  for (int i = 0; i < 32; ++i) b |= (unsigned)(all[i] != 0) << i;
  return b;
}
inline void __syncwarp(unsigned = 0xffffffffu) { tsi_emu::tl_block->warps[threadIdx.x / 32]->bar.arrive_and_wait(); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline unsigned __reduce_add_sync(unsigned, unsigned v) {
  unsigned all[32];
  tsi_emu::warp_gather(v, all);
  unsigned s = 0;
  for (int i = 0; i < 32; ++i) s += all[i];
  return s;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline float __uint_as_float(unsigned v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned v;
  std::memcpy(&v, &f, 4);
  return v;
}
inline int __ffs(int v) { return __builtin_ffs(v); }
inline unsigned atomicAdd(unsigned* a, unsigned v) { return std::atomic_ref<unsigned>(*a).fetch_add(v); }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
inline unsigned atomicOr(unsigned* a, unsigned v) { return std::atomic_ref<unsigned>(*a).fetch_or(v); }
inline unsigned atomicMax(unsigned* a, unsigned v) {
  std::atomic_ref<unsigned> r(*a);
  unsigned cur = r.load();
  while (cur < v && !r.compare_exchange_weak(cur, v)) {
  }
  return cur;
}
