// LayerNorm forward and backward (the rules of kernels/reference/norm.py, in fp32).
//
// Forward, one warp per row: the mean, then the biased variance of the centred
// row, rstd = 1 / sqrt(var + eps) (IEEE division and square root), and
// y = (x - mean) * rstd * weight + bias rounded once to y's type. The row is read
// three times; after the first read it comes from L1. Mean and rstd (fp32) are
// kept for the backward.
//
// Backward, adding in a fixed order (the same bits every run): with
// x̂ = (x - mean) * rstd and g = dy * weight,
//   dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)), rounded once to x's type,
// and per chunk of rows a partial row of dweight = Σ dy * x̂ and dbias = Σ dy; the
// caller sums the chunks' partial rows in chunk order.
//
// Rows of at most kMaxVectors * 256 columns (a multiple of 8, every pointer on a
// 16-byte boundary) take the register kernels: a lane holds 8 consecutive
// columns of each 256, loaded as 16-byte words, so the row is read from memory
// once. The backward is then one kernel: a block takes a chunk of consecutive
// rows, each warp every fourth of them, and each lane adds its columns' dy * x̂
// and dy in registers (in shared memory past 1024 columns) row after row; the
// block's warps add up in warp order into the chunk's partial row.
// Other rows take the general kernels: one warp a row reading the row from L1
// again for each pass, and the parameter gradients in a second kernel (a tile of
// 32 columns by a chunk of rows a block, the row lanes added up in shared memory
// in order).
// Weight and bias are fp32 (the launchers widen other dtypes first).
#include <cmath>

#include "dispatch.cuh"
#include "launchers.cuh"

namespace te_fuser {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kColumns = 32;    // columns of a dweight / dbias tile
constexpr int kRowLanes = 8;    // threads down a tile's rows
constexpr int kVector = 8;      // consecutive columns a lane holds, per 32 * kVector
constexpr int kWarpSpan = 32 * kVector;
constexpr int kMaxVectors = 8;  // the register kernels' widest row: 2048 columns
constexpr int kRegisterSums = 4;  // up to 4 vectors (1024 columns) the backward sums in registers

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


// ---------------------------------------------------------------------------
// The register kernels. kVectors: the 8-column vectors a lane holds (the row has
// at most 256 * kVectors columns; vector v of lane l starts at column
// (32 v + l) * 8, and the vectors past n are left out).
// ---------------------------------------------------------------------------

template <typename T, int kVectors>
__device__ __forceinline__ void load_row(const T* row, int lane, int64_t n, float (&v)[kVectors][kVector]) {
  Raw8<T> raw[kVectors];
#pragma unroll
  for (int k = 0; k < kVectors; ++k) {  // every load in flight before the first use
    const int64_t col = int64_t(k * 32 + lane) * kVector;
    raw[k] = col < n ? load_raw8(row + col) : zero_raw8<T>();
  }
#pragma unroll
  for (int k = 0; k < kVectors; ++k) unpack8(raw[k], v[k]);
}

template <typename TX, typename TY, int kVectors>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_vector_kernel(const TX* __restrict__ x, const float* __restrict__ weight,
                             const float* __restrict__ bias, TY* __restrict__ y, float* __restrict__ mean_out,
                             float* __restrict__ rstd_out, int64_t rows, int64_t n, float eps) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float v[kVectors][kVector];
  load_row(x + row * n, lane, n, v);
  float sum = 0.0f;  // the vectors past n hold zeros
#pragma unroll
  for (int k = 0; k < kVectors; ++k)
#pragma unroll
    for (int j = 0; j < kVector; ++j) sum += v[k][j];
  const float mean = __fdiv_rn(warp_sum(sum), float(n));
  float squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kVectors; ++k) {
    if (int64_t(k * 32 + lane) * kVector >= n) continue;
#pragma unroll
    for (int j = 0; j < kVector; ++j) {
      const float d = v[k][j] - mean;
      squares += d * d;
    }
  }
  const float var = __fdiv_rn(warp_sum(squares), float(n));
  const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(var + eps));
