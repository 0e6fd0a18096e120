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

// ---------------------------------------------------------------------------
// The backward's dk and dv (the Triton dk / dv kernel's meaning, kernels/triton/
// attention.py): a block holds 128 keys of one kv head (K and V copied once) and
// works through 64-query steps of every query head that reads it (causal: from the
// step of its first key); each consumer warpgroup owns 64 of the keys and keeps
// their dk and dv in fp32 registers across the steps, products kept transposed
// (keys along the rows):
//   Sᵀ = K Qᵀ and dPᵀ = V doᵀ issued together, Pᵀ = exp2(Sᵀ · qk_scale - lse ·
//   log2 e) (masked) while dPᵀ runs, dv += Pᵀ do, dSᵀ = Pᵀ ∘ (dPᵀ - delta) while
//   that runs, dk += dSᵀ q; dk · softmax_scale at the end.
// Pᵀ and dSᵀ are rounded to the input type as the A operand of their products (the
// accumulator's layout, as P in the forward); q and do are the B operand of those
// MN-major (queries along their rows), of Sᵀ and dPᵀ K-major. One producer thread
// copies by tensor maps; no atomics: every dk, dv is written once, by its block.
// ---------------------------------------------------------------------------

constexpr int kStepRows = 64;  // queries a step
constexpr int kDkdvStages = 2;

// d (=|+=) a·b, 64 x 64 x 16, a and b in shared memory: K-major (a 64 x 16, b 64 x
// 16), or with MN (both MN-major: a 16 x 64, b 16 x 64, as they lie along the rows).
template <bool F16, bool FIRST, bool MN = false>
__device__ __forceinline__ void hmma_n64(float (&d)[32], uint64_t a, uint64_t b) {
  if constexpr (F16 && FIRST) {
    asm volatile(TE_WGMMA("m64n64k16", "f16.f16", 0, TE_R32, "%32, %33", "1, 1, %34, %34") : TE_D32("=f")
                 : "l"(a), "l"(b), "n"(int(MN)));
  } else if constexpr (F16) {
    asm volatile(TE_WGMMA("m64n64k16", "f16.f16", 1, TE_R32, "%32, %33", "1, 1, %34, %34") : TE_D32("+f")
                 : "l"(a), "l"(b), "n"(int(MN)));
  } else if constexpr (FIRST) {
    asm volatile(TE_WGMMA("m64n64k16", "bf16.bf16", 0, TE_R32, "%32, %33", "1, 1, %34, %34") : TE_D32("=f")
                 : "l"(a), "l"(b), "n"(int(MN)));
  } else {
    asm volatile(TE_WGMMA("m64n64k16", "bf16.bf16", 1, TE_R32, "%32, %33", "1, 1, %34, %34") : TE_D32("+f")
                 : "l"(a), "l"(b), "n"(int(MN)));
  }
}

// d = a · bᵀ over the head dim, 64 x 64: a 64 rows of a 128-row tile (its D / 64
// column blocks' descriptors), b a 64-row step (likewise).
template <int D, bool F16>
__device__ __forceinline__ void hmma_rows(float (&d)[32], const uint64_t (&a)[D / 64], const uint64_t (&b)[D / 64]) {
  hmma_n64<F16, true>(d, a[0], b[0]);
#pragma unroll
  for (int kk = 1; kk < D / 16; ++kk) hmma_n64<F16, false>(d, a[kk / 4] + 2 * (kk % 4), b[kk / 4] + 2 * (kk % 4));
}

// The descriptor of a 64-row step read MN-major (queries along its rows): 8-row
// groups 1024 bytes apart, 64-column blocks a step block apart; + 128: 16 rows on.
__device__ __forceinline__ uint64_t step_mn_descriptor(uint32_t addr) {
  constexpr uint64_t block_stride = (kStepRows * 128) >> 4, group_stride = 1024 >> 4;
  return uint64_t((addr >> 4) & 0x3FFFu) | (block_stride << 16) | (group_stride << 32) | (uint64_t(1) << 62);
}

// Shared memory of a backward block: a pair of held tiles (128 rows each, copied
// once: K and V; kBlockBytes a 64-column block), then a ring of STAGES steps, each a
// pair of 64-row tiles (q and do; 8 KiB a column block), then, where the block adds
// its share of dq (DQ), two dSᵀ buffers (128 keys x 64 queries, 16-bit, rows of 128
// bytes under the 128-byte swizzle) and two dq buffers (64 queries x D fp32, in the
// accumulators' order: float4 j of thread slot t at 16·(j·slots + t)), then a
// step's per-query columns a stage (lse · log2 e and delta, 512 bytes), then the
// barriers: q_full(0) for the held pair, full / empty a stage, then (DQ) dq_full /
// dq_empty a dq buffer and ds_full / ds_empty a dSᵀ buffer, then (DQ) two words for
// the chunk the consumers claim (store_ready_dq). One producer thread copies (its
// arrival brings the bytes).
constexpr int kDsBytes = kBlockN * kStepRows * 2;
__host__ __device__ constexpr int dq_chunk_bytes(int d) { return kStepRows * d * 4; }
// The threads that write a dq buffer: both warpgroups at head dim 128, one at 64.
__host__ __device__ constexpr int dq_slots(int d) { return d == 128 ? 2 * kWarpgroup : kWarpgroup; }
// A step's per-query columns: lse · log2 e, then delta, 64 fp32 each (the rows
// buffer's chunk, made before the kernel: zeros past Tq).
constexpr int kColumnsBytes = 2 * kStepRows * 4;

