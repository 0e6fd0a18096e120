// FP8 cast kernels: amax, tensor-scaled casts (delayed and current scaling) with
// an optional transposed copy, one-scale-per-row casts and MXFP8.
//
// Numerics follow kernels/reference/cast.py bit for bit (see fp8_common.cuh).
// Inputs are contiguous and 16-byte aligned (the Python launchers ensure it);
// vector accesses are 16 bytes per thread wherever the shape allows.
#include <cooperative_groups.h>

#include <map>
#include <mutex>
#include <utility>

#include "dispatch.cuh"
#include "fp8_common.cuh"
#include "launchers.cuh"
#include "scaling_update.cuh"

namespace te_fuser {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 16;   // elements per thread per step of the flat kernels
constexpr int kUnroll = 2;   // steps whose loads are in flight together
constexpr int kTile = 128;   // cast-transpose tile: kTile x kTile elements
constexpr int kTileWords = kTile / 4 + 1;     // staged FP8 tile row: 32 words + 1 against bank conflicts
constexpr int kThreadsPerTileRow = kTile / 8;  // each thread loads 8 consecutive elements
constexpr int kTileRowsPerPass = kThreads / kThreadsPerTileRow;
static_assert(kThreads == kUpdateThreads && kTile * kTileWords >= 2 * kUpdateThreads,
              "the one-launch cast's block 0 runs the state update in its shared tile");

// Current scaling's amax: given (amax_in), or the maximum of the amax pass's
// per-block partials, which every block of the cast reduces itself (so no amax
// needs zeroing first). All threads of the block take part; block (0, 0)'s
// first thread publishes the total.
__device__ __forceinline__ float current_amax(const CastScaling& s, uint32_t* scratch) {
  if (s.amax_partials == nullptr) return *s.amax_in;
  uint32_t bits = 0u;
  for (int64_t i = threadIdx.x; i < s.amax_partial_count; i += blockDim.x) bits = max(bits, s.amax_partials[i]);
  return __uint_as_float(block_max_bits(bits, scratch));
}

// The scale of a tensor-scaled cast: given (delayed) or derived from the amax
// (current), whose scale, reciprocal and (reduced from partials) total the first
// thread writes once.
template <int FP8, bool CURRENT>
__device__ __forceinline__ float cast_scale(const CastScaling& s, uint32_t* scratch, bool first_thread) {
  if (!CURRENT) return *s.scale;
  // read through bf16, the amax of the rounded x: rounding is monotonic, so that is x's amax rounded
  const float amax = s.round_bf16 ? bf16_value(current_amax(s, scratch)) : current_amax(s, scratch);
  const float scale = scale_from_amax(amax, Fp8Traits<FP8>::fmax, s.power_2, s.epsilon);
  if (first_thread) {
    *s.scale_out = scale;
    *s.scale_inv_out = __fdiv_rn(1.0f, scale);
    if (s.amax_partials != nullptr) *s.amax_total_out = amax;
  }
  return scale;
}

// Reduce the block's amax bits and fold them into the tensor's amax.
__device__ __forceinline__ void commit_amax(uint32_t amax_bits, float* amax_out, uint32_t* scratch) {
  amax_bits = block_max_bits(amax_bits, scratch);
  if (threadIdx.x == 0 && amax_bits != 0u) atomicMax(reinterpret_cast<unsigned int*>(amax_out), amax_bits);
}

// Raw loads of kUnroll grid-stride chunks (16 elements each) starting at chunk
// c0; chunks past the end read as zeros. All loads issue before any is used.
template <typename T>
__device__ __forceinline__ void load_chunks(const T* __restrict__ x, int64_t c0, int64_t stride, int64_t chunks,
                                            Raw8<T> (&raw)[kUnroll][2]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t c = c0 + u * stride;
    if (c < chunks) {
      raw[u][0] = load_raw8(x + c * kChunk);
      raw[u][1] = load_raw8(x + c * kChunk + 8);
    } else {
      raw[u][0] = raw[u][1] = zero_raw8<T>();
    }
  }
}