#pragma unroll
  for (int k = 0; k < kVectors; ++k) {
    const int64_t col = int64_t(k * 32 + lane) * kVector;
    if (col >= n) continue;
    float w[kVector], b[kVector], out[kVector];
    load8(weight + col, w);
    load8(bias + col, b);
#pragma unroll
    for (int j = 0; j < kVector; ++j) out[j] = (v[k][j] - mean) * rstd * w[j] + b[j];
    store8(y + row * n + col, out);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// Eight elements of `add`, whose type is known at run time.
__device__ __forceinline__ void load8_hp(const void* base, int type, int64_t offset, float (&v)[kVector]) {
  switch (type) {
    case kBFloat16: load8(static_cast<const __nv_bfloat16*>(base) + offset, v); break;
    case kFloat16: load8(static_cast<const __half*>(base) + offset, v); break;
    default: load8(static_cast<const float*>(base) + offset, v); break;
  }
}

// The whole backward of a chunk of rows_per_chunk rows a block (see the top);
// partial: (2, gridDim.x, n), dweight's partial rows then dbias's.
template <typename TX, typename TD, int kVectors>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_grad_vector_kernel(const TD* __restrict__ dy, const TX* __restrict__ x,
                                  const float* __restrict__ weight, const float* __restrict__ mean_in,
                                  const float* __restrict__ rstd_in, const void* __restrict__ add, int add_type,
                                  TX* __restrict__ dx, float* __restrict__ partial, int64_t rows, int64_t n,
                                  int64_t rows_per_chunk) {
  constexpr bool kSumsInRegisters = kVectors <= kRegisterSums;
  extern __shared__ float sums[];  // (2, kWarpsPerBlock, n): each warp's dweight row, then its dbias row
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float* warp_dw = sums + int64_t(warp) * n;
  float* warp_db = sums + int64_t(kWarpsPerBlock + warp) * n;
  float dw[kSumsInRegisters ? kVectors : 1][kVector] = {};
  float db[kSumsInRegisters ? kVectors : 1][kVector] = {};
  if constexpr (!kSumsInRegisters) {
    for (int64_t i = lane; i < n; i += 32) {
      warp_dw[i] = 0.0f;
      warp_db[i] = 0.0f;
    }
    __syncwarp();  // a lane adds into columns other lanes zeroed
  }
  const int64_t first = int64_t(blockIdx.x) * rows_per_chunk;
  const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  for (int64_t row = first + warp; row < last; row += kWarpsPerBlock) {
    float g[kVectors][kVector], xv[kVectors][kVector];
    load_row(dy + row * n, lane, n, g);  // dy for now
    load_row(x + row * n, lane, n, xv);
    const float mean = mean_in[row], rstd = rstd_in[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      const int64_t col = int64_t(k * 32 + lane) * kVector;
      if (col >= n) continue;
      float w[kVector];
      load8(weight + col, w);
#pragma unroll
      for (int j = 0; j < kVector; ++j) {
        const float d = g[k][j];
        xv[k][j] = (xv[k][j] - mean) * rstd;  // x̂ from here on
        if constexpr (kSumsInRegisters) {
          dw[k][j] += d * xv[k][j];
          db[k][j] += d;
        } else {
          warp_dw[col + j] += d * xv[k][j];
          warp_db[col + j] += d;
        }
        g[k][j] = d * w[j];  // g = dy * weight from here on
        sum_g += g[k][j];
        sum_gx += g[k][j] * xv[k][j];
      }
    }
    const float c_g = __fdiv_rn(warp_sum(sum_g), float(n));
    const float c_gx = __fdiv_rn(warp_sum(sum_gx), float(n));
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      const int64_t col = int64_t(k * 32 + lane) * kVector;
      if (col >= n) continue;
      float out[kVector], other[kVector];
      if (add != nullptr) load8_hp(add, add_type, row * n + col, other);
#pragma unroll
      for (int j = 0; j < kVector; ++j) {
        out[j] = rstd * (g[k][j] - c_g - xv[k][j] * c_gx);
        // __fadd_rn: never contracted with the product above into one FMA, so the sum
        // is rounded as autograd's separate addition of the two gradients rounds it
        if (add != nullptr) out[j] = __fadd_rn(out[j], other[j]);
      }
      store8(dx + row * n + col, out);
    }
  }
  if constexpr (kSumsInRegisters) {
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      const int64_t col = int64_t(k * 32 + lane) * kVector;
      if (col >= n) continue;
#pragma unroll
      for (int j = 0; j < kVector; ++j) {
        warp_dw[col + j] = dw[k][j];
        warp_db[col + j] = db[k][j];
      }
    }
  }
  __syncthreads();
  float* chunk_dw = partial + int64_t(blockIdx.x) * n;
  float* chunk_db = partial + (int64_t(gridDim.x) + blockIdx.x) * n;
  for (int64_t i = threadIdx.x; i < n; i += kWarpsPerBlock * 32) {
    float sum_w = sums[i], sum_b = sums[int64_t(kWarpsPerBlock) * n + i];
#pragma unroll
    for (int w = 1; w < kWarpsPerBlock; ++w) {  // in warp order
      sum_w += sums[int64_t(w) * n + i];
      sum_b += sums[int64_t(kWarpsPerBlock + w) * n + i];
    }
    chunk_dw[i] = sum_w;
    chunk_db[i] = sum_b;
  }
}

