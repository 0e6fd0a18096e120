// The backward of Bias -> activation for the unary activations: dx = dy · f'(x),
// rounded once to dx's type, and the bias gradient, the fp32 sums over the rows of
// that rounded dx, in one pass over dy and x. f' is computed in fp32 as the
// reference writes it (GELU's through sigmoids, without the cancellations of
// 1 ± tanh). The sums are deterministic: each block adds its tile's rows in order
// into a partial row, and launch_sum_rows adds the tiles' partial rows in order.
#include <cmath>

#include "dispatch.cuh"
#include "fp8_common.cuh"
#include "launchers.cuh"

namespace te_fuser {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTileRows = 64;
constexpr int64_t kMaxTiles = 65535;  // the grid's y extent

constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // 2 √(2/π)
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluC = 0.044715f;
constexpr float kQgeluC = 1.702f;

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

template <int KIND>
__device__ __forceinline__ float activation_grad(float x) {
  if constexpr (KIND == kGradGelu) {
    // 0.5 (1 + tanh u) = sigmoid(2u), 0.5 (1 - tanh² u) = 2 sigmoid(2u) sigmoid(-2u)
    const float two_u = kTwoSqrt2OverPi * (x + kGeluC * x * x * x);
    const float s = sigmoid(two_u), s_neg = sigmoid(-two_u);
    const float d_inner = kSqrt2OverPi * (1.0f + 3.0f * kGeluC * x * x);
    return s + 2.0f * x * s * s_neg * d_inner;
  } else if constexpr (KIND == kGradRelu) {
    return x > 0.0f ? 1.0f : 0.0f;  // NaN: 0, as (x > 0)
  } else if constexpr (KIND == kGradSilu) {
    const float s = sigmoid(x);
    return s * (1.0f + x * (1.0f - s));
  } else if constexpr (KIND == kGradQgelu) {
    const float s = sigmoid(kQgeluC * x);
    return s * (1.0f + kQgeluC * x * (1.0f - s));
  } else {  // kGradSrelu: 2 relu(x), NaN kept as relu keeps it
    return 2.0f * (x > 0.0f || x != x ? x : 0.0f);
  }
}

// Block (x, y): 256 threads over VEC-column chunks, rows [y·tile_rows, (y+1)·tile_rows).
template <typename T, int KIND, int VEC>
__global__ void __launch_bounds__(kThreads)
    dact_dbias_kernel(const T* dy, const T* x, T* dx, float* partials, int64_t rows, int64_t cols,
                      int64_t tile_rows) {
  const int64_t c0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c0 >= cols) return;
  const int64_t r0 = int64_t(blockIdx.y) * tile_rows;
  const int64_t r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
  float sums[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) sums[j] = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t at = r * cols + c0;
    float g[VEC], v[VEC];
    load_vec<VEC>(dy + at, g);
    load_vec<VEC>(x + at, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const T rounded = from_float<T>(g[j] * activation_grad<KIND>(v[j]));
      g[j] = to_float(rounded);  // the value stored, which the sum adds
      sums[j] += g[j];
    }
    store_vec<VEC>(dx + at, g);  // exact: each value is already of T
  }
  float* out = partials + int64_t(blockIdx.y) * cols + c0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = sums[j];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, int KIND>
void launch_kind(const T* dy, const T* x, T* dx, float* partials, int64_t rows, int64_t cols, int64_t tile_rows,
                 int64_t tiles, cudaStream_t stream) {
  const bool vec8 = cols % 8 == 0 && aligned16(dy) && aligned16(x) && aligned16(dx) && aligned16(partials);
  const int64_t chunks = vec8 ? cols / 8 : cols;
  const dim3 grid(unsigned((chunks + kThreads - 1) / kThreads), unsigned(tiles));
  if (vec8) {
    dact_dbias_kernel<T, KIND, 8><<<grid, kThreads, 0, stream>>>(dy, x, dx, partials, rows, cols, tile_rows);
  } else {
    dact_dbias_kernel<T, KIND, 1><<<grid, kThreads, 0, stream>>>(dy, x, dx, partials, rows, cols, tile_rows);
  }
}

}  // namespace

int64_t dact_dbias_tile_rows(int64_t rows) {
  return std::max<int64_t>(kTileRows, (rows + kMaxTiles - 1) / kMaxTiles);
}

void launch_dact_dbias(const void* dy, const void* x, int type, void* dx, float* partials, int64_t rows, int64_t cols,
                       int kind, void* stream) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t tile_rows = dact_dbias_tile_rows(rows);
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_hp(type, "dact_dbias", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* g = static_cast<const T*>(dy);
    const T* v = static_cast<const T*>(x);
    T* out = static_cast<T*>(dx);
    switch (kind) {
      case kGradGelu: launch_kind<T, kGradGelu>(g, v, out, partials, rows, cols, tile_rows, tiles, s); break;
      case kGradRelu: launch_kind<T, kGradRelu>(g, v, out, partials, rows, cols, tile_rows, tiles, s); break;
      case kGradSilu: launch_kind<T, kGradSilu>(g, v, out, partials, rows, cols, tile_rows, tiles, s); break;
      case kGradQgelu: launch_kind<T, kGradQgelu>(g, v, out, partials, rows, cols, tile_rows, tiles, s); break;
      case kGradSrelu: launch_kind<T, kGradSrelu>(g, v, out, partials, rows, cols, tile_rows, tiles, s); break;
      default: throw std::invalid_argument("dact_dbias: unknown activation code " + std::to_string(kind));
    }
  });
  check_launch("dact_dbias");
}

}  // namespace te_fuser