// amax(|x|): folded into amax_out (zeroed first) with an atomic, or with PARTIALS
// each block's maximum (fp32 bits) written to partials[blockIdx.x], for the cast
// that follows to reduce.
// This thread's share of amax(|x|) over `numel` elements (fp32 bits): grid-stride
// 16-element chunks, block 0 taking the tail.
template <typename T>
__device__ __forceinline__ uint32_t amax_share(const T* __restrict__ x, int64_t numel) {
  uint32_t amax = 0u;
  const int64_t chunks = numel / kChunk;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c0 < chunks; c0 += kUnroll * stride) {
    Raw8<T> raw[kUnroll][2];
    load_chunks(x, c0, stride, chunks, raw);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float v0[8], v1[8];
      unpack8(raw[u][0], v0);
      unpack8(raw[u][1], v1);
      amax = amax_bits8(v1, amax_bits8(v0, amax));  // zero padding does not change it
    }
  }
  const int64_t tail = numel - chunks * kChunk;  // < 16 elements
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    amax = max(amax, __float_as_uint(to_float(x[chunks * kChunk + threadIdx.x])) & kAbsMask);
  }
  return amax;
}

template <typename T, bool PARTIALS>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ x, int64_t numel, float* amax_out, uint32_t* partials) {
  __shared__ uint32_t scratch[33];
  uint32_t amax = amax_share(x, numel);
  if (PARTIALS) {
    amax = block_max_bits(amax, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = amax;
  } else {
    commit_amax(amax, amax_out, scratch);
  }
}

// A column's total into out[i]: fp32, or rounded once to bf16 (nearest, ties to even).
__device__ __forceinline__ void store_total(void* out, int64_t i, float total, bool as_bf16) {
  if (as_bf16) {
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(total);
  } else {
    static_cast<float*>(out)[i] = total;
  }
}

// Sums the rows of partials (batches, rows, cols), fp32, one thread per column of
// a batch (blockIdx.y) adding the rows in order: the same bits on every run.
__global__ void __launch_bounds__(kThreads)
    sum_rows_kernel(const float* __restrict__ partials, int64_t rows, int64_t cols, void* __restrict__ out,
                    bool out_bf16) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const float* batch = partials + int64_t(blockIdx.y) * rows * cols;
  float total = 0.0f;
  for (int64_t r = 0; r < rows; ++r) total += batch[r * cols + col];
  store_total(out, int64_t(blockIdx.y) * cols + col, total, out_bf16);
}

// Flat cast of `numel` elements (no transposed copy). `out` may be null.
template <typename T, int FP8, bool CURRENT>
__global__ void __launch_bounds__(kThreads)
    cast_flat_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, int64_t numel, CastScaling s) {
  __shared__ uint32_t scratch[33];
  const float scale = cast_scale<FP8, CURRENT>(s, scratch, blockIdx.x == 0 && threadIdx.x == 0);
  uint32_t amax = 0u;
  const int64_t chunks = numel / kChunk;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c0 < chunks; c0 += kUnroll * stride) {
    Raw8<T> raw[kUnroll][2];
    load_chunks(x, c0, stride, chunks, raw);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * stride;
      if (c >= chunks) continue;
      float v0[8], v1[8];
      unpack8(raw[u][0], v0);
      unpack8(raw[u][1], v1);
      if (!CURRENT) amax = amax_bits8(v1, amax_bits8(v0, amax));
      if (out != nullptr) {
        const uint2 q0 = scale_to_fp8x8<FP8>(v0, scale);
        const uint2 q1 = scale_to_fp8x8<FP8>(v1, scale);
        *reinterpret_cast<uint4*>(out + c * kChunk) = make_uint4(q0.x, q0.y, q1.x, q1.y);
      }
    }
  }
  const int64_t tail = numel - chunks * kChunk;
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    const int64_t i = chunks * kChunk + threadIdx.x;
    const float v = to_float(x[i]);
    amax = max(amax, __float_as_uint(v) & kAbsMask);
    if (out != nullptr) out[i] = uint8_t(fp8x2_from_float<FP8>(v * scale, 0.0f) & 0xFFu);
  }
  if (!CURRENT) commit_amax(amax, s.amax_out, scratch);
}

