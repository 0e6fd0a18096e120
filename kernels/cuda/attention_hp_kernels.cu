// bf16 / fp16 flash attention forward for Hopper (sm_90a), hand-written on the
// FP8 kernel's block (attention_common.cuh): a producer warpgroup copying Q once
// and each key tile's K and V into a ring, two consumer warpgroups of 64 query rows
// taking turns at the tensor cores. What it is for: one C++ call a forward, where
// cuDNN's fused attention through torch's SDPA operator costs several times the
// host time (benchmarks/RESULTS.md, run 175), at the GPU time of a flash kernel.
//
// Meaning and rounding are the Triton forward's (kernels/triton/attention.py):
// s = softmax_scale · log2 e · (q kᵀ) in fp32 from the tensor cores, the online
// softmax in base 2, p = exp2(s - m) rounded to the input type for P V, the row
// sums of the unrounded p, O accumulated in the tensor cores' fp32 accumulator
// (rescaled by exp2(m_old - m_new) in registers before each tile's P V), o = O / l
// rounded once, lse = (m + log2 l) · ln 2.
//
// Tiles in shared memory: rows of D 16-bit elements are stored as D / 64 column
// blocks of 128 rows x 128 bytes under the 128-byte swizzle (the 16-byte chunk c of
// row r at c ^ (r mod 8)). For S = Q Kᵀ both are K-major (the head dim along the
// rows). For P V the V tile is read as it lies, keys along its rows and the head
// dim contiguous: the B operand "MN-major" (transposed in wgmma's terms), whose
// descriptor names the stride between 8-key groups (1024 bytes) and between
// 64-column blocks (a block's 16 KiB). P needs no reordering: the A operand of a
// 16-bit k16 step has the accumulator's layout, so the S registers of keys
// 16k .. 16k + 15, rounded in pairs, are step k's A fragment.
#include "attention_common.cuh"
#include "dispatch.cuh"
#include "launchers.cuh"