// The query steps of a (batch, head): its dq chunks and per-query column chunks,
// 64 queries each.
__host__ __device__ __forceinline__ int dq_steps(const AttentionBwdArgs& a) {
  return (a.tq + kStepRows - 1) / kStepRows;
}
constexpr int bwd_buffer_bytes(int d, int stages, bool dq) {
  return 2 * kBlockN * d * 2 + stages * 2 * kStepRows * d * 2 + (dq ? 2 * kDsBytes + 2 * dq_chunk_bytes(d) : 0) +
         stages * kColumnsBytes;
}
template <int D, int STAGES, bool DQ = false>
struct BwdSmem : RingBarriers<STAGES, bwd_buffer_bytes(D, STAGES, DQ)> {
  using Ring = RingBarriers<STAGES, bwd_buffer_bytes(D, STAGES, DQ)>;
  static constexpr int bytes = Ring::bytes + (DQ ? 8 * 8 + 8 : 0);
  static constexpr int head_dim = D;
  static constexpr int held_bytes = kBlockN * D * 2;
  static constexpr int step_bytes = kStepRows * D * 2;
  static constexpr int step_block = kStepRows * 128;
  static constexpr int producer_arrivals = 1;
  template <bool CAUSAL>
  static constexpr int producer_registers = 24;  // 128 · 24 + 256 · 240: the 384 · 168 the block starts with
  template <bool CAUSAL>
  static constexpr int consumer_registers = 240;
  static __device__ __forceinline__ uint32_t held(uint32_t base, int i) { return base + i * held_bytes; }
  static __device__ __forceinline__ uint32_t step(uint32_t base, int s, int i) {
    return base + 2 * held_bytes + (2 * s + i) * step_bytes;
  }
  static __device__ __forceinline__ uint32_t ds(uint32_t base, int i) {
    return base + 2 * held_bytes + 2 * STAGES * step_bytes + i * kDsBytes;
  }
  static __device__ __forceinline__ uint32_t dq(uint32_t base, int i) { return ds(base, 2) + i * dq_chunk_bytes(D); }
  static constexpr int columns_at = bwd_buffer_bytes(D, STAGES, DQ) - STAGES * kColumnsBytes;
  static __device__ __forceinline__ uint32_t columns(uint32_t base, int s) {
    return base + columns_at + s * kColumnsBytes;
  }
  static __device__ __forceinline__ uint32_t dq_full(uint32_t base, int i) { return base + Ring::bytes + 8 * i; }
  static __device__ __forceinline__ uint32_t dq_empty(uint32_t base, int i) {
    return base + Ring::bytes + 16 + 8 * i;
  }
  static __device__ __forceinline__ uint32_t ds_full(uint32_t base, int i) { return base + Ring::bytes + 32 + 8 * i; }
  static __device__ __forceinline__ uint32_t ds_empty(uint32_t base, int i) {
    return base + Ring::bytes + 48 + 8 * i;
  }
  // the chunk the consumers' leader claimed in round r (store_ready_dq), two in turn
  static __device__ __forceinline__ uint32_t claim(uint32_t base, int r) { return base + Ring::bytes + 64 + 4 * (r % 2); }
};

// The tensor maps of a backward block's held pair (boxes of 64 columns x 128 rows)
// and step pair (64 x 64), as bytes: (2·D, T, heads, batch).
struct BwdMaps {
  CUtensorMap held[2], step[2];
};

// The dq adds' order across blocks (a turn counter per dq chunk in global memory):
// an acquiring read, a releasing add, the bulk copies of shared memory to global
// (a plain store, or an fp32 add there) and their completion.
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_store(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_add(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all_but_newest() {
  asm volatile("cp.async.bulk.wait_group 1;\n" ::: "memory");
}
__device__ __forceinline__ int load_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// The producer of a backward block, one thread: the held pair (head held_head, its
// 128 rows from held_row), then step j's pair at (head, first row) = at(j) and its
// per-query columns (a.rows) for each of `steps` steps, into the ring once both
// consumers released the stage.
// One bulk copy of `bytes` (a multiple of 16, both ends 16-byte aligned) from global
// memory into shared memory, completing that many bytes of barrier `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

template <typename S, int IN = 0, typename At>
__device__ __forceinline__ void produce_bwd(const BwdMaps& maps, uint32_t base, int b, int held_head, int held_row,
                                            int steps, At at, const AttentionBwdArgs& a) {
  constexpr int D = S::head_dim, STAGES = S::stages;
  const uint32_t held = S::q_full(base, 0);
  barrier_arrive_expect_bytes(held, 2 * S::held_bytes);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk) {
      tensor_copy_4d(S::held(base, i) + blk * kBlockBytes, &maps.held[i], 128 * blk, held_row, held_head, b, held);
    }
  }
  for (int j = 0; j < steps; ++j) {
    const int s = j % STAGES;
    if (j >= STAGES) barrier_wait(S::empty(base, s), ((j / STAGES) - 1) & 1);
    const uint32_t full = S::full(base, s);
    const int2 where = at(j);  // (head, first row)
    const int64_t chunk = (int64_t(b) * a.h + where.x) * dq_steps(a) + where.y / kStepRows;
    // delta made in the kernel (a.delta_ready): the chunk's first reader, key block m / 2,
    // leaves it in the stage itself (lse alone copied); any other block copies the
    // chunk's columns once they are flagged
    uint32_t columns_bytes = kColumnsBytes;
    if constexpr ((IN & kDeltaInKernel) != 0) {
      if (where.y / kStepRows / 2 == held_row / kBlockN) {
        columns_bytes = kStepRows * 4;
      } else {
        while (load_acquire(a.delta_ready + chunk) == 0) __nanosleep(64);
        fence_async_global();
      }
    }
    barrier_arrive_expect_bytes(full, 2 * S::step_bytes + columns_bytes);
    bulk_copy(S::columns(base, s), a.rows + chunk * (2 * kStepRows), columns_bytes, full);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int blk = 0; blk < D / 64; ++blk) {
        tensor_copy_4d(S::step(base, s, i) + blk * S::step_block, &maps.step[i], 128 * blk, where.y, where.x, b,
                       full);
      }
    }
  }
}

