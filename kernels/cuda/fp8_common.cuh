// Device helpers shared by the FP8 cast kernels: element loads, the saturating
// FP8 rounding, scales from amaxes and E8M0 exponents.
//
// Every helper reproduces kernels/reference/cast.py bit for bit:
//   * x_scaled = x * scale is one fp32 multiply (no FMA can form: nothing is added);
//   * the FP8 value is x_scaled clamped to +-fmax and rounded to nearest, ties to
//     even (cvt.rn.satfinite does both in one instruction); inf and NaN become
//     the NaN byte torch writes (0x7F, plus the sign bit), so an overflow stays
//     visible;
//   * scale = fmax / max(amax, eps) by IEEE division, with the reference's rules
//     for 0, inf, NaN and power-of-2 scales;
//   * amaxes are reduced as the bit patterns of |x|: for non-negative floats the
//     unsigned order is the float order, and any NaN compares above +inf, so a
//     NaN anywhere propagates into the amax as torch.amax does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace te_fuser {

// High-precision input/output types, as passed from Python.
enum HpType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
// FP8 formats, as passed from Python.
enum Fp8Type : int { kE4M3 = 0, kE5M2 = 1 };

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kFltMaxBits = 0x7F7FFFFFu;
constexpr uint32_t kQuietNanBits = 0x7FC00000u;
constexpr uint32_t kMantissaOf1_75 = 0x600000u;  // fmax of both formats is 1.75 * 2**emax

template <int FP8>
struct Fp8Traits;

template <>
struct Fp8Traits<kE4M3> {
  static constexpr float fmax = 448.0f;
  static constexpr int emax = 8;
  static constexpr __nv_fp8_interpretation_t interpretation = __NV_E4M3;
};

template <>
struct Fp8Traits<kE5M2> {
  static constexpr float fmax = 57344.0f;
  static constexpr int emax = 15;
  static constexpr __nv_fp8_interpretation_t interpretation = __NV_E5M2;
};

// ---------------------------------------------------------------------------
// Loads and stores of high-precision elements, converted to/from fp32.
// ---------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Eight consecutive elements as raw 16-byte words, loaded apart from their
// conversion so that several loads can be in flight before the first use.
template <typename T>
struct Raw8 {
  uint4 words[sizeof(T) == 4 ? 2 : 1];
};

template <typename T>
__device__ __forceinline__ Raw8<T> load_raw8(const T* p) {  // p: 16-byte aligned
  Raw8<T> raw;
#pragma unroll
  for (int i = 0; i < int(sizeof(raw.words) / sizeof(uint4)); ++i) raw.words[i] = reinterpret_cast<const uint4*>(p)[i];
  return raw;
}

template <typename T>
__device__ __forceinline__ Raw8<T> zero_raw8() {
  Raw8<T> raw;
#pragma unroll
  for (int i = 0; i < int(sizeof(raw.words) / sizeof(uint4)); ++i) raw.words[i] = make_uint4(0u, 0u, 0u, 0u);
  return raw;
}

__device__ __forceinline__ void unpack8(const Raw8<float>& raw, float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    v[4 * i] = __uint_as_float(raw.words[i].x);
    v[4 * i + 1] = __uint_as_float(raw.words[i].y);
    v[4 * i + 2] = __uint_as_float(raw.words[i].z);
    v[4 * i + 3] = __uint_as_float(raw.words[i].w);
  }
}

