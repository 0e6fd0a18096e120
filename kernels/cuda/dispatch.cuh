// Host-side helpers of the launchers: type dispatch, grid sizing, error checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fp8_common.cuh"

namespace te_fuser {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with T the C++ type of a high-precision type code.
template <typename F>
void dispatch_hp(int hp_type, const char* what, F&& f) {
  switch (hp_type) {
    case kFloat32: f(TypeTag<float>{}); break;
    case kBFloat16: f(TypeTag<__nv_bfloat16>{}); break;
    case kFloat16: f(TypeTag<__half>{}); break;
    default: throw std::invalid_argument(std::string(what) + ": unknown high-precision type code " + std::to_string(hp_type));
  }
}

// Calls f(std::integral_constant<int, FP8>{}) for an FP8 type code.
template <typename F>
void dispatch_fp8(int fp8_type, const char* what, F&& f) {
  switch (fp8_type) {
    case kE4M3: f(std::integral_constant<int, kE4M3>{}); break;
    case kE5M2: f(std::integral_constant<int, kE5M2>{}); break;
    default: throw std::invalid_argument(std::string(what) + ": unknown FP8 type code " + std::to_string(fp8_type));
  }
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("te_fuser CUDA kernel ") + what + " failed: " + cudaGetErrorString(err));
  }
}

inline void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

// Multiprocessors of the current device (cached per device).
inline int sm_count() {
  static int counts[64] = {0};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= 64) device = 0;
  if (counts[device] == 0) {
    int value = 0;
    check_cuda(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    counts[device] = std::max(value, 1);
  }
  return counts[device];
}

// Blocks of `threads` for a grid-stride loop over `items` work items: enough to
// fill every multiprocessor `waves` times, never more than the items need, at least 1.
inline unsigned grid_for(int64_t items, int threads, int waves = 8) {
  const int64_t needed = (items + threads - 1) / threads;
  const int64_t cap = int64_t(sm_count()) * waves;
  return unsigned(std::max<int64_t>(1, std::min(needed, cap)));
}

}  // namespace te_fuser