// The tensor map of a 16-bit (B, heads, T, D) operand, as bytes, read in boxes of
// 64 columns x `rows` rows.
inline CUtensorMap rows_map(const void* data, int batch, int heads, int t, int d, int64_t sb, int64_t sh, int64_t st,
                            int rows, const char* what) {
  return byte_tensor_map<4>(data, {uint64_t(2 * d), uint64_t(t), uint64_t(heads), uint64_t(batch)},
                            {uint64_t(2 * st), uint64_t(2 * sh), uint64_t(2 * sb)}, {128u, uint32_t(rows), 1u, 1u},
                            what);
}

// The steps of a block: 64-query steps of each of the G query heads of kv head hk,
// from `first` (causal: the step of the block's first key) to tq.
struct DkdvWork {
  int b, hk, n0, first, per_head, steps;
  // The grid (launch_dkdv): dq (write_dq's order), x the key blocks from the last
  // down, y the (batch, kv head)s; else x the (batch, kv head)s, y the key blocks,
  // so that every kv head's first (causal: longest) block runs before any second.
  static __device__ __forceinline__ DkdvWork of(const AttentionBwdArgs& a, bool causal, bool dq) {
    DkdvWork w;
    const int bh = dq ? blockIdx.y : blockIdx.x;
    w.b = bh / a.hkv;
    w.hk = bh % a.hkv;
    w.n0 = (dq ? gridDim.x - 1 - blockIdx.x : blockIdx.y) * kBlockN;
    w.first = causal ? w.n0 / kStepRows * kStepRows : 0;
    w.per_head = w.first < a.tq ? (a.tq - w.first + kStepRows - 1) / kStepRows : 0;
    w.steps = w.per_head * (a.h / a.hkv);
    return w;
  }
  __device__ __forceinline__ int head(const AttentionBwdArgs& a, int i) const {
    return hk * (a.h / a.hkv) + i / per_head;
  }
  __device__ __forceinline__ int row(int i) const { return first + kStepRows * (i % per_head); }
};

// This thread's 16 query columns of a step (column c: query 8·(c / 2) + col + c % 2
// of the step) of 64 fp32 in shared memory at `at`.
__device__ __forceinline__ void stage_columns(float (&out)[16], uint32_t at, int col) {
#pragma unroll
  for (int c = 0; c < 16; c += 2) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(out[c]), "=f"(out[c + 1]) : "r"(at + 4 * (8 * (c / 2) + col)));
  }
}

// A consumer's accumulator (keys key0 and key0 + 8, columns col + 8·v2 and one more)
// times `scale` into `out` (keys `stride` elements apart), the keys before tk.
template <int D, typename T>
__device__ __forceinline__ void store_key_rows(T* out, const float (&acc)[D / 2], float scale, int64_t stride,
                                               int key0, int col, int tk) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= tk) continue;
#pragma unroll
    for (int v2 = 0; v2 < D / 8; ++v2) {
      store_pair(out + int64_t(key) * stride + col + 8 * v2, acc[4 * v2 + 2 * r] * scale,
                 acc[4 * v2 + 2 * r + 1] * scale);
    }
  }
}

// dq's chunks in the input type as their last adds land, inside the dk / dv kernel
// (no kernel after it). Past the turn counters (one a chunk, a.dq_turns, zeros): a
// queue of the chunks whose every add has landed (chunk + 1 a slot, zeros until
// written), pushed by their last adder (the block of key block 0, which reads every
// query step), then four counters: blocks started, chunks claimed, chunks pushed,
// blocks done with their keys.
struct DqQueue {
  int* slots;
  int* started;
  int* claimed;
  int* pushed;
  int* done;
  int chunks;
  static __device__ __forceinline__ DqQueue of(const AttentionBwdArgs& a) {
    const int chunks = a.batch * a.h * dq_steps(a);
    int* q = a.dq_turns + chunks;
    return {q, q + chunks, q + chunks + 1, q + chunks + 2, q + chunks + 3, chunks};
  }
  // A slot reserved, then written (after the chunk's last add landed and its turn
  // passed on, so that a claimer acquiring the slot sees every add).
  __device__ __forceinline__ void push(int chunk) const { store_release(slots + atomicAdd(pushed, 1), chunk + 1); }
  // The next chunk in push order (a ticket: one fetch-and-add, never retried, so the
  // claimers of every SM take chunks in parallel; a compare-and-swap loop on this one
  // counter serialized them, about 0.3 µs a chunk on an H100), waiting while its slot
  // is not written yet; -1 once every chunk is claimed.
  __device__ __forceinline__ int claim() const {
    const int c = atomicAdd(claimed, 1);
    if (c >= chunks) return -1;
    int v;
    while ((v = load_acquire(slots + c)) == 0) __nanosleep(64);
    return v - 1;
  }
};

// Step i's dq share, dS K over the block's 128 keys (K's columns of this warpgroup at
// k_mn), once both warpgroups have left step i's dSᵀ in buffer i % 2, after the
// products already issued; the dSᵀ buffer freed, the result into dq buffer i % 2 once
// the writer has emptied it, its barrier told.
template <int D, bool F16>
__device__ __forceinline__ void make_dq(uint32_t base, uint64_t k_mn, int i, int group, int tid) {
  using S = BwdSmem<D, kDkdvStages, true>;
  barrier_wait(S::ds_full(base, i % 2), (i / 2) & 1);
  float dq[32];
  const uint64_t ds_mn = mn_descriptor(S::ds(base, i % 2));
  hmma_n64<F16, true, true>(dq, ds_mn, k_mn);  // dSᵀ and K as they lie
#pragma unroll
  for (int kk = 1; kk < kBlockN / 16; ++kk) hmma_n64<F16, false, true>(dq, ds_mn + 128 * kk, k_mn + 128 * kk);
  mma_commit();
  mma_wait_all();
  fence_registers(dq);
  barrier_arrive(S::ds_empty(base, i % 2));
  if (i >= 2) barrier_wait(S::dq_empty(base, i % 2), ((i / 2) - 1) & 1);  // step i - 2's dq written out
  const uint32_t out = S::dq(base, i % 2) + 16 * ((D == 128 ? group * kWarpgroup : 0) + tid);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(out + 16 * dq_slots(D) * j), "f"(dq[4 * j]),
                 "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]), "f"(dq[4 * j + 3])
                 : "memory");
  }
  fence_for_tensor_cores();  // the bulk copy reads it through the async proxy
  barrier_arrive(S::dq_full(base, i % 2));
}