__device__ __forceinline__ void unpack8(const Raw8<__nv_bfloat16>& raw, float (&v)[8]) {
  const uint32_t words[4] = {raw.words[0].x, raw.words[0].y, raw.words[0].z, raw.words[0].w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // bf16 -> fp32 is exact: the bf16 bits become the high half of the fp32.
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ void unpack8(const Raw8<__half>& raw, float (&v)[8]) {
  const __half2* pairs = reinterpret_cast<const __half2*>(&raw.words[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(pairs[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// Eight consecutive elements starting at a 16-byte aligned address.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  unpack8(load_raw8(p), v);
}

// Up to eight elements, any alignment: element j is loaded when j < count, else 0.
template <typename T>
__device__ __forceinline__ void load8_partial(const T* p, int count, float (&v)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = j < count ? to_float(p[j]) : 0.0f;
}

// VEC consecutive elements as fp32: eight at a 16-byte aligned address (load8), or
// one by one at any address.
template <int VEC, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[VEC]) {
  if constexpr (VEC == 8) {
    load8(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = to_float(p[j]);
  }
}

__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint32_t bits16(__half v) { return __half_as_ushort(v); }

// Eight consecutive fp32 values stored to a 16-byte aligned address of type T.
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  // bf16 / fp16: pack pairs into 32-bit words, one 16-byte store.
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo_bits = bits16(from_float<T>(v[2 * i]));
    const uint32_t hi_bits = bits16(from_float<T>(v[2 * i + 1]));
    words[i] = lo_bits | (hi_bits << 16);
  }
  *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
}

// VEC fp32 values stored as T: eight to a 16-byte aligned address (store8), or one
// by one to any address, each rounded to the nearest T.
template <int VEC, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[VEC]) {
  if constexpr (VEC == 8) {
    store8(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p[j] = from_float<T>(v[j]);
  }
}

// ---------------------------------------------------------------------------
// FP8 rounding.
// ---------------------------------------------------------------------------

__device__ __forceinline__ bool is_nan_bits(uint32_t bits) { return (bits & kAbsMask) > kInfBits; }
__device__ __forceinline__ bool is_nonfinite_bits(uint32_t bits) { return (bits & kInfBits) == kInfBits; }

// The byte torch writes for a NaN: 0x7F with the sign of the input.
__device__ __forceinline__ uint32_t nan_byte(uint32_t bits) { return 0x7Fu | ((bits >> 24) & 0x80u); }

// fp32 v as v.to(bfloat16) holds it, widened back: the nearest bf16 value, ties
// to even (past the largest bf16, inf), in integer arithmetic; every NaN the NaN
// of CUDA's conversion (bf16 0x7FFF). The same bits as the Triton bf16_value.
__device__ __forceinline__ float bf16_value(float v) {
  const uint32_t bits = __float_as_uint(v);
  if (is_nan_bits(bits)) return __uint_as_float(0x7FFF0000u);
  return __uint_as_float((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
}

// Two fp32 values -> two FP8 bytes (low byte from a): finite values saturating,
// ties to even; inf and NaN the NaN byte with their sign.
template <int FP8>
__device__ __forceinline__ uint32_t fp8x2_from_float(float a, float b) {
  const __nv_fp8x2_storage_t pair =
      __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Fp8Traits<FP8>::interpretation);
  uint32_t lo = pair & 0xFFu;
  uint32_t hi = (pair >> 8) & 0xFFu;
  const uint32_t a_bits = __float_as_uint(a);
  const uint32_t b_bits = __float_as_uint(b);
  if (is_nonfinite_bits(a_bits)) lo = nan_byte(a_bits);
  if (is_nonfinite_bits(b_bits)) hi = nan_byte(b_bits);
  return lo | (hi << 8);
}

// v[j] * scale rounded to FP8, eight values packed into two 32-bit words.
template <int FP8>
__device__ __forceinline__ uint2 scale_to_fp8x8(const float (&v)[8], float scale) {
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint32_t b01 = fp8x2_from_float<FP8>(v[4 * w] * scale, v[4 * w + 1] * scale);
    const uint32_t b23 = fp8x2_from_float<FP8>(v[4 * w + 2] * scale, v[4 * w + 3] * scale);
    words[w] = b01 | (b23 << 16);
  }
  return make_uint2(words[0], words[1]);
}

// ---------------------------------------------------------------------------
// Amaxes and scales.
// ---------------------------------------------------------------------------

// max(|v[j]|) as an fp32 bit pattern, folded into running.
__device__ __forceinline__ uint32_t amax_bits8(const float (&v)[8], uint32_t running) {
#pragma unroll
  for (int j = 0; j < 8; ++j) running = max(running, __float_as_uint(v[j]) & kAbsMask);
  return running;
}

// Block-wide max of an amax bit pattern; every thread gets the result.
// `scratch` holds one word per warp plus one; blockDim.x is a multiple of 32.
__device__ __forceinline__ uint32_t block_max_bits(uint32_t value, uint32_t* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  value = __reduce_max_sync(0xFFFFFFFFu, value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (warp == 0) {
    uint32_t v = lane < warps ? scratch[lane] : 0u;
    v = __reduce_max_sync(0xFFFFFFFFu, v);
    if (lane == 0) scratch[32] = v;
  }
  __syncthreads();
  const uint32_t result = scratch[32];
  __syncthreads();  // scratch may be reused right after
  return result;
}

// fp32 scale for an fp32 amax: the rules of scale_from_amax_reference.
__device__ __forceinline__ float scale_from_amax(float amax, float fmax, bool power_2, float epsilon) {
  if (epsilon > 0.0f && !isnan(amax)) amax = fmaxf(amax, epsilon);  // torch.maximum keeps NaN
  float scale = __fdiv_rn(fmax, amax);
  if (isinf(scale)) scale = __uint_as_float(kFltMaxBits);
  const bool usable = amax > 0.0f && isfinite(amax);
  if (!usable) scale = 1.0f;
  if (power_2) scale = __uint_as_float(__float_as_uint(scale) & kInfBits);
  return scale;
}

// E8M0 byte of an MXFP8 block from its amax bits: 127 + ceil(log2(amax / fmax)).
template <int FP8>
__device__ __forceinline__ uint32_t e8m0_from_amax_bits(uint32_t bits) {
  const int biased = int((bits >> 23) & 0xFFu);
  const uint32_t mantissa = bits & 0x7FFFFFu;
  if (biased == 0) return 0u;     // zero and subnormal amax
  if (biased == 255) return 255u; // inf / NaN
  int byte = biased - Fp8Traits<FP8>::emax + (mantissa > kMantissaOf1_75 ? 1 : 0);
  byte = min(max(byte, 0), 254);
  return uint32_t(byte);
}

// fp32 2**(127 - byte) as the reference builds it (exponent field max(254 - byte, 1)); NaN for 255.
__device__ __forceinline__ float e8m0_reciprocal(uint32_t byte) {
  if (byte == 255u) return __uint_as_float(kQuietNanBits);
  const int field = max(254 - int(byte), 1);
  return __uint_as_float(uint32_t(field) << 23);
}

}  // namespace te_fuser
