// Delayed scaling's state update in one block (the rules of
// kernels/reference/scaling.py): the new amax history (this call's amax in slot
// 0 and the rest moved up one, or a copy when an inf or NaN amax skips the call),
// its maximum (NaN when any entry is NaN, as torch.amax) or its newest entry, the
// next scale (fmax / amax, then the margin in steps of 2**64 and a remainder; an
// infinite quotient capped at the largest finite fp32; the previous scale kept
// for a skipped call, an amax of 0 or an inf or NaN in the history), its
// reciprocal and the count of skipped calls. Every division is IEEE
// round-to-nearest (__fdiv_rn), as in the reference. The batched update runs the
// same code for many quantizers, one block each, in one launch per kBatch.
#include "dispatch.cuh"
#include "launchers.cuh"
#include "scaling_update.cuh"

namespace te_fuser {
namespace {

constexpr int kThreads = kUpdateThreads;
constexpr int kBatch = 32;  // quantizers per launch of the batched update (their pointers ride in the parameters)

__global__ void __launch_bounds__(kThreads)
    delayed_scale_update_kernel(const float* __restrict__ history, const float* __restrict__ amax_in,
                                const float* __restrict__ scale_in, const int64_t* __restrict__ count_in,
                                float* __restrict__ new_history, float* __restrict__ new_scale,
                                float* __restrict__ new_scale_inv, int64_t* __restrict__ new_count, int64_t length,
                                int margin_steps, float margin_rest, float fmax, bool algo_max) {
  __shared__ float block_max[kThreads];
  __shared__ int block_nan[kThreads];
  update_one(history, amax_in, scale_in, count_in, new_history, new_scale, new_scale_inv, new_count, length,
             margin_steps, margin_rest, fmax, algo_max, block_max, block_nan);
}

// Up to kBatch quantizers' state, each where its own tensors are (nothing stacked first).
struct UpdateSources {
  const float* history[kBatch];
  const float* amax[kBatch];
  const float* scale[kBatch];
  const int64_t* count[kBatch];
};

// Block b updates quantizer first + b into row first + b of the stacked outputs:
// new_history (n, length), new_scale and new_scale_inv with stride 4 (16 bytes
// apart), new_count (n,).
__global__ void __launch_bounds__(kThreads)
    delayed_scale_update_many_kernel(UpdateSources sources, int64_t first, float* __restrict__ new_history,
                                     float* __restrict__ new_scale, float* __restrict__ new_scale_inv,
                                     int64_t* __restrict__ new_count, int64_t length, int margin_steps,
                                     float margin_rest, float fmax, bool algo_max) {
  __shared__ float block_max[kThreads];
  __shared__ int block_nan[kThreads];
  const int b = blockIdx.x;
  const int64_t row = first + b;
  update_one(sources.history[b], sources.amax[b], sources.scale[b], sources.count[b], new_history + row * length,
             new_scale + 4 * row, new_scale_inv + 4 * row, new_count + row, length, margin_steps, margin_rest, fmax,
             algo_max, block_max, block_nan);
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

void launch_delayed_scale_update_many(const float* const* histories, const float* const* amaxes,
                                      const float* const* scales, const int64_t* const* counts, int64_t n,
                                      float* new_history, float* new_scale, float* new_scale_inv, int64_t* new_count,
                                      int64_t length, int margin_steps, float margin_rest, float fmax, bool algo_max,
                                      void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  for (int64_t first = 0; first < n; first += kBatch) {
    const int64_t count = n - first < kBatch ? n - first : kBatch;
    UpdateSources sources = {};
    for (int64_t i = 0; i < count; ++i) {
      sources.history[i] = histories[first + i];
      sources.amax[i] = amaxes[first + i];
      sources.scale[i] = scales[first + i];
      sources.count[i] = counts[first + i];
    }
    delayed_scale_update_many_kernel<<<unsigned(count), kThreads, 0, stream>>>(
        sources, first, new_history, new_scale, new_scale_inv, new_count, length, margin_steps, margin_rest, fmax,
        algo_max);
    check_launch("delayed_scale_update_many");
  }
}

}  // namespace te_fuser