// Σ a[i] · b[i] over 8 elements of T at 16-byte aligned a and b, in fp32.
template <typename T>
__device__ __forceinline__ float dot8(const T* a, const T* b) {
  const uint4 x = *reinterpret_cast<const uint4*>(a), y = *reinterpret_cast<const uint4*>(b);
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 u, v;
    if constexpr (std::is_same<T, __half>::value) {
      u = __half22float2(*reinterpret_cast<const __half2*>(&xs[i]));
      v = __half22float2(*reinterpret_cast<const __half2*>(&ys[i]));
    } else {
      u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xs[i]));
      v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ys[i]));
    }
    sum = fmaf(u.x, v.x, fmaf(u.y, v.y, sum));
  }
  return sum;
}

// Both consumer warpgroups at named barrier 3 (1 and 2 are the forwards' turns).
__device__ __forceinline__ void consumers_sync() { turn_wait(3); }

// This block's first two steps' delta where the kernel makes it (a.delta_ready:
// causal, as many kv heads as query heads, Tq <= Tk). Key block n is the first reader
// of query chunks 2n and 2n + 1, its first two steps (a head's key blocks launch from
// the last down), so its consumers make their delta = rowsum(o ∘ do) while the
// block's first copies land, two threads a query: each sums four of the columns
// kernel's eight 16-byte pieces (p, p + 64 columns) and pairs them as its shuffles
// do, so the sum is that kernel's, bit for bit. Into the two stages' columns (the
// producer copies only lse there) and a.rows, then the chunks flagged for the blocks
// after it (whose producers copy their columns once flagged).
template <int D, typename T>
__device__ __forceinline__ void make_first_delta(uint32_t base, const AttentionBwdArgs& a, const DkdvWork& w,
                                                 int ctid) {
  using S = BwdSmem<D, kDkdvStages, true>;
  const int steps = dq_steps(a), m0 = w.n0 / kStepRows;
  if (m0 >= steps) return;
  const int q = ctid / 2, half = ctid % 2, j = q / kStepRows, m = m0 + j, t = m * kStepRows + q % kStepRows;
  const int64_t bh = int64_t(w.b) * a.h + w.hk;
  float sum = 0.0f;
  if (m < steps && t < a.tq) {
    const T* o = static_cast<const T*>(a.o) + w.b * a.o_stride_b + w.hk * a.o_stride_h + t * a.o_stride_t;
    const T* dout = static_cast<const T*>(a.dout) + w.b * a.do_stride_b + w.hk * a.do_stride_h + t * a.do_stride_t;
    float piece[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      piece[i] = 0.0f;
#pragma unroll
      for (int c = 8 * (4 * half + i); c < D; c += 64) piece[i] += dot8(o + c, dout + c);
    }
    sum = (piece[0] + piece[1]) + (piece[2] + piece[3]);
  }
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
  if (half == 0 && m < steps) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(S::columns(base, j) + 4 * (kStepRows + q % kStepRows)), "f"(sum)
                 : "memory");
    fence_for_tensor_cores();  // a later stage's columns come through the async proxy
    a.rows[(bh * steps + m) * (2 * kStepRows) + kStepRows + q % kStepRows] = sum;
  }
  consumers_sync();
  if (ctid == 0) {
    __threadfence();
    for (int jj = 0; jj < 2 && m0 + jj < steps; ++jj) store_release(a.delta_ready + bh * steps + m0 + jj, 1);
  }
}

// A consumer warpgroup: dk and dv of its 64 keys over the block's steps, then stored.
// DQ: each step's dSᵀ (both warpgroups' keys) also goes to shared memory, and dq's
// share of the block's 128 keys, dS K, is made there (head dim 128: each warpgroup
// 64 of the columns; 64: the warpgroup of the step's parity, all of them) and left in
// a dq buffer for the block's dq writer (write_dq).
template <int D, bool CAUSAL, bool DQ, typename T, int GROUP, int IN>
__device__ __forceinline__ void consume_dkdv(uint32_t base, const AttentionBwdArgs& a, const DkdvWork& w, int group,
                                             int tid) {
  using S = BwdSmem<D, kDkdvStages, DQ>;
  constexpr bool f16 = std::is_same<T, __half>::value;
  const int lane = tid % 32, col = 2 * (lane % 4);
  const int key_row = 64 * group + 16 * (tid / 32) + lane / 4;  // this thread's keys' rows in the block: +0, +8
  const int key0 = w.n0 + key_row;
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
  uint64_t k_desc[D / 64], v_desc[D / 64];  // this warpgroup's 64 keys of each column block
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk) {
    k_desc[blk] = tile_descriptor<128>(S::held(base, 0) + blk * kBlockBytes + 64 * group * 128);
    v_desc[blk] = tile_descriptor<128>(S::held(base, 1) + blk * kBlockBytes + 64 * group * 128);
  }
  // dq's B operand: the block's 128 keys of the columns this warpgroup makes
  const uint64_t k_mn = mn_descriptor(S::held(base, 0) + (D == 128 ? group : 0) * kBlockBytes);
  if constexpr ((IN & kDeltaInKernel) != 0) make_first_delta<D, T>(base, a, w, kWarpgroup * group + tid);
  barrier_wait(S::q_full(base, 0), 0);
  const auto store_dkdv = [&] {
    store_key_rows<D, T>(static_cast<T*>(a.dk) + int64_t(w.b) * a.dk_stride_b + int64_t(w.hk) * a.dk_stride_h, dk,
                         a.softmax_scale, a.dk_stride_t, key0, col, a.tk);
    store_key_rows<D, T>(static_cast<T*>(a.dv) + int64_t(w.b) * a.dv_stride_b + int64_t(w.hk) * a.dv_stride_h, dv,
                         1.0f, a.dv_stride_t, key0, col, a.tk);
  };
  // step i; makes_last: this warpgroup makes its dq share of step i - 1 there (head
  // dim 64: the warpgroup of that step's parity, a constant of each half of the
  // loop's body below), so that neither warpgroup waits for the other's dSᵀ
  const auto step = [&](int i, auto makes_last) {
    const int s = i % kDkdvStages, m0 = w.row(i);
    barrier_wait(S::full(base, s), (i / kDkdvStages) & 1);
    float lse2[16];  // in base 2
    stage_columns(lse2, S::columns(base, s), col);
    uint64_t q_desc[D / 64], do_desc[D / 64];
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk) {
      q_desc[blk] = tile_descriptor<128>(S::step(base, s, 0) + blk * S::step_block);
      do_desc[blk] = tile_descriptor<128>(S::step(base, s, 1) + blk * S::step_block);
    }
    const uint64_t q_mn = step_mn_descriptor(S::step(base, s, 0)), do_mn = step_mn_descriptor(S::step(base, s, 1));
    float st[32], dp[32];
    mma_fence();
    hmma_rows<D, f16>(st, k_desc, q_desc);
    mma_commit();
    hmma_rows<D, f16>(dp, v_desc, do_desc);
    mma_commit();
    mma_wait_all_but_newest();  // Sᵀ
    fence_registers(st);