namespace te_fuser {
namespace {

using namespace attention;

constexpr int kBlockBytes = 128 * 128;  // one 64-column block of a 128-row tile

// ---------------------------------------------------------------------------
// The 16-bit products (attention_common.cuh's TE_WGMMA).
// ---------------------------------------------------------------------------

// d (=|+=) a·b, 64 x 128 x 16: a (64 x 16) and b (128 x 16) K-major in shared memory.
template <bool F16>
__device__ __forceinline__ void hmma_scores_first(float (&d)[64], uint64_t a, uint64_t b) {
  if constexpr (F16) {
    asm volatile(TE_WGMMA("m64n128k16", "f16.f16", 0, TE_R64, "%64, %65", "1, 1, 0, 0") : TE_D64("=f")
                 : "l"(a), "l"(b));
  } else {
    asm volatile(TE_WGMMA("m64n128k16", "bf16.bf16", 0, TE_R64, "%64, %65", "1, 1, 0, 0") : TE_D64("=f")
                 : "l"(a), "l"(b));
  }
}
template <bool F16>
__device__ __forceinline__ void hmma_scores(float (&d)[64], uint64_t a, uint64_t b) {
  if constexpr (F16) {
    asm volatile(TE_WGMMA("m64n128k16", "f16.f16", 1, TE_R64, "%64, %65", "1, 1, 0, 0") : TE_D64("+f")
                 : "l"(a), "l"(b));
  } else {
    asm volatile(TE_WGMMA("m64n128k16", "bf16.bf16", 1, TE_R64, "%64, %65", "1, 1, 0, 0") : TE_D64("+f")
                 : "l"(a), "l"(b));
  }
}

// d += a·b, 64 x D x 16: a (64 x 16) in registers (the A fragment), b (16 x D)
// MN-major in shared memory (the V tile as it lies: the transpose immediate 1).
template <int D, bool F16>
__device__ __forceinline__ void hmma_values(float (&d)[D / 2], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (D == 128 && F16) {
    asm volatile(TE_WGMMA("m64n128k16", "f16.f16", 1, TE_R64, "{%64, %65, %66, %67}, %68", "1, 1, 1")
                 : TE_D64("+f") : TE_A_OPERANDS);
  } else if constexpr (D == 128) {
    asm volatile(TE_WGMMA("m64n128k16", "bf16.bf16", 1, TE_R64, "{%64, %65, %66, %67}, %68", "1, 1, 1")
                 : TE_D64("+f") : TE_A_OPERANDS);
  } else if constexpr (F16) {
    asm volatile(TE_WGMMA("m64n64k16", "f16.f16", 1, TE_R32, "{%32, %33, %34, %35}, %36", "1, 1, 1")
                 : TE_D32("+f") : TE_A_OPERANDS);
  } else {
    asm volatile(TE_WGMMA("m64n64k16", "bf16.bf16", 1, TE_R32, "{%32, %33, %34, %35}, %36", "1, 1, 1")
                 : TE_D32("+f") : TE_A_OPERANDS);
  }
}

// The descriptor of an MN-major tile (the V tile): 128-byte swizzle, 8-row groups
// 1024 bytes apart, 64-column blocks kBlockBytes apart. Adding 128 moves it 16 rows
// (the next k16 step).
__device__ __forceinline__ uint64_t mn_descriptor(uint32_t addr) {
  constexpr uint64_t block_stride = kBlockBytes >> 4, group_stride = 1024 >> 4;
  return uint64_t((addr >> 4) & 0x3FFFu) | (block_stride << 16) | (group_stride << 32) | (uint64_t(1) << 62);
}

// Two probabilities rounded to the input type, the first in the low half.
template <bool F16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (F16) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Shared memory of a block: two Q buffers, then the ring of K and V tiles (stages:
// 192 and 128 KiB with the Q buffers), then the barriers.
constexpr int hp_stages(int d) { return d == 128 ? 2 : 3; }
constexpr int hp_tile(int d) { return kBlockN * d * 2; }  // a K or V tile (and a Q block: kBlockM == kBlockN)
template <int D>
struct HpSmem : RingBarriers<hp_stages(D), (2 + 2 * hp_stages(D)) * hp_tile(D)> {
  static constexpr int tile = hp_tile(D);
  static constexpr int q_bytes = tile;
  static constexpr int q = 0;
  static constexpr int k = q + 2 * tile;
  static constexpr int v = k + hp_stages(D) * tile;
};

// Byte offset of the 16-byte chunk c (elements 8c .. 8c + 7) of row r in a tile.
__device__ __forceinline__ uint32_t tile_offset(int r, int c) {
  return uint32_t(c / 8) * kBlockBytes + swizzled<128>(r, c % 8);
}

// 128 rows from `rows` (the first at `first`, `stride` elements apart, rows at or
// past `end` zero) into the tile at `tile`, this thread's share of the copies.
template <int D, typename T>
__device__ __forceinline__ void copy_rows(uint32_t tile, const T* rows, int64_t stride, int first, int end, int tid) {
  constexpr int chunks = D / 8;
  for (int i = tid; i < 128 * chunks; i += kWarpgroup) {
    const int r = i / chunks, c = i % chunks;
    const bool ok = first + r < end;
    copy16(tile + tile_offset(r, c), ok ? rows + int64_t(first + r) * stride + c * 8 : rows, ok);
  }
}

// The producer warpgroup for item n (its first tile the block's t0): Q, then K and V
// of every key tile (produce_ring).
template <int D, typename T>
__device__ __forceinline__ void produce(const AttentionHpArgs& a, uint32_t base, const BlockWork& w, int n, int t0,
                                        int tid) {
  using S = HpSmem<D>;
  const T* q = static_cast<const T*>(a.q) + int64_t(w.b) * a.q_stride_b + int64_t(w.h) * a.q_stride_h;
  const T* k = static_cast<const T*>(a.k) + int64_t(w.b) * a.k_stride_b + int64_t(w.hk) * a.k_stride_h;
  const T* v = static_cast<const T*>(a.v) + int64_t(w.b) * a.v_stride_b + int64_t(w.hk) * a.v_stride_h;
  produce_ring<S>(
      base, n, t0, w.tiles,
      [&](int buffer) { copy_rows<D>(base + S::q + buffer * S::q_bytes, q, a.q_stride_t, w.m0, a.tq, tid); },
      [&](int j, int s) {
        copy_rows<D>(base + S::k + s * S::tile, k, a.k_stride_t, j * kBlockN, a.tk, tid);
        copy_rows<D>(base + S::v + s * S::tile, v, a.v_stride_t, j * kBlockN, a.tk, tid);  // zeros past tk
      });
}

// A consumer warpgroup on item n (its first tile the block's t0): each tile's S =
// Q Kᵀ (its turn at the tensor cores), the softmax, O rescaled, O += P V; its Q
// buffer released, then o and lse.
template <int D, bool CAUSAL, typename T>
__device__ __forceinline__ void consume(const AttentionHpArgs& a, uint32_t base, const BlockWork& w, int n, int t0,
                                        int group, int tid) {
  using S = HpSmem<D>;
  constexpr bool f16 = std::is_same<T, __half>::value;
  ConsumerRows rows = ConsumerRows::of(w.m0, group, tid, a.qk_scale, 0.0f);
  float acc[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;
  uint64_t q_desc[D / 64];  // this warpgroup's 64 rows of each 64-column block of Q
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk) {
    q_desc[blk] = tile_descriptor<128>(base + S::q + (n % 2) * S::q_bytes + 64 * group * 128 + blk * kBlockBytes);
  }
  const Turns turns{a.turns, group, w.tiles};
  turns.start();
  wait_q<S>(base, n);
  for (int j = 0; j < w.tiles; ++j) {
    const int s = (t0 + j) % S::stages;
    wait_tile<S>(base, t0 + j);
    const uint32_t k_tile = base + S::k + s * S::tile;
    const uint64_t v_desc = mn_descriptor(base + S::v + s * S::tile);
    uint64_t k_desc[D / 64];  // per 64-column block, made before the fence
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk) k_desc[blk] = tile_descriptor<128>(k_tile + blk * kBlockBytes);
    float sc[64];
    turns.take();
    mma_fence();
    hmma_scores_first<f16>(sc, q_desc[0], k_desc[0]);
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk) {  // 32 bytes (16 elements) a step within a column block
      hmma_scores<f16>(sc, q_desc[kk / 4] + 2 * (kk % 4), k_desc[kk / 4] + 2 * (kk % 4));
    }
    mma_commit();
    mma_wait_all();
    fence_registers(sc);
    turns.pass(j);
    float alpha[2];
    softmax_rows<CAUSAL>(sc, alpha, rows, j * kBlockN, a.tk);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] *= alpha[(i / 2) % 2];
    uint32_t p[kBlockN / 16][4];  // all of P before the fence (see attention_kernels.cu's descriptors)
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {  // keys 16kk .. 16kk + 15: S columns 8kk .. 8kk + 7
#pragma unroll
      for (int w2 = 0; w2 < 4; ++w2) p[kk][w2] = pack2<f16>(sc[8 * kk + 2 * w2], sc[8 * kk + 2 * w2 + 1]);
    }
    mma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) hmma_values<D, f16>(acc, p[kk], v_desc + 128 * kk);
    mma_commit();
    mma_wait_all();
    fence_registers(acc);
    release_tile<S>(base, t0 + j);  // its K and V read
  }
  release_q<S>(base, n);
  store_rows<D, T>(a, acc, rows, 1.0f, w.b, w.h, tid % 32);
}