// Eight values rounded to bf16 in place (bf16_value).
__device__ __forceinline__ void round8_bf16(float (&v)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = bf16_value(v[j]);
}

// How many of the next 8 elements exist, given `remaining` elements to the end of the row.
__device__ __forceinline__ int elements_left(int64_t remaining) {
  return remaining <= 0 ? 0 : (remaining >= 8 ? 8 : int(remaining));
}

// Byte j of a little-endian word.
__device__ __forceinline__ uint32_t byte_of(uint32_t word, int j) { return (word >> (8 * j)) & 0xFFu; }

// Writes the staged FP8 tile transposed: out_t[col][row] for the tile at (row0, col0).
// Each thread moves 4x4 blocks of bytes (four 32-bit reads, four 32-bit writes);
// consecutive lanes take consecutive 4-row groups, so a warp writes 128
// contiguous bytes of one out_t row.
__device__ __forceinline__ void write_transposed_tile(const uint32_t* tile, uint8_t* __restrict__ out_t, int64_t rows,
                                                      int64_t cols, int64_t row0, int64_t col0) {
  constexpr int kGroups = kTile / 4;  // 4-row (and 4-column) groups per tile side
#pragma unroll
  for (int step = 0; step < kGroups * kGroups / kThreads; ++step) {
    const int index = step * kThreads + threadIdx.x;
    const int row_group = index % kGroups;  // source rows row_group * 4 ...
    const int col_group = index / kGroups;  // source columns col_group * 4 ...
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = tile[(row_group * 4 + i) * kTileWords + col_group];
    const int64_t row = row0 + row_group * 4;
    if (row >= rows) continue;
    const bool whole_word = (rows % 4 == 0) && (row + 4 <= rows);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = col0 + col_group * 4 + j;
      if (col >= cols) continue;
      const uint32_t packed =
          byte_of(w[0], j) | (byte_of(w[1], j) << 8) | (byte_of(w[2], j) << 16) | (byte_of(w[3], j) << 24);
      uint8_t* dst = out_t + col * rows + row;
      if (whole_word) {
        *reinterpret_cast<uint32_t*>(dst) = packed;
      } else {
        for (int i = 0; i < 4 && row + i < rows; ++i) dst[i] = uint8_t(byte_of(packed, i));
      }
    }
  }
}

// Casts this thread's 8 elements of tile row r and stages them in the shared tile;
// `count` elements exist (8 and vector_ok: 16-byte accesses).
template <int FP8>
__device__ __forceinline__ void cast_tile_piece(const float (&v)[8], float scale, int count, bool vector_ok,
                                                    uint8_t* __restrict__ out, int64_t offset, uint32_t* tile, int r,
                                                    int c) {
  const uint2 q = scale_to_fp8x8<FP8>(v, scale);
  if (out != nullptr && count > 0) {
    if (count == 8 && vector_ok) {
      *reinterpret_cast<uint2*>(out + offset) = q;
    } else {
      for (int j = 0; j < count; ++j) out[offset + j] = uint8_t(byte_of(j < 4 ? q.x : q.y, j % 4));
    }
  }
  tile[r * kTileWords + c / 4] = q.x;
  tile[r * kTileWords + c / 4 + 1] = q.y;
}