#pragma unroll
    for (int e = 0; e < 32; ++e) {  // row key0 + 8·((e / 2) % 2), column 8·(e / 4) + col + e % 2
      const int key = key0 + 8 * ((e / 2) % 2), c = 2 * (e / 4) + e % 2, query = m0 + 8 * (e / 4) + col + e % 2;
      const bool seen = query < a.tq && (!CAUSAL || query >= key);
      st[e] = seen ? fast_exp2(fmaf(st[e], a.qk_scale, -lse2[c])) : 0.0f;
    }
    uint32_t pf[4][4];  // Pᵀ as the A operand: queries 16kk .. 16kk + 15 of step kk
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int w2 = 0; w2 < 4; ++w2) pf[kk][w2] = pack2<f16>(st[8 * kk + 2 * w2], st[8 * kk + 2 * w2 + 1]);
    }
    mma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) hmma_values<D, f16>(dv, pf[kk], do_mn + 128 * kk);
    mma_commit();
    float delta[16];
    stage_columns(delta, S::columns(base, s) + kStepRows * 4, col);
    mma_wait_all_but_newest();  // dPᵀ (dv += Pᵀ do may still run)
    fence_registers(dp);
    uint32_t df[4][4];  // dSᵀ as the A operand
#pragma unroll
    for (int e = 0; e < 32; ++e) dp[e] = st[e] * (dp[e] - delta[2 * (e / 4) + e % 2]);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int w2 = 0; w2 < 4; ++w2) df[kk][w2] = pack2<f16>(dp[8 * kk + 2 * w2], dp[8 * kk + 2 * w2 + 1]);
    }
    if constexpr (DQ) {
      // dSᵀ into buffer i % 2 once step i - 2's dq products have read it: df[kk][w2]
      // is rows key_row + 8·(w2 % 2), queries 16kk + 8·(w2 / 2) + col and one more
      // (conflict-free under the swizzle)
      if (i >= 2) barrier_wait(S::ds_empty(base, i % 2), ((i / 2) - 1) & 1);
      const uint32_t ds = S::ds(base, i % 2);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int w2 = 0; w2 < 4; ++w2) {
          const uint32_t at = ds + swizzled<128>(key_row + 8 * (w2 % 2), 2 * kk + w2 / 2) + 2 * col;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(df[kk][w2]) : "memory");
        }
      }
      fence_for_tensor_cores();
      barrier_arrive(S::ds_full(base, i % 2));
      mma_wait_all();  // dv += Pᵀ do (done by now): Pᵀ's registers free for dS K's
      fence_registers(pf);
      fence_registers(dv);
    }
    mma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) hmma_values<D, f16>(dk, df[kk], q_mn + 128 * kk);
    mma_commit();
    if constexpr (decltype(makes_last)::value) {  // the last step's dq share, beside this step's dk
      make_dq<D, f16>(base, k_mn, i - 1, group, tid);
    } else {
      mma_wait_all();
    }
    fence_registers(dv);
    fence_registers(pf);
    fence_registers(dk);
    fence_registers(df);
    barrier_arrive(S::empty(base, s));
  };
  using Even = std::integral_constant<bool, DQ && (D == 128 || GROUP == 0)>;  // makes an even step's dq
  using Odd = std::integral_constant<bool, DQ && (D == 128 || GROUP == 1)>;
  if (w.steps == 0) return store_dkdv();
  step(0, std::false_type());
  if constexpr (Even::value == Odd::value) {
    for (int i = 1; i < w.steps; ++i) step(i, Even());
    if constexpr (Even::value) make_dq<D, f16>(base, k_mn, w.steps - 1, group, tid);
  } else {
    for (int i = 1; i < w.steps; i += 2) {  // step i makes step i - 1's dq: odd steps an even one's
      step(i, Even());
      if (i + 1 < w.steps) step(i + 1, Odd());
    }
    if ((w.steps - 1) % 2 == GROUP) make_dq<D, f16>(base, k_mn, w.steps - 1, group, tid);
  }
  store_dkdv();
}

