// The GEMM epilogue that cuBLASLt cannot fuse: bias, activation and residual
// add in one pass over the GEMM result, in fp32, written once in the output type.
//
// out = activation(y + bias) + residual   (the order of gemm_reference)
// SwiGLU reads the gate from the first half of y's columns and the linear part
// from the second half: out[:, j] = silu(y[:, j] + b[j]) * (y[:, n + j] + b[n + j]).
#include <cmath>

#include "dispatch.cuh"
#include "fp8_common.cuh"
#include "launchers.cuh"

namespace te_fuser {
namespace {

constexpr int kThreads = 256;

// Eight elements of a tensor whose type is known only at run time; kBiasFp32AsBf16
// (a bias only): fp32 values, each rounded to bf16 as it is read.
__device__ __forceinline__ void load8_any(const void* base, int type, int64_t offset, float (&v)[8]) {
  switch (type) {
    case kBFloat16: load8(static_cast<const __nv_bfloat16*>(base) + offset, v); break;
    case kFloat16: load8(static_cast<const __half*>(base) + offset, v); break;
    case kBiasFp32AsBf16:
      load8(static_cast<const float*>(base) + offset, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(__float2bfloat16_rn(v[j]));  // bias.to(bfloat16)
      break;
    default: load8(static_cast<const float*>(base) + offset, v); break;
  }
}

__device__ __forceinline__ float gelu_tanh(float x) {
  const float k_sqrt_2_over_pi = 0.7978845608028654f;
  const float k_cubic = 0.044715f;
  return 0.5f * x * (1.0f + tanhf(k_sqrt_2_over_pi * (x + k_cubic * x * x * x)));
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float relu(float x) { return x < 0.0f ? 0.0f : x; }  // NaN stays NaN

__device__ __forceinline__ float activate(float x, int activation) {
  switch (activation) {
    case kActGelu: return gelu_tanh(x);
    case kActRelu: return relu(x);
    case kActSilu: return silu(x);
    default: return x;
  }
}

template <typename TY, typename TOut>
__global__ void __launch_bounds__(kThreads)
    epilogue_kernel(const TY* y, const void* bias, int bias_type, const void* residual, int residual_type, TOut* out,
                    int64_t rows, int64_t out_cols, int activation) {
  const bool swiglu = activation == kActSwiglu;
  const int64_t in_cols = swiglu ? 2 * out_cols : out_cols;
  const int64_t chunks_per_row = out_cols / 8;
  const int64_t chunks = rows * chunks_per_row;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += stride) {
    const int64_t row = c / chunks_per_row;
    const int64_t col = (c - row * chunks_per_row) * 8;
    float v[8];
    load8(y + row * in_cols + col, v);
    if (bias != nullptr) {
      float b[8];
      load8_any(bias, bias_type, col, b);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += b[j];
    }
    if (swiglu) {
      float up[8];
      load8(y + row * in_cols + out_cols + col, up);
      if (bias != nullptr) {
        float b[8];
        load8_any(bias, bias_type, out_cols + col, b);
#pragma unroll
        for (int j = 0; j < 8; ++j) up[j] += b[j];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = silu(v[j]) * up[j];
    } else if (activation != kActNone) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = activate(v[j], activation);
    }
    if (residual != nullptr) {
      float r[8];
      load8_any(residual, residual_type, row * out_cols + col, r);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += r[j];
    }
    store8(out + row * out_cols + col, v);
  }
}

}  // namespace

void launch_epilogue(const void* y, int y_type, const void* bias, int bias_type, const void* residual,
                     int residual_type, void* out, int out_type, int64_t rows, int64_t out_cols, int activation,
                     void* stream_ptr) {
  if (out_cols % 8 != 0) throw std::invalid_argument("gemm epilogue: output columns must be a multiple of 8");
  if (activation < kActNone || activation > kActSwiglu) throw std::invalid_argument("gemm epilogue: unknown activation");
  if (bias != nullptr && (bias_type < kFloat32 || bias_type > kBiasFp32AsBf16)) {
    throw std::invalid_argument("gemm epilogue: unknown bias type");
  }
  if (residual != nullptr && (residual_type < kFloat32 || residual_type > kFloat16)) {
    throw std::invalid_argument("gemm epilogue: unknown residual type");
  }
  const int64_t chunks = rows * (out_cols / 8);
  if (chunks == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch_hp(y_type, "gemm epilogue (y)", [&](auto y_tag) {
    using TY = typename decltype(y_tag)::type;
    dispatch_hp(out_type, "gemm epilogue (out)", [&](auto out_tag) {
      using TOut = typename decltype(out_tag)::type;
      epilogue_kernel<TY, TOut><<<grid_for(chunks, kThreads), kThreads, 0, stream>>>(
          static_cast<const TY*>(y), bias, bias_type, residual, residual_type, static_cast<TOut*>(out), rows, out_cols,
          activation);
    });
  });
  check_launch("gemm epilogue");
}

}  // namespace te_fuser