// Cast of the kTile x kTile tile at (row0, col0) of x (rows, cols) with a
// transposed copy, by one block: out (rows, cols) may be null, out_t (cols, rows)
// is not; the FP8 bytes are staged in the shared `tile`. Whole tiles issue kGroup
// 16-byte loads per thread before using any of them; edge tiles go element by
// element. SUMS: each thread also adds up its 8 columns over its rows, the block
// adds the threads of each column in a fixed order (through the shared
// `column_sums`), and the tile's column sums go to row `tile_row` of
// s.column_partials. s.round_bf16: the cast and the amax read each value rounded to
// bf16, the sums the value as loaded. Returns this thread's amax bits of the tile
// under delayed scaling (zero under current scaling, whose amax comes first).
template <typename T, int FP8, bool CURRENT, bool SUMS>
__device__ __forceinline__ uint32_t cast_tile(const T* __restrict__ x, uint8_t* __restrict__ out,
                                              uint8_t* __restrict__ out_t, int64_t rows, int64_t cols,
                                              const CastScaling& s, float scale, int64_t row0, int64_t col0,
                                              int64_t tile_row, uint32_t* tile, float* column_sums) {
  constexpr int kPasses = kTile / kTileRowsPerPass;
  constexpr int kGroup = 4;
  float sums[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const bool vector_ok = cols % 8 == 0;
  const bool whole_tile = vector_ok && row0 + kTile <= rows && col0 + kTile <= cols;
  const int c = (threadIdx.x % kThreadsPerTileRow) * 8;  // column of this thread's 8 elements in the tile
  const int r_first = threadIdx.x / kThreadsPerTileRow;
  uint32_t amax = 0u;
  if (whole_tile) {
#pragma unroll
    for (int g = 0; g < kPasses; g += kGroup) {
      float v[kGroup][8];
#pragma unroll
      for (int p = 0; p < kGroup; ++p) {
        load8(x + (row0 + (g + p) * kTileRowsPerPass + r_first) * cols + col0 + c, v[p]);
      }
#pragma unroll
      for (int p = 0; p < kGroup; ++p) {
        const int r = (g + p) * kTileRowsPerPass + r_first;
        if (SUMS) {
#pragma unroll
          for (int j = 0; j < 8; ++j) sums[j] += v[p][j];
        }
        if (s.round_bf16) round8_bf16(v[p]);
        if (!CURRENT) amax = amax_bits8(v[p], amax);
        cast_tile_piece<FP8>(v[p], scale, 8, true, out, (row0 + r) * cols + col0 + c, tile, r, c);
      }
    }
  } else {
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = pass * kTileRowsPerPass + r_first;
      const int64_t row = row0 + r;
      const int64_t col = col0 + c;
      const int count = row < rows ? elements_left(cols - col) : 0;
      const int64_t offset = row * cols + col;
      float v[8];
      if (count == 8 && vector_ok) {
        load8(x + offset, v);
      } else {
        load8_partial(x + offset, count, v);
      }
      if (SUMS) {
#pragma unroll
        for (int j = 0; j < 8; ++j) sums[j] += v[j];  // zeros past the edge
      }
      if (s.round_bf16) round8_bf16(v);
      if (!CURRENT) amax = amax_bits8(v, amax);
      cast_tile_piece<FP8>(v, scale, count, vector_ok, out, offset, tile, r, c);
    }
  }
  if (SUMS) {
#pragma unroll
    for (int j = 0; j < 8; ++j) column_sums[r_first * kTile + c + j] = sums[j];
  }
  __syncthreads();
  if (SUMS && threadIdx.x < kTile && col0 + threadIdx.x < cols) {
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < kTileRowsPerPass; ++r) total += column_sums[r * kTile + threadIdx.x];
    s.column_partials[tile_row * cols + col0 + threadIdx.x] = total;
  }
  write_transposed_tile(tile, out_t, rows, cols, row0, col0);
  return amax;
}

// One kTile x kTile tile per block (blockIdx.x: column tile, blockIdx.y: row tile);
// delayed scaling's amax folded into s.amax_out (zeroed first) with an atomic.
template <typename T, int FP8, bool CURRENT, bool SUMS>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t rows,
                          int64_t cols, CastScaling s) {
  __shared__ uint32_t tile[kTile * kTileWords];
  __shared__ uint32_t scratch[33];
  __shared__ float column_sums[SUMS ? kTileRowsPerPass * kTile : 1];
  const float scale = cast_scale<FP8, CURRENT>(s, scratch, blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0);
  const uint32_t amax = cast_tile<T, FP8, CURRENT, SUMS>(x, out, out_t, rows, cols, s, scale, int64_t(blockIdx.y) * kTile,
                                                         int64_t(blockIdx.x) * kTile, blockIdx.y, tile, column_sums);
  if (!CURRENT) commit_amax(amax, s.amax_out, scratch);
}