// The block's dq writer (one thread of the producer warpgroup): each step's dq share
// from its buffer into the fp32 chunk of (batch, head, 64 queries) in global memory,
// in a fixed order: the key blocks that read those queries add to the chunk from the
// last block down (a causal block n reads query steps 2n and on, so a later block
// reaches each step first), the first of them storing. The chunk's turn counter says
// how many have added; the block waits for its turn, adds, and passes the turn on
// once the add has landed, which it waits for behind the next step's add (its buffer
// is freed then too). The grid runs a kv head's key blocks from the last down, so a
// block only waits for blocks that started before it: every wait ends, however few
// blocks the GPU holds at once.
template <int D, bool CAUSAL, int IN>
__device__ __forceinline__ void write_dq(uint32_t base, const AttentionBwdArgs& a, const DkdvWork& w) {
  using S = BwdSmem<D, kDkdvStages, true>;
  const int last_block = (a.tk + kBlockN - 1) / kBlockN - 1, n = w.n0 / kBlockN, steps = dq_steps(a);
  const auto pass_on = [&](int* turn) {  // the add landed: the turn passed on; key block 0, the last adder, pushes
    fence_async_global();
    add_release(turn, 1);
    if constexpr ((IN & kDqInKernel) != 0) {  // (the queue made here: the writer's registers are few)
      if (n == 0) DqQueue::of(a).push(int(turn - a.dq_turns));
    }
  };
  int* last_turn = nullptr;
  for (int i = 0; i < w.steps; ++i) {
    const int m = w.row(i) / kStepRows;
    const int before = (CAUSAL ? min(last_block, m * kStepRows / kBlockN) : last_block) - n;  // blocks after n
    int* turn = a.dq_turns + (int64_t(w.b) * a.h + w.head(a, i)) * steps + m;
    barrier_wait(S::dq_full(base, i % 2), (i / 2) & 1);
    while (load_acquire(turn) != before) __nanosleep(32);
    fence_async_global();
    float* dst = a.dq_accum + (turn - a.dq_turns) * int64_t(kStepRows * D);
    if (before == 0) {
      bulk_store(dst, S::dq(base, i % 2), dq_chunk_bytes(D));
    } else {
      bulk_add(dst, S::dq(base, i % 2), dq_chunk_bytes(D));
    }
    bulk_commit();
    if (i > 0) {  // step i - 1's add landed: its turn passed on, its buffer free
      bulk_wait_all_but_newest();
      pass_on(last_turn);
      barrier_arrive(S::dq_empty(base, (i - 1) % 2));
    }
    last_turn = turn;
  }
  if (last_turn != nullptr) {
    bulk_wait_all();
    pass_on(last_turn);
  }
}

// Piece p of dq's chunk `chunk` in the input type (times softmax_scale). A chunk
// holds float4 (j, slot) as make_dq wrote them: slot's thread tid = slot % 128 of the
// warpgroup making columns 64·(slot / 128) (head dim 128) has rows 16·(tid / 32) +
// (tid % 32) / 4 and 8 more, columns 8j + 2·(tid % 4) and one more. Piece p takes
// the four consecutive slots 4g .. 4g + 3 of one j (64 contiguous bytes: rows r =
// 16·(g / 8) + g % 8 and r + 8, columns 8j .. 8j + 7) and stores 16 bytes to each
// row; j runs fastest, so a warp's loads are whole sectors and 8 of its threads store
// a row's 64 columns whole. The loads go to L2 (other blocks added the chunk).
template <int D, typename T>
__device__ __forceinline__ void store_dq_piece(const AttentionBwdArgs& a, int chunk, int p) {
  constexpr int slots = dq_slots(D);
  const int steps = dq_steps(a), bh = chunk / steps;
  const int j = p % 8, g = (p / 8) % 32, half = p / 256;
  const float4* src = reinterpret_cast<const float4*>(a.dq_accum) + int64_t(chunk) * (kStepRows * D / 4) + j * slots +
                      kWarpgroup * half + 4 * g;
  float4 v[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) v[q] = __ldcg(src + q);
  const int row = (chunk % steps) * kStepRows + 16 * (g / 8) + g % 8;
  T* dq = static_cast<T*>(a.dq) + (bh / a.h) * a.dq_stride_b + (bh % a.h) * a.dq_stride_h + 64 * half + 8 * j;
  const float s = a.softmax_scale;
  constexpr bool f16 = std::is_same<T, __half>::value;
  if (row < a.tq) {
    *reinterpret_cast<uint4*>(dq + int64_t(row) * a.dq_stride_t) =
        make_uint4(pack2<f16>(v[0].x * s, v[0].y * s), pack2<f16>(v[1].x * s, v[1].y * s),
                   pack2<f16>(v[2].x * s, v[2].y * s), pack2<f16>(v[3].x * s, v[3].y * s));
  }
  if (row + 8 < a.tq) {
    *reinterpret_cast<uint4*>(dq + int64_t(row + 8) * a.dq_stride_t) =
        make_uint4(pack2<f16>(v[0].z * s, v[0].w * s), pack2<f16>(v[1].z * s, v[1].w * s),
                   pack2<f16>(v[2].z * s, v[2].w * s), pack2<f16>(v[3].z * s, v[3].w * s));
  }
}

// The consumers' last work (kDqInKernel): once every block of the grid has started,
// nothing is left for this SM but dq's chunks, which the running blocks' last adds
// complete one by one; the leader claims the oldest one pushed (waiting while none
// is) and all 256 threads store it, until every chunk is claimed. A block done before
// the grid's last block started leaves at once, so that those start. Every chunk is
// stored: the last block to count itself done (an atomic count, so exactly one) knows
// every block has started and claims until none is left, whatever it saw of the
// start count.
template <int D, typename T>
__device__ __forceinline__ void store_ready_dq(uint32_t base, const AttentionBwdArgs& a, int ctid) {
  using S = BwdSmem<D, kDkdvStages, true>;
  const DqQueue queue = DqQueue::of(a);
  for (int round = 0;; ++round) {
    if (ctid == 0) {
      const int grid = int(gridDim.x * gridDim.y);
      const bool claims = round > 0 || atomicAdd(queue.done, 1) == grid - 1 || load_relaxed(queue.started) == grid;
      const int chunk = claims ? queue.claim() : -1;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(S::claim(base, round)), "r"(chunk) : "memory");
    }
    consumers_sync();
    int chunk;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(chunk) : "r"(S::claim(base, round)) : "memory");
    if (chunk < 0) return;
