// Delayed scaling's state update by one block of kUpdateThreads threads: the
// rules of kernels/reference/scaling.py (see scaling_kernels.cu). Shared by the
// update kernels and by the one-launch cast, whose block 0 updates the state
// from the amax it has just reduced (cast_kernels.cu).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

namespace te_fuser {

constexpr int kUpdateThreads = 256;

// One quantizer's update by one block; block_max and block_nan are the block's
// shared scratch (kUpdateThreads each).
__device__ __forceinline__ void update_one(const float* __restrict__ history, const float* __restrict__ amax_in,
                                           const float* __restrict__ scale_in, const int64_t* __restrict__ count_in,
                                           float* __restrict__ new_history, float* __restrict__ new_scale,
                                           float* __restrict__ new_scale_inv, int64_t* __restrict__ new_count,
                                           int64_t length, int margin_steps, float margin_rest, float fmax,
                                           bool algo_max, float* block_max, int* block_nan) {
  const float amax = *amax_in;
  const bool recorded = amax < INFINITY;  // false for inf and NaN: the call is skipped
  const int64_t shift = recorded ? 1 : 0;
  float running = -INFINITY;
  int nan_seen = 0;
  for (int64_t i = threadIdx.x; i < length; i += kUpdateThreads) {
    const float entry = i < shift ? amax : history[i - shift];
    new_history[i] = entry;
    running = fmaxf(running, entry);  // fmaxf drops a NaN operand: NaNs are tracked apart
    nan_seen |= entry != entry;
  }
  block_max[threadIdx.x] = running;
  block_nan[threadIdx.x] = nan_seen;
  __syncthreads();
  for (int stride = kUpdateThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      block_max[threadIdx.x] = fmaxf(block_max[threadIdx.x], block_max[threadIdx.x + stride]);
      block_nan[threadIdx.x] |= block_nan[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  const float history_amax = algo_max ? (block_nan[0] ? NAN : block_max[0]) : amax;
  float quotient = __fdiv_rn(fmax, history_amax);
  for (int s = 0; s < margin_steps; ++s) quotient = __fdiv_rn(quotient, 18446744073709551616.0f);  // 2**64
  if (margin_rest != 1.0f) quotient = __fdiv_rn(quotient, margin_rest);
  if (quotient == INFINITY) quotient = FLT_MAX;
  if (quotient == -INFINITY) quotient = -FLT_MAX;
  const bool usable = recorded && history_amax > 0.0f && history_amax < INFINITY;
  const float scale = usable ? quotient : *scale_in;
  *new_scale = scale;
  *new_scale_inv = __fdiv_rn(1.0f, scale);
  *new_count = *count_in + (recorded ? 0 : 1);
}

}  // namespace te_fuser