// Delayed scaling's state update by the one-launch cast's block 0, from the amax it
// wrote, with the shared tile as the update's scratch. Its parameters come as a
// kernel argument of their own: inside CastScaling they changed the code of every
// variant of the cast (48 -> 54-60 registers a thread, one resident block an SM
// fewer, sm_90 builds); apart, every variant keeps its registers.
__device__ __forceinline__ void update_after_cast(const CastScaling& s, const DelayedUpdate& u, uint32_t* tile) {
  update_one(u.history, s.amax_out, s.scale, u.count, u.new_history, u.new_scale, u.new_scale_inv, u.new_count,
             u.length, u.margin_steps, u.margin_rest, u.fmax, u.algo_max, reinterpret_cast<float*>(tile),
             reinterpret_cast<int*>(tile + kUpdateThreads));
}

// The whole transposing cast in one cooperative launch (every block resident, so
// the grid can wait on itself): under current scaling without a given amax, the
// amax pass, each block's maximum into s.block_partials, and a grid barrier; then
// the blocks cast tiles blockIdx.x, + gridDim.x, ... Under delayed scaling the
// blocks' maxima go to s.block_partials and block 0 writes their maximum to
// s.amax_out (nothing zeroed first); with SUMS, after a grid barrier, the tiles'
// column sums added up over the row tiles in order into s.sums_out (the bits of
// sum_rows_kernel). The bits of the separate launches, with one launch.
template <typename T, int FP8, bool CURRENT, bool SUMS>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_one_launch_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                     int64_t rows, int64_t cols, CastScaling s, DelayedUpdate update) {
  __shared__ uint32_t tile[kTile * kTileWords];
  __shared__ uint32_t scratch[33];
  __shared__ float column_sums[SUMS ? kTileRowsPerPass * kTile : 1];
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  if (CURRENT && s.amax_in == nullptr) {
    const uint32_t bits = block_max_bits(amax_share(x, rows * cols), scratch);
    if (threadIdx.x == 0) s.block_partials[blockIdx.x] = bits;
    grid.sync();  // (cast_scale then reads them as s.amax_partials)
  }
  const float scale = cast_scale<FP8, CURRENT>(s, scratch, blockIdx.x == 0 && threadIdx.x == 0);
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  const int64_t tiles = (rows + kTile - 1) / kTile * col_tiles;
  uint32_t amax = 0u;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t tile_row = t / col_tiles;
    amax = max(amax, cast_tile<T, FP8, CURRENT, SUMS>(x, out, out_t, rows, cols, s, scale, tile_row * kTile,
                                                      (t % col_tiles) * kTile, tile_row, tile, column_sums));
    __syncthreads();  // the next tile reuses the shared tile
  }
  if (CURRENT && !SUMS) return;
  if (!CURRENT) {
    amax = block_max_bits(amax, scratch);
    if (threadIdx.x == 0) s.block_partials[blockIdx.x] = amax;
  }
  grid.sync();
  if (!CURRENT && blockIdx.x == 0) {
    uint32_t bits = 0u;
    for (int64_t i = threadIdx.x; i < gridDim.x; i += blockDim.x) bits = max(bits, s.block_partials[i]);
    bits = block_max_bits(bits, scratch);
    if (threadIdx.x == 0) *s.amax_out = __uint_as_float(bits);
  }
  if (SUMS) {
    const int64_t row_tiles = (rows + kTile - 1) / kTile;
    for (int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; col < cols;
         col += int64_t(gridDim.x) * blockDim.x) {
      float total = 0.0f;
      for (int64_t r = 0; r < row_tiles; ++r) total += s.column_partials[r * cols + col];
      store_total(s.sums_out, col, total, s.sums_bf16);
    }
  }
  if (!CURRENT && blockIdx.x == 0 && update.new_history != nullptr) {
    __syncthreads();  // thread 0's amax_out is seen, and the shared tile is free
    update_after_cast(s, update, tile);
  }
}