#pragma unroll
    for (int p = ctid; p < kStepRows * D / 16; p += 2 * kWarpgroup) store_dq_piece<D, T>(a, chunk, p);
  }
}

template <int D, bool CAUSAL, bool DQ, typename T, int IN>
__global__ void __launch_bounds__(kForwardThreads, 1)
    attention_hp_dkdv_kernel(const __grid_constant__ AttentionBwdArgs a, const __grid_constant__ BwdMaps maps) {
  using S = BwdSmem<D, kDkdvStages, DQ>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = block_shared_memory<S>(smem_raw);
  if constexpr (DQ) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        barrier_init(S::dq_full(base, i), dq_slots(D));  // the threads that write a dq buffer
        barrier_init(S::dq_empty(base, i), 1);            // the writer
        barrier_init(S::ds_full(base, i), 2 * kWarpgroup);  // both consumers' threads
        barrier_init(S::ds_empty(base, i), dq_slots(D));    // the threads whose products read it
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      if constexpr ((IN & kDqInKernel) != 0) atomicAdd(DqQueue::of(a).started, 1);
    }
    __syncthreads();
  }
  const DkdvWork w = DkdvWork::of(a, CAUSAL, DQ);
  const int group = threadIdx.x / kWarpgroup, tid = threadIdx.x % kWarpgroup;
  if (group == 0) {
    fewer_registers<S::template producer_registers<CAUSAL>>();
    if (tid == 0) {
      produce_bwd<S, IN>(maps, base, w.b, w.hk, w.n0, w.steps, [&](int i) { return make_int2(w.head(a, i), w.row(i)); },
                     a);
    } else if (DQ && tid == 32) {
      write_dq<D, CAUSAL, IN>(base, a, w);
    }
  } else {
    more_registers<S::template consumer_registers<CAUSAL>>();
    if (DQ && D == 64 && group == 2) {  // the warpgroup a constant: its dq steps' branch uniform to the compiler
      consume_dkdv<D, CAUSAL, DQ, T, 1, IN>(base, a, w, 1, tid);
    } else {
      consume_dkdv<D, CAUSAL, DQ, T, 0, IN>(base, a, w, group - 1, tid);
    }
    if constexpr ((IN & kDqInKernel) != 0) store_ready_dq<D, T>(base, a, threadIdx.x - kWarpgroup);
  }
}

template <int D, bool CAUSAL, bool DQ, typename T, int IN = 0>
void launch_dkdv(const AttentionBwdArgs& a, cudaStream_t stream) {
  BwdMaps maps;
  maps.held[0] = rows_map(a.k, a.batch, a.hkv, a.tk, D, a.k_stride_b, a.k_stride_h, a.k_stride_t, kBlockN,
                          "attention_hp_dkdv's k");
  maps.held[1] = rows_map(a.v, a.batch, a.hkv, a.tk, D, a.v_stride_b, a.v_stride_h, a.v_stride_t, kBlockN,
                          "attention_hp_dkdv's v");
  maps.step[0] = rows_map(a.q, a.batch, a.h, a.tq, D, a.q_stride_b, a.q_stride_h, a.q_stride_t, kStepRows,
                          "attention_hp_dkdv's q");
  maps.step[1] = rows_map(a.dout, a.batch, a.h, a.tq, D, a.do_stride_b, a.do_stride_h, a.do_stride_t, kStepRows,
                          "attention_hp_dkdv's do");
  const unsigned blocks = unsigned((a.tk + kBlockN - 1) / kBlockN), heads = unsigned(a.batch * a.hkv);
  const dim3 grid = DQ ? dim3(blocks, heads) : dim3(heads, blocks);  // DkdvWork::of
  launch_on<attention_hp_dkdv_kernel<D, CAUSAL, DQ, T, IN>, BwdSmem<D, kDkdvStages, DQ>>(grid, a, stream,
                                                                                     "attention_hp_dkdv", maps);
}

// ---------------------------------------------------------------------------
// Before the dk / dv kernel: the steps' per-query columns (lse · log2 e and delta =
// rowsum(o ∘ do), made or given).
// ---------------------------------------------------------------------------

constexpr int kRowThreads = 256;

// Where the per-query columns' delta comes from: a.delta (given), rowsum(o ∘ do) made
// here, or made by the dk / dv kernel (later: lse alone here).
enum DeltaFrom { kDeltaGiven, kDeltaMade, kDeltaLater };

// The per-query columns the dk / dv kernel's producer copies with each step (a.rows:
// (B·H, ceil(Tq / 64), 2, 64) fp32, a step's lse · log2 e, then its delta, zeros past
// Tq): kDeltaMade, 8 threads a query, delta = rowsum(o ∘ do) (16-byte pieces of o and
// do each); else a thread a query, delta copied from a.delta or left to the kernel.
template <int D, typename T, int DELTA>
__global__ void __launch_bounds__(kRowThreads) attention_hp_columns_kernel(const __grid_constant__ AttentionBwdArgs a) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int per_query = DELTA == kDeltaMade ? 8 : 1;
  const int steps = dq_steps(a), padded = steps * kStepRows;
  const int64_t slot = (int64_t(blockIdx.x) * kRowThreads + threadIdx.x) / per_query;  // (bh, padded query)
  const int piece = threadIdx.x % per_query;
  const bool inside = slot < int64_t(a.batch) * a.h * padded;
  const int t = int(slot % padded);
  const int64_t bh = slot / padded;
  const bool query = inside && t < a.tq;
  float sum = 0.0f;
  if constexpr (DELTA == kDeltaMade) {
    if (query) {
      const int64_t b = bh / a.h, h = bh % a.h;
      const T* o = static_cast<const T*>(a.o) + b * a.o_stride_b + h * a.o_stride_h + t * a.o_stride_t;
      const T* dout = static_cast<const T*>(a.dout) + b * a.do_stride_b + h * a.do_stride_h + t * a.do_stride_t;
#pragma unroll
      for (int j = 8 * piece; j < D; j += 64) sum += dot8(o + j, dout + j);
    }
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
  }
  if (inside && piece == 0) {
    float* chunk = a.rows + (bh * steps + t / kStepRows) * (2 * kStepRows);
    chunk[t % kStepRows] = query ? a.lse[bh * a.tq + t] * kLog2e : 0.0f;
    if constexpr (DELTA != kDeltaLater) {
      chunk[kStepRows + t % kStepRows] = query ? (DELTA == kDeltaMade ? sum : a.delta[bh * a.tq + t]) : 0.0f;
    }
  }
}

