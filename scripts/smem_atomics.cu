// Microbenchmark (development): clock64 cycles for one CTA whose threads each do n shared-memory atomics (or
// plain accesses) on random bins, to price the histogram and bitmap sweeps of csrc/topk_kernels.cuh (NOTES.md,
// session 12). Build and run on the GPU machine:
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a scripts/smem_atomics.cu -o smem_atomics && ./smem_atomics
#include <cstdio>
#include <cuda_runtime.h>
__global__ void k(int mode, int n, unsigned* sink, long long* cyc) {
  __shared__ unsigned hist[2048 + 32];
  for (int i = threadIdx.x; i < 2080; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  unsigned x = threadIdx.x * 2654435761u + 12345u;
  const unsigned lane = threadIdx.x & 31;
  long long t0 = clock64();
  for (int i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    const unsigned b = (x >> 21) & 2047u;
    if (mode == 0) atomicAdd(&hist[b], 1u);
    else if (mode == 1) atomicAdd(&hist[2048 + lane], 1u);
    else if (mode == 2) atomicAdd(&hist[(x >> 21) & 7u], 1u);
    else if (mode == 3) hist[b] += 1u;
    else if (mode == 4) atomicOr(&hist[b], 1u << (x & 31u));
    else if (mode == 5) { unsigned v = hist[b]; x ^= v; }
  }
  __syncthreads();
  long long t1 = clock64();
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
  sink[threadIdx.x] = hist[threadIdx.x] + x;
}
int main() {
  unsigned* sink; long long* cyc; cudaMalloc(&sink, 4096 * 4); cudaMalloc(&cyc, 8 * 132);
  const char* names[] = {"atomicAdd random of 2048 bins", "atomicAdd lane's own word (same 32 words in all warps)",
                         "atomicAdd 8 bins (heavy collisions)", "plain += random (racy)", "atomicOr random",
                         "plain load random"};
  for (int threads : {512, 256}) for (int n : {8, 64}) for (int m = 0; m < 6; ++m) {
    long long c[132];
    for (int rep = 0; rep < 3; ++rep) { k<<<1, threads>>>(m, n, sink, cyc); cudaDeviceSynchronize(); }
    cudaMemcpy(c, cyc, 8, cudaMemcpyDeviceToHost);
    printf("threads %d n %2d: %6lld cycles = %.2f lanes/cycle  %s\n", threads, n, c[0], (double)threads * n / c[0], names[m]);
  }
  return 0;
}