// One block per row: amax of the row, its scale, then the cast (the second read
// of the row comes from cache). A two-way unrolled version of these loops ran
// about 7% slower on an H200 (one run each), so they stay simple.
template <typename T, int FP8>
__global__ void __launch_bounds__(kThreads)
    quantize_rowwise_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, float* __restrict__ scale_inv,
                            int64_t cols, bool power_2, float epsilon) {
  __shared__ uint32_t scratch[33];
  const int64_t row = blockIdx.x;
  const T* x_row = x + row * cols;
  uint8_t* out_row = out + row * cols;
  const bool vector_ok = cols % 8 == 0;
  const int64_t step = int64_t(blockDim.x) * 8;
  uint32_t amax = 0u;
  for (int64_t col = int64_t(threadIdx.x) * 8; col < cols; col += step) {
    const int count = elements_left(cols - col);
    float v[8];
    if (count == 8 && vector_ok) load8(x_row + col, v); else load8_partial(x_row + col, count, v);
    amax = amax_bits8(v, amax);
  }
  amax = block_max_bits(amax, scratch);
  const float scale = scale_from_amax(__uint_as_float(amax), Fp8Traits<FP8>::fmax, power_2, epsilon);
  if (threadIdx.x == 0) scale_inv[row] = __fdiv_rn(1.0f, scale);
  for (int64_t col = int64_t(threadIdx.x) * 8; col < cols; col += step) {
    const int count = elements_left(cols - col);
    float v[8];
    if (count == 8 && vector_ok) load8(x_row + col, v); else load8_partial(x_row + col, count, v);
    const uint2 q = scale_to_fp8x8<FP8>(v, scale);
    if (count == 8 && vector_ok) {
      *reinterpret_cast<uint2*>(out_row + col) = q;
    } else {
      for (int j = 0; j < count; ++j) out_row[col + j] = uint8_t(byte_of(j < 4 ? q.x : q.y, j % 4));
    }
  }
}

// MXFP8: each thread casts 8 elements; four neighbouring lanes form one 32-element
// block and share its amax through two shuffles. Warps step through the tensor
// together so every shuffle has all 32 lanes present; each step loads kUnroll
// warp-wide spans before using them.
template <typename T, int FP8>
__global__ void __launch_bounds__(kThreads)
    quantize_mxfp8_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, uint8_t* __restrict__ scales,
                          int64_t chunks) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t base = warp * 32 * kUnroll; base < chunks; base += warps * 32 * kUnroll) {
    Raw8<T> raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;
      raw[u] = c < chunks ? load_raw8(x + c * 8) : zero_raw8<T>();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;
      float v[8];
      unpack8(raw[u], v);
      uint32_t amax = amax_bits8(v, 0u);
      amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
      amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      if (c < chunks) {
        const uint32_t byte = e8m0_from_amax_bits<FP8>(amax);
        *reinterpret_cast<uint2*>(out + c * 8) = scale_to_fp8x8<FP8>(v, e8m0_reciprocal(byte));
        if ((lane & 3) == 0) scales[c >> 2] = uint8_t(byte);
      }
    }
  }
}

// Blocks of the amax pass and of the flat cast.
unsigned amax_grid(int64_t numel) { return grid_for((numel / kChunk + kUnroll - 1) / kUnroll, kThreads); }

template <typename T, int FP8>
using OneLaunchKernel = void (*)(const T*, uint8_t*, uint8_t*, int64_t, int64_t, CastScaling, DelayedUpdate);

template <typename T, int FP8>
OneLaunchKernel<T, FP8> one_launch_kernel(bool current, bool sums) {
  if (current) {
    return sums ? &cast_transpose_one_launch_kernel<T, FP8, true, true>
                : &cast_transpose_one_launch_kernel<T, FP8, true, false>;
  }
  return sums ? &cast_transpose_one_launch_kernel<T, FP8, false, true>
              : &cast_transpose_one_launch_kernel<T, FP8, false, false>;
}

// How many blocks of `kernel` the current device holds at once (0 without
// cooperative launches), asked once per kernel and device.
int64_t resident_blocks(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int64_t> kept;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  const auto found = kept.find(key);
  if (found != kept.end()) return found->second;
  int cooperative = 0, per_sm = 0;
  check_cuda(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device), "cudaDeviceGetAttribute");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0), "cast (occupancy)");
  const int64_t blocks = cooperative ? int64_t(per_sm) * sm_count() : 0;
  kept.emplace(key, blocks);
  return blocks;
}

