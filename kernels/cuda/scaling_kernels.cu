// Delayed scaling's state update in one block (the rules of
// kernels/reference/scaling.py): the new amax history (this call's amax in slot
// 0 and the rest moved up one, or a copy when an inf or NaN amax skips the call),
// its maximum (NaN when any entry is NaN, as torch.amax) or its newest entry, the
// next scale (fmax / amax, then the margin in steps of 2**64 and a remainder; an
// infinite quotient capped at the largest finite fp32; the previous scale kept
// for a skipped call, an amax of 0 or an inf or NaN in the history), its
// reciprocal and the count of skipped calls. Every division is IEEE
// round-to-nearest (__fdiv_rn), as in the reference.
#include <cfloat>
#include <cmath>

#include "dispatch.cuh"
#include "launchers.cuh"

namespace te_fuser {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    delayed_scale_update_kernel(const float* __restrict__ history, const float* __restrict__ amax_in,
                                const float* __restrict__ scale_in, const int64_t* __restrict__ count_in,
                                float* __restrict__ new_history, float* __restrict__ new_scale,
                                float* __restrict__ new_scale_inv, int64_t* __restrict__ new_count, int64_t length,
                                int margin_steps, float margin_rest, float fmax, bool algo_max) {
  __shared__ float block_max[kThreads];
  __shared__ int block_nan[kThreads];
  const float amax = *amax_in;
  const bool recorded = amax < INFINITY;  // false for inf and NaN: the call is skipped
  const int64_t shift = recorded ? 1 : 0;
  float running = -INFINITY;
  int nan_seen = 0;
  for (int64_t i = threadIdx.x; i < length; i += kThreads) {
    const float entry = i < shift ? amax : history[i - shift];
    new_history[i] = entry;
    running = fmaxf(running, entry);  // fmaxf drops a NaN operand: NaNs are tracked apart
    nan_seen |= entry != entry;
  }
  block_max[threadIdx.x] = running;
  block_nan[threadIdx.x] = nan_seen;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
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

}  // namespace

void launch_delayed_scale_update(const float* history, const float* amax, const float* scale, const int64_t* count,
                                 float* new_history, float* new_scale, float* new_scale_inv, int64_t* new_count,
                                 int64_t length, int margin_steps, float margin_rest, float fmax, bool algo_max,
                                 void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  delayed_scale_update_kernel<<<1, kThreads, 0, stream>>>(history, amax, scale, count, new_history, new_scale,
                                                          new_scale_inv, new_count, length, margin_steps, margin_rest,
                                                          fmax, algo_max);
  check_launch("delayed_scale_update");
}

}  // namespace te_fuser
