// Clocks a consumer warp of the FP8 forward spends on one tile's softmax_tile (the
// row maxima, 64 exponentials, the row sums and P packed to E4M3), alone: one block
// an SM of one or two warpgroups (one or two warps an SM sub-partition), S in
// registers that an empty asm statement makes opaque each iteration, so nothing is
// hoisted; each iteration's exponentials feed the next one's maxima, so the figure
// is the softmax's latency (one warpgroup) or two softmaxes' side by side (two).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels/cuda \
//        benchmarks/attention_timeline/softmax_bench.cu -o sb && ./sb
#include <cstdio>
#include <cstdlib>
#include "attention_kernels.cu"

using namespace te_fuser;

__device__ __forceinline__ void opaque(float (&x)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(x[i]));
}

// WITH_O: also O's update from a fresh tile product (acc = acc * alpha + tile_o).
template <bool WITH_O>
__global__ void bench(unsigned* sink, long long* clocks, int iters) {
  const int tid = threadIdx.x % 128, group = threadIdx.x / 128;
  ConsumerRows rows = ConsumerRows::of(0, group, tid, 0.0883883f * 1.442695f, 2.0f);
  float sc[64], o[64], tile_o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    sc[i] = __sinf(0.37f * i + 0.11f * threadIdx.x) * 20.0f;
    o[i] = 0.0f;
    tile_o[i] = 0.5f * sc[i];
  }
  uint32_t p8[4][4] = {};
  float alpha[2] = {0.0f, 0.0f};
  unsigned acc = 0;
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    opaque(sc);
    softmax_tile<false>(sc, p8, alpha, rows, 0, 1 << 30);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int w = 0; w < 4; ++w) acc ^= p8[c][w];
    }
    if (WITH_O) {
      opaque(tile_o);
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] = o[i] * alpha[(i / 2) % 2] + tile_o[i];
    }
    asm volatile("" ::"r"(acc));  // this iteration's P before the next (and before the clock read)
  }
  const long long t1 = clock64();
#pragma unroll
  for (int i = 0; i < 64; ++i) acc += __float_as_uint(o[i]);
  acc += __float_as_uint(alpha[0] + rows.l[0] + rows.l[1]);
  if (acc == 0x12345678u) sink[threadIdx.x] = acc;
  if (threadIdx.x % 32 == 0) clocks[blockIdx.x * 8 + threadIdx.x / 32] = t1 - t0;
}

template <bool WITH_O>
double clocks_a_tile(int groups, int blocks, int iters, long long* d_clocks, unsigned* sink) {
  bench<WITH_O><<<blocks, 128 * groups>>>(sink, d_clocks, iters);
  cudaDeviceSynchronize();
  static long long h[8 * 1024];
  cudaMemcpy(h, d_clocks, sizeof(long long) * 8 * blocks, cudaMemcpyDeviceToHost);
  double sum = 0;
  int n = 0;
  for (int b = 0; b < blocks; ++b) {
    for (int w = 0; w < 4 * groups; ++w, ++n) sum += double(h[b * 8 + w]);
  }
  return sum / n / iters;
}

int main() {
  long long* d_clocks;
  unsigned* sink;
  cudaMalloc(&d_clocks, sizeof(long long) * 8 * 1024);
  cudaMalloc(&sink, 4096);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  sms = sms > 1024 ? 1024 : sms;
  const int iters = 2000;
  for (int groups = 1; groups <= 2; ++groups) {
    clocks_a_tile<false>(groups, sms, 10, d_clocks, sink);  // warm-up
    printf("warpgroups %d: softmax_tile %.0f, with O's update %.0f clocks a warp a tile\n", groups,
           clocks_a_tile<false>(groups, sms, iters, d_clocks, sink),
           clocks_a_tile<true>(groups, sms, iters, d_clocks, sink));
  }
  const cudaError_t e = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