// dq from its chunks after the dk / dv kernel (unless that stored them): a thread a
// piece (store_dq_piece).
template <int D, typename T>
__global__ void __launch_bounds__(kRowThreads) attention_hp_dq_store_kernel(const __grid_constant__ AttentionBwdArgs a) {
  constexpr int per_chunk = kStepRows * D / 16;
  const int64_t f = int64_t(blockIdx.x) * kRowThreads + threadIdx.x;
  if (f < int64_t(a.batch) * a.h * dq_steps(a) * per_chunk) store_dq_piece<D, T>(a, int(f / per_chunk), int(f % per_chunk));
}

// The backward (the per-query columns, with delta made (DQ: here or in the dk / dv
// kernel) or given; dk / dv, with dq's chunks added (DQ); dq stored from them in the
// dk / dv kernel or after it (DQ)) for a's head dim, mask and `type`.
template <bool DQ, typename T>
void launch_backward_typed(const AttentionBwdArgs& given, cudaStream_t stream, const char* name) {
  // What the dk / dv kernel also does, as asked, where it may: causal only (dq stored
  // in it), delta made by each query chunk's first reader where there is one block
  // (as many kv heads as query heads, Tq <= Tk; its flags past the queue)
  AttentionBwdArgs a = given;
  const int chunks = a.batch * a.h * dq_steps(a);
  a.in_kernel = DQ && a.causal ? given.in_kernel & (kDqInKernel | kDeltaInKernel) : 0;
  if (!(a.h == a.hkv && a.tq <= a.tk)) a.in_kernel &= ~kDeltaInKernel;
  if (a.in_kernel & kDeltaInKernel) a.delta_ready = a.dq_turns + 2 * chunks + 4;
  const auto launch = [&](auto d, auto causal) {
    constexpr int D = decltype(d)::value;
    const int64_t queries = int64_t(chunks) * kStepRows;
    const auto columns = [&](auto delta, int per_query) {
      attention_hp_columns_kernel<D, T, decltype(delta)::value>
          <<<unsigned((queries * per_query + kRowThreads - 1) / kRowThreads), kRowThreads, 0, stream>>>(a);
    };
    if (!DQ) {
      columns(std::integral_constant<int, kDeltaGiven>(), 1);
    } else if (a.delta_ready == nullptr) {
      columns(std::integral_constant<int, kDeltaMade>(), 8);
    } else {
      columns(std::integral_constant<int, kDeltaLater>(), 1);
    }
    check_launch("attention_hp_columns");
    constexpr bool kCausal = decltype(causal)::value;
    if constexpr (DQ && kCausal) {
      switch (a.in_kernel) {
        case kDqInKernel: launch_dkdv<D, kCausal, DQ, T, kDqInKernel>(a, stream); break;
        case kDeltaInKernel: launch_dkdv<D, kCausal, DQ, T, kDeltaInKernel>(a, stream); break;
        case kDqInKernel | kDeltaInKernel: launch_dkdv<D, kCausal, DQ, T, kDqInKernel | kDeltaInKernel>(a, stream); break;
        default: launch_dkdv<D, kCausal, DQ, T>(a, stream);
      }
    } else {
      launch_dkdv<D, kCausal, DQ, T>(a, stream);
    }
    if (DQ && !(a.in_kernel & kDqInKernel)) {
      const int64_t pieces = queries * D / 16;
      attention_hp_dq_store_kernel<D, T><<<unsigned((pieces + kRowThreads - 1) / kRowThreads), kRowThreads, 0,
                                           stream>>>(a);
      check_launch("attention_hp_dq_store");
    }
  };
  using D128 = std::integral_constant<int, 128>;
  using D64 = std::integral_constant<int, 64>;
  if (a.head_dim == 128) {
    a.causal ? launch(D128(), std::true_type()) : launch(D128(), std::false_type());
  } else if (a.head_dim == 64) {
    a.causal ? launch(D64(), std::true_type()) : launch(D64(), std::false_type());
  } else {
    throw std::invalid_argument(std::string(name) + ": head dim " + std::to_string(a.head_dim) + " is not 64 or 128");
  }
}

template <bool DQ>
void launch_backward(const AttentionBwdArgs& a, int type, void* stream, const char* name) {
  if (a.batch <= 0 || a.h <= 0 || a.tq <= 0 || a.tk <= 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (type == kBFloat16) {
    launch_backward_typed<DQ, __nv_bfloat16>(a, s, name);
  } else if (type == kFloat16) {
    launch_backward_typed<DQ, __half>(a, s, name);
  } else {
    throw std::invalid_argument(std::string(name) + ": the inputs must be bfloat16 or float16 (type code " +
                                std::to_string(type) + ")");
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

void launch_attention_hp_backward(const AttentionBwdArgs& a, int type, void* stream) {
  launch_backward<true>(a, type, stream, "attention_hp_backward");
}

void launch_attention_hp_dkdv(const AttentionBwdArgs& a, int type, void* stream) {
  launch_backward<false>(a, type, stream, "attention_hp_dkdv");
}

}  // namespace te_fuser