template <int D, bool CAUSAL, typename T>
__global__ void __launch_bounds__(kForwardThreads, 1)
    attention_hp_forward_kernel(const __grid_constant__ AttentionHpArgs a) {
  extern __shared__ uint8_t smem_raw[];
  run_block<HpSmem<D>, CAUSAL>(
      a, smem_raw,
      [&](uint32_t base, const BlockWork& w, int n, int t0, int tid) { produce<D, T>(a, base, w, n, t0, tid); },
      [&](uint32_t base, const BlockWork& w, int n, int t0, int group, int tid) {
        consume<D, CAUSAL, T>(a, base, w, n, t0, group, tid);
      });
}

template <int D, bool CAUSAL, typename T>
void launch_forward(const AttentionHpArgs& a, cudaStream_t stream) {
  launch_blocks<attention_hp_forward_kernel<D, CAUSAL, T>, HpSmem<D>>(a, stream, "attention_hp_forward");
}

template <typename T>
void launch_typed(const AttentionHpArgs& a, cudaStream_t stream) {
  if (a.head_dim == 128) {
    a.causal ? launch_forward<128, true, T>(a, stream) : launch_forward<128, false, T>(a, stream);
  } else if (a.head_dim == 64) {
    a.causal ? launch_forward<64, true, T>(a, stream) : launch_forward<64, false, T>(a, stream);
  } else {
    throw std::invalid_argument("attention_hp_forward: head dim " + std::to_string(a.head_dim) +
                                " is not 64 or 128");
  }
}

}  // namespace

void launch_attention_hp_forward(const AttentionHpArgs& a, int type, void* stream) {
  if (a.batch <= 0 || a.h <= 0 || a.tq <= 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (type == kBFloat16) {
    launch_typed<__nv_bfloat16>(a, s);
  } else if (type == kFloat16) {
    launch_typed<__half>(a, s);
  } else {
    throw std::invalid_argument("attention_hp_forward: the inputs must be bfloat16 or float16 (type code " +
                                std::to_string(type) + ")");
  }
}

}  // namespace te_fuser
