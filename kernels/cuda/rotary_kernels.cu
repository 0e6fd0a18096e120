// Rotary position embedding ("rotate half") of the leading heads of x (rows,
// heads, 2·half), row-major, token row r at position r % T of the fp32 tables
// cos and sin (T, 2·half), whose two halves repeat the same angles:
//
//   y1 = x1·c + (−x2)·s,   y2 = x2·c + x1·s        (s = −sin for the inverse)
//
// each product and the sum rounded in fp32 (__fmul_rn / __fadd_rn: no fused
// multiply-add), the result once to the output type: the reference's bits. The
// heads past `rotated` are copied (converted to the output type); in place the
// launch covers the rotated heads alone and writes them where it read them.
#include "dispatch.cuh"
#include "fp8_common.cuh"
#include "launchers.cuh"

namespace te_fuser {
namespace {

constexpr int kThreads = 256;

// One block per token row; its threads take the row's (head, chunk) items, a chunk
// being VEC consecutive elements of both halves of one head (VEC 8: 16-byte
// aligned loads and stores; 1: any head dim).
template <typename TIn, typename TOut, int VEC>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(const TIn* x, TOut* y, const float* cos, const float* sin, int64_t seq, int heads, int rotated,
                  int covered, int half, float sign) {
  const int64_t row = blockIdx.x;
  const int64_t t = row % seq;
  const int chunks = half / VEC;
  const int items = covered * chunks;
  const float* c_row = cos + t * 2 * half;
  const float* s_row = sin + t * 2 * half;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    const int h = i / chunks;
    const int d = (i - h * chunks) * VEC;
    const int64_t first = (row * heads + h) * 2 * half + d;
    float x1[VEC], x2[VEC];
    load_vec<VEC>(x + first, x1);
    load_vec<VEC>(x + first + half, x2);
    if (h < rotated) {
      float c[VEC], s[VEC];
      load_vec<VEC>(c_row + d, c);
      load_vec<VEC>(s_row + d, s);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float sj = s[j] * sign;  // exact: the sign is +1 or -1
        const float y1 = __fadd_rn(__fmul_rn(x1[j], c[j]), __fmul_rn(-x2[j], sj));
        const float y2 = __fadd_rn(__fmul_rn(x2[j], c[j]), __fmul_rn(x1[j], sj));
        x1[j] = y1;
        x2[j] = y2;
      }
    }
    store_vec<VEC>(y + first, x1);
    store_vec<VEC>(y + first + half, x2);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void launch_rotary(const void* x, int x_type, void* y, int y_type, const float* cos, const float* sin, int64_t rows,
                   int64_t seq, int heads, int rotated, int covered, int half, bool inverse, void* stream) {
  if (rows <= 0 || covered <= 0 || half <= 0) return;
  const bool vec8 = half % 8 == 0 && aligned16(x) && aligned16(y) && aligned16(cos) && aligned16(sin);
  const int items = covered * (vec8 ? half / 8 : half);
  const int threads = std::min(kThreads, (items + 31) / 32 * 32);
  const float sign = inverse ? -1.0f : 1.0f;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_hp(x_type, "rotary", [&](auto in_tag) {
    using TIn = typename decltype(in_tag)::type;
    dispatch_hp(y_type, "rotary", [&](auto out_tag) {
      using TOut = typename decltype(out_tag)::type;
      const TIn* in = static_cast<const TIn*>(x);
      TOut* out = static_cast<TOut*>(y);
      if (vec8) {
        rotary_kernel<TIn, TOut, 8><<<unsigned(rows), threads, 0, s>>>(in, out, cos, sin, seq, heads, rotated,
                                                                        covered, half, sign);
      } else {
        rotary_kernel<TIn, TOut, 1><<<unsigned(rows), threads, 0, s>>>(in, out, cos, sin, seq, heads, rotated,
                                                                        covered, half, sign);
      }
    });
  });
  check_launch("rotary");
}

}  // namespace te_fuser