bool one_launch_enabled = true;
bool one_launch_in_capture = true;

}  // namespace

bool set_one_launch_casts(bool enable) {
  const bool previous = one_launch_enabled;
  one_launch_enabled = enable;
  return previous;
}

bool set_one_launch_casts_in_capture(bool enable) {
  const bool previous = one_launch_in_capture;
  one_launch_in_capture = enable;
  return previous;
}

int64_t cast_one_launch_blocks(int hp_type, int fp8_type, bool current, bool sums, int64_t rows, int64_t cols,
                               void* stream_ptr) {
  if (!one_launch_enabled || rows <= 0 || cols <= 0) return 0;
  if (!one_launch_in_capture) {  // a cooperative launch captured becomes a cooperative kernel node of the graph
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream_ptr), &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) return 0;
  }
  const int64_t tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
  int64_t resident = 0;
  dispatch_hp(hp_type, "cast", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_fp8(fp8_type, "cast", [&](auto fp8) {
      constexpr int FP8 = decltype(fp8)::value;
      resident = resident_blocks(reinterpret_cast<const void*>(one_launch_kernel<T, FP8>(current, sums)));
    });
  });
  return std::min(tiles, resident);
}

void launch_amax(const void* x, int hp_type, int64_t numel, float* amax_out, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  check_cuda(cudaMemsetAsync(amax_out, 0, sizeof(float), stream), "amax (zeroing)");
  if (numel == 0) return;
  dispatch_hp(hp_type, "amax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    amax_kernel<T, false><<<amax_grid(numel), kThreads, 0, stream>>>(static_cast<const T*>(x), numel, amax_out,
                                                                     nullptr);
  });
  check_launch("amax");
}

int64_t amax_partial_count(int64_t numel) { return numel == 0 ? 0 : int64_t(amax_grid(numel)); }

void launch_amax_partials(const void* x, int hp_type, int64_t numel, uint32_t* partials, void* stream_ptr) {
  if (numel == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch_hp(hp_type, "amax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    amax_kernel<T, true><<<amax_grid(numel), kThreads, 0, stream>>>(static_cast<const T*>(x), numel, nullptr,
                                                                    partials);
  });
  check_launch("amax");
}

void launch_sum_rows(const float* partials, int64_t batches, int64_t rows, int64_t cols, void* out,
                     void* stream_ptr, bool out_bf16) {
  if (cols == 0 || batches == 0) return;
  if (batches > 65535) throw std::invalid_argument("sum_rows: at most 65535 batches");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const dim3 grid(unsigned((cols + kThreads - 1) / kThreads), unsigned(batches));
  sum_rows_kernel<<<grid, kThreads, 0, stream>>>(partials, rows, cols, out, out_bf16);
  check_launch("sum_rows");
}

