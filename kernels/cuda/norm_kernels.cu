// LayerNorm forward and backward (the rules of kernels/reference/norm.py, in fp32).
//
// Forward, one warp per row: the mean, then the biased variance of the centred
// row, rstd = 1 / sqrt(var + eps) (IEEE division and square root), and
// y = (x - mean) * rstd * weight + bias rounded once to y's type. The row is read
// three times; after the first read it comes from L1. Mean and rstd (fp32) are
// kept for the backward.
//
// Backward, two kernels, each adding in a fixed order (the same bits every run):
// - dx, one warp per row: with x̂ = (x - mean) * rstd and g = dy * weight,
//   dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)), rounded once to x's type;
// - dweight and dbias, a tile of 32 columns by a chunk of rows per block: each
//   thread sums dy * x̂ and dy down its column in its rows, the block's rows add
//   up in shared memory (in order of the row lanes), one partial row per chunk;
//   the caller sums the chunks' partial rows.
// Weight and bias are fp32 (the launchers widen other dtypes first).
#include <cmath>

#include "dispatch.cuh"
#include "launchers.cuh"

namespace te_fuser {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kColumns = 32;    // columns of a dweight / dbias tile
constexpr int kRowLanes = 8;    // threads down a tile's rows

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename TX, typename TY>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_kernel(const TX* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias,
                      TY* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                      int64_t n, float eps) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const TX* xr = x + row * n;
  float sum = 0.0f;
  for (int64_t i = lane; i < n; i += 32) sum += to_float(xr[i]);
  const float mean = __fdiv_rn(warp_sum(sum), float(n));
  float squares = 0.0f;
  for (int64_t i = lane; i < n; i += 32) {
    const float d = to_float(xr[i]) - mean;
    squares += d * d;
  }
  const float var = __fdiv_rn(warp_sum(squares), float(n));
  const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(var + eps));
  TY* yr = y + row * n;
  for (int64_t i = lane; i < n; i += 32) yr[i] = from_float<TY>((to_float(xr[i]) - mean) * rstd * weight[i] + bias[i]);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// dx of one row a warp; with TA, plus add (another use's gradient of x) in fp32
// before the one rounding to TX.
template <typename TX, typename TD, typename TA>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_dx_kernel(const TD* __restrict__ dy, const TX* __restrict__ x, const float* __restrict__ weight,
                         const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                         const TA* __restrict__ add, TX* __restrict__ dx, int64_t rows, int64_t n) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const TX* xr = x + row * n;
  const TD* dyr = dy + row * n;
  const float mean = mean_in[row], rstd = rstd_in[row];
  float sum_g = 0.0f, sum_gx = 0.0f;
  for (int64_t i = lane; i < n; i += 32) {
    const float g = to_float(dyr[i]) * weight[i];
    sum_g += g;
    sum_gx += g * ((to_float(xr[i]) - mean) * rstd);
  }
  const float c_g = __fdiv_rn(warp_sum(sum_g), float(n));
  const float c_gx = __fdiv_rn(warp_sum(sum_gx), float(n));
  TX* dxr = dx + row * n;
  for (int64_t i = lane; i < n; i += 32) {
    const float x_hat = (to_float(xr[i]) - mean) * rstd;
    float v = rstd * (to_float(dyr[i]) * weight[i] - c_g - x_hat * c_gx);
    // __fadd_rn: never contracted with the product above into one FMA, so the sum
    // is rounded as autograd's separate addition of the two gradients rounds it
    if (add != nullptr) v = __fadd_rn(v, to_float(add[row * n + i]));
    dxr[i] = from_float<TX>(v);
  }
}

template <typename TX, typename TD>
__global__ void __launch_bounds__(kColumns * kRowLanes)
    layer_norm_dparams_kernel(const TD* __restrict__ dy, const TX* __restrict__ x, const float* __restrict__ mean_in,
                              const float* __restrict__ rstd_in, float* __restrict__ partial, int64_t rows, int64_t n,
                              int64_t rows_per_chunk) {
  __shared__ float tile_w[kRowLanes][kColumns];
  __shared__ float tile_b[kRowLanes][kColumns];
  const int64_t col = int64_t(blockIdx.x) * kColumns + threadIdx.x;
  const int64_t first = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  float dw = 0.0f, db = 0.0f;
  if (col < n) {
    for (int64_t r = first + threadIdx.y; r < last; r += kRowLanes) {
      const float g = to_float(dy[r * n + col]);
      dw += g * ((to_float(x[r * n + col]) - mean_in[r]) * rstd_in[r]);
      db += g;
    }
  }
  tile_w[threadIdx.y][threadIdx.x] = dw;
  tile_b[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y != 0 || col >= n) return;
  for (int j = 1; j < kRowLanes; ++j) {
    dw += tile_w[j][threadIdx.x];
    db += tile_b[j][threadIdx.x];
  }
  const int64_t chunks = gridDim.y;
  partial[int64_t(blockIdx.y) * n + col] = dw;
  partial[(chunks + blockIdx.y) * n + col] = db;
}

unsigned row_blocks(int64_t rows) { return unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

void launch_layer_norm(const void* x, int x_type, const float* weight, const float* bias, void* y, int y_type,
                       float* mean, float* rstd, int64_t rows, int64_t n, float eps, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch_hp(x_type, "layer_norm x", [&](auto xt) {
    using TX = typename decltype(xt)::type;
    dispatch_hp(y_type, "layer_norm y", [&](auto yt) {
      using TY = typename decltype(yt)::type;
      layer_norm_kernel<TX, TY><<<row_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const TX*>(x), weight, bias, static_cast<TY*>(y), mean, rstd, rows, n, eps);
    });
  });
  check_launch("layer_norm");
}

int64_t layer_norm_grad_chunks(int64_t rows, int64_t n) {
  const int64_t column_blocks = (n + kColumns - 1) / kColumns;
  const int64_t wanted = (int64_t(sm_count()) * 4 + column_blocks - 1) / column_blocks;  // about 4 blocks per SM
  const int64_t most = (rows + kRowLanes * 16 - 1) / (kRowLanes * 16);  // at least 16 rows per row lane
  return std::max<int64_t>(1, std::min(wanted, most));
}

void launch_layer_norm_grad(const void* dy, int dy_type, const void* x, int x_type, const float* weight,
                            const float* mean, const float* rstd, const void* add, int add_type, void* dx,
                            float* partial, int64_t rows, int64_t n, int64_t chunks, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  const dim3 tiles(unsigned((n + kColumns - 1) / kColumns), unsigned(chunks));
  dispatch_hp(x_type, "layer_norm_grad x", [&](auto xt) {
    using TX = typename decltype(xt)::type;
    dispatch_hp(dy_type, "layer_norm_grad dy", [&](auto dt) {
      using TD = typename decltype(dt)::type;
      dispatch_hp(add == nullptr ? x_type : add_type, "layer_norm_grad grad_add", [&](auto at) {
        using TA = typename decltype(at)::type;
        layer_norm_dx_kernel<TX, TD, TA><<<row_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const TD*>(dy), static_cast<const TX*>(x), weight, mean, rstd, static_cast<const TA*>(add),
            static_cast<TX*>(dx), rows, n);
      });
      layer_norm_dparams_kernel<TX, TD><<<tiles, dim3(kColumns, kRowLanes), 0, stream>>>(
          static_cast<const TD*>(dy), static_cast<const TX*>(x), mean, rstd, partial, rows, n, rows_per_chunk);
    });
  });
  check_launch("layer_norm_grad");
}

}  // namespace te_fuser