unsigned row_blocks(int64_t rows) { return unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

// The vectors a lane holds for a row of n columns, or 0 where the row takes the
// general kernels.
int vectors_for(int64_t n) {
  if (n <= 0 || n % kVector != 0 || n > int64_t(kMaxVectors) * kWarpSpan) return 0;
  const int64_t needed = (n + kWarpSpan - 1) / kWarpSpan;
  return needed <= 1 ? 1 : needed <= 2 ? 2 : needed <= 4 ? 4 : 8;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f(std::integral_constant<int, V>{}) for a vectors_for value.
template <typename F>
void dispatch_vectors(int vectors, F&& f) {
  switch (vectors) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

size_t grad_shared_bytes(int64_t n) { return size_t(2 * kWarpsPerBlock) * size_t(n) * sizeof(float); }

// Blocks of the register backward that fit on the device at once, with the
// shared memory of its widest row (cached per device and instantiation, which
// also raises the kernel's shared memory limit there): the chunks of its rows.
template <typename TX, typename TD, int kVectors>
int64_t resident_grad_blocks() {
  static int per_sm[64] = {0};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= 64) device = 0;
  if (per_sm[device] == 0) {
    auto kernel = layer_norm_grad_vector_kernel<TX, TD, kVectors>;
    const size_t shared = grad_shared_bytes(int64_t(kVectors) * kWarpSpan);
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)),
               "layer_norm_grad shared memory");
    int blocks = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kWarpsPerBlock * 32, shared),
               "layer_norm_grad occupancy");
    per_sm[device] = std::max(blocks, 1);
  }
  return int64_t(per_sm[device]) * sm_count();
}

}  // namespace

void launch_layer_norm(const void* x, int x_type, const float* weight, const float* bias, void* y, int y_type,
                       float* mean, float* rstd, int64_t rows, int64_t n, float eps, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int vectors = aligned16(x) && aligned16(weight) && aligned16(bias) && aligned16(y) ? vectors_for(n) : 0;
  dispatch_hp(x_type, "layer_norm x", [&](auto xt) {
    using TX = typename decltype(xt)::type;
    dispatch_hp(y_type, "layer_norm y", [&](auto yt) {
      using TY = typename decltype(yt)::type;
      if (vectors == 0) {
        layer_norm_kernel<TX, TY><<<row_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const TX*>(x), weight, bias, static_cast<TY*>(y), mean, rstd, rows, n, eps);
        return;
      }
      dispatch_vectors(vectors, [&](auto v) {
        layer_norm_vector_kernel<TX, TY, decltype(v)::value><<<row_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const TX*>(x), weight, bias, static_cast<TY*>(y), mean, rstd, rows, n, eps);
      });
    });
  });
  check_launch("layer_norm");
}

int64_t layer_norm_grad_chunks(int64_t rows, int64_t n, int x_type, int dy_type) {
  const int vectors = vectors_for(n);
  if (vectors > 0) {  // the register backward: a chunk a resident block, every warp a row or more
    int64_t resident = 1;
    dispatch_hp(x_type, "layer_norm_grad x", [&](auto xt) {
      dispatch_hp(dy_type, "layer_norm_grad dy", [&](auto dt) {
        dispatch_vectors(vectors, [&](auto v) {
          resident = resident_grad_blocks<typename decltype(xt)::type, typename decltype(dt)::type,
                                          decltype(v)::value>();
        });
      });
    });
    const int64_t most = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    const int64_t chunks = std::max<int64_t>(1, std::min(resident, most));
    const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
    return (rows + rows_per_chunk - 1) / rows_per_chunk;  // no chunk without rows
  }
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
  const bool aligned = aligned16(dy) && aligned16(x) && aligned16(weight) && aligned16(dx) &&
                       (add == nullptr || aligned16(add));
  const int vectors = aligned ? vectors_for(n) : 0;
  dispatch_hp(x_type, "layer_norm_grad x", [&](auto xt) {
    using TX = typename decltype(xt)::type;
    dispatch_hp(dy_type, "layer_norm_grad dy", [&](auto dt) {
      using TD = typename decltype(dt)::type;
      if (vectors > 0) {
        if (add != nullptr) dispatch_hp(add_type, "layer_norm_grad grad_add", [](auto) {});  // an unknown code throws
        dispatch_vectors(vectors, [&](auto v) {
          constexpr int kVectors = decltype(v)::value;
          resident_grad_blocks<TX, TD, kVectors>();  // raises the kernel's shared memory limit on this device
          layer_norm_grad_vector_kernel<TX, TD, kVectors>
              <<<unsigned(chunks), kWarpsPerBlock * 32, grad_shared_bytes(n), stream>>>(
                  static_cast<const TD*>(dy), static_cast<const TX*>(x), weight, mean, rstd, add, add_type,
                  static_cast<TX*>(dx), partial, rows, n, rows_per_chunk);
        });
        return;
      }
      const dim3 tiles(unsigned((n + kColumns - 1) / kColumns), unsigned(chunks));
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