void launch_cast(const void* x, int hp_type, int fp8_type, int64_t rows, int64_t cols, uint8_t* out, uint8_t* out_t,
                 const CastScaling& scaling, void* stream_ptr, const DelayedUpdate& update) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const bool current = scaling.amax_in != nullptr || scaling.amax_partials != nullptr;
  const int64_t numel = rows * cols;
  const bool transpose = out_t != nullptr && numel > 0;
  if (scaling.column_partials != nullptr && !transpose) {
    throw std::invalid_argument("cast: column sums come with a cast that writes the transposed copy");
  }
  if (scaling.round_bf16 && !transpose) {
    throw std::invalid_argument("cast: a cast through bf16 (round_bf16) is one that writes the transposed copy");
  }
  if (transpose && scaling.one_launch_blocks > 0) {
    dispatch_hp(hp_type, "cast", [&](auto tag) {
      using T = typename decltype(tag)::type;
      dispatch_fp8(fp8_type, "cast", [&](auto fp8) {
        constexpr int FP8 = decltype(fp8)::value;
        cudaLaunchAttribute cooperative;
        cooperative.id = cudaLaunchAttributeCooperative;
        cooperative.val.cooperative = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(unsigned(scaling.one_launch_blocks));
        config.blockDim = dim3(kThreads);
        config.dynamicSmemBytes = 0;
        config.stream = stream;
        config.attrs = &cooperative;
        config.numAttrs = 1;
        const OneLaunchKernel<T, FP8> kernel = one_launch_kernel<T, FP8>(current, scaling.column_partials != nullptr);
        check_cuda(cudaLaunchKernelEx(&config, kernel, static_cast<const T*>(x), out, out_t, rows, cols, scaling,
                                      update),
                   "cast_transpose (one launch)");
      });
    });
    return;
  }
  if (!current) check_cuda(cudaMemsetAsync(scaling.amax_out, 0, sizeof(float), stream), "cast (zeroing amax)");
  dispatch_hp(hp_type, "cast", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_fp8(fp8_type, "cast", [&](auto fp8) {
      constexpr int FP8 = decltype(fp8)::value;
      const T* xt = static_cast<const T*>(x);
      if (transpose) {
        const int64_t row_tiles = (rows + kTile - 1) / kTile;
        if (row_tiles > 65535) throw std::invalid_argument("cast: a transposed copy supports at most 8388480 rows");
        const dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned(row_tiles));
        if (current && scaling.column_partials != nullptr) {
          cast_transpose_kernel<T, FP8, true, true><<<grid, kThreads, 0, stream>>>(xt, out, out_t, rows, cols,
                                                                                  scaling);
        } else if (current) {
          cast_transpose_kernel<T, FP8, true, false><<<grid, kThreads, 0, stream>>>(xt, out, out_t, rows, cols,
                                                                                   scaling);
        } else if (scaling.column_partials != nullptr) {
          cast_transpose_kernel<T, FP8, false, true><<<grid, kThreads, 0, stream>>>(xt, out, out_t, rows, cols,
                                                                                   scaling);
        } else {
          cast_transpose_kernel<T, FP8, false, false><<<grid, kThreads, 0, stream>>>(xt, out, out_t, rows, cols,
                                                                                    scaling);
        }
      } else {
        const unsigned grid = amax_grid(numel);
        if (current) {
          cast_flat_kernel<T, FP8, true><<<grid, kThreads, 0, stream>>>(xt, out, numel, scaling);
        } else {
          cast_flat_kernel<T, FP8, false><<<grid, kThreads, 0, stream>>>(xt, out, numel, scaling);
        }
      }
    });
  });
  check_launch(transpose ? "cast_transpose" : "cast");
}

void launch_quantize_rowwise(const void* x, int hp_type, int fp8_type, int64_t rows, int64_t cols, uint8_t* out,
                             float* scale_inv, bool power_2, float epsilon, void* stream_ptr) {
  if (rows == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // Enough warps to cover a row in one 8-element step, up to kThreads.
  const int64_t lanes = (cols + 7) / 8;
  const int threads = int(std::min<int64_t>(kThreads, std::max<int64_t>(32, (lanes + 31) / 32 * 32)));
  dispatch_hp(hp_type, "quantize_rowwise", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_fp8(fp8_type, "quantize_rowwise", [&](auto fp8) {
      constexpr int FP8 = decltype(fp8)::value;
      quantize_rowwise_kernel<T, FP8><<<unsigned(rows), threads, 0, stream>>>(static_cast<const T*>(x), out, scale_inv,
                                                                              cols, power_2, epsilon);
    });
  });
  check_launch("quantize_rowwise");
}

void launch_quantize_mxfp8(const void* x, int hp_type, int fp8_type, int64_t numel, uint8_t* out, uint8_t* scales,
                           void* stream_ptr) {
  if (numel == 0) return;
  if (numel % 32 != 0) throw std::invalid_argument("quantize_mxfp8: numel must be a multiple of 32");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t chunks = numel / 8;
  dispatch_hp(hp_type, "quantize_mxfp8", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_fp8(fp8_type, "quantize_mxfp8", [&](auto fp8) {
      constexpr int FP8 = decltype(fp8)::value;
      const unsigned grid = grid_for((chunks + kUnroll - 1) / kUnroll, kThreads);
      quantize_mxfp8_kernel<T, FP8><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), out, scales, chunks);
    });
  });
  check_launch("quantize_mxfp8");
}

}  // namespace te_fuser
