// FP8 flash attention forward for Hopper (sm_90a), hand-written: the tensor cores
// through wgmma, the operands staged by a producer warpgroup, two consumer
// warpgroups each owning 64 query rows of a 128-row block.
//
// Meaning (kernels/reference/attention.py, attention_forward_fp8_reference): E4M3
// q, k, v with fp32 scale_invs; s = softmax_scale · q_si · k_si · (q kᵀ) in base 2;
// per row the running maximum m, p = exp2(s - m + log2 p_scale) rounded to E4M3
// (nearest even, saturating: cvt.rn.satfinite), the row sum l of the unrounded p;
// o = v_si · (Σ_tiles p8 v) / l, lse = (m + log2 l - log2 p_scale) · ln 2. Each key
// tile's p8·v is a fresh tensor-core product added to the fp32 accumulator (the
// FP8 tensor cores add in a narrower accumulator, so the running sum never goes
// through them), as the Triton kernel of kernels/triton/attention.py does.
//
// Blocks are persistent, one an SM (attention_common.cuh's run_block): each works
// through items (128 queries of one head) of the list that runs the longest rows
// first (causal), dealt out in rounds, forwards and backwards in turn
// (for_each_item). 384 threads:
//   * warpgroup 0 (producer, 40 to 56 registers a thread after setmaxnreg), one
//     thread of it: tensor copies (cp.async.bulk.tensor, through maps made at
//     launch) of an item's Q block into one of two buffers (the next item's while
//     the consumers finish this one), then of each key tile's K (128 keys x D) and
//     Vᵀ (D x 128 positions) into a ring of kStages stages, landing in wgmma's
//     swizzle, zeros past the tensor; their bytes complete the stage's "full"
//     barrier (one arrival with the bytes expected, one more once the stage's Vᵀ
//     is in); a stage is refilled once both consumers arrived on its "empty"
//     barrier. Vᵀ is either copied from a rewrite of all of V by a launch before
//     the forward, or (AttentionFp8Args::v_in_kernel) made in shared memory by the
//     whole warpgroup from V's tile as copied (rewrite_v_tile), one raw tile ahead.
//   * warpgroups 1, 2 (consumers, 232 or 224 registers): S = Q Kᵀ (wgmma m64n128k32, Q and
//     K from shared memory), the online softmax on S in registers, P as the
//     register A operand of O_tile = P V (wgmma m64nDk32, Vᵀ from shared memory),
//     O += O_tile in fp32. By default the two take turns issuing S = Q Kᵀ (named
//     barriers), so that one's softmax overlaps the other's tensor-core work. The
//     overlapped schedule (AttentionFp8Args::overlap, on by default) also keeps
//     each consumer's next S = Q Kᵀ and last P V in flight during its softmax,
//     P V then adding into O in the tensor cores' accumulator (other bits).
//
// Shared memory tiles are K-major with the 128-byte (rows of 128 bytes) or 64-byte
// (rows of 64 bytes) swizzle that wgmma's descriptors name: the 16-byte chunk c
// of row r sits at chunk c ^ (r mod 8) (128 B) or c ^ ((r / 2) mod 4) (64 B).
//
// Why Vᵀ has its keys permuted: the FP8 A operand from registers wants each thread
// to hold keys {4t .. 4t+3} (t = lane mod 4) of every 16 (rows r and r + 8), while
// the S accumulator leaves it keys {2t, 2t+1, 2t+8, 2t+9}. Rather than exchange
// bytes between lanes, the kernel feeds the registers as they are and reorders the
// keys of Vᵀ to match: position 4t + i of each 16 holds key 2t + (0, 1, 8, 9)[i]
// (rewrite_v_tile writes Vᵀ so, zero past the last key). The sum over keys is the
// same sum.
//
// Or the other way round (AttentionFp8Args::keys_permuted), where V comes with its
// keys inner already (a transposed copy its producer wrote: v's key stride 1): K's
// rows are copied permuted, through a 5-D tensor map whose box walks the keys as
// (8 with a stride of 2, 2 with a stride of 1, groups of 16), so that S column c of
// each 16 holds key 2 (c % 8) + c / 8. A thread's accumulator columns 2t, 2t + 8,
// 2t + 1, 2t + 9 then hold keys 4t .. 4t + 3, the A operand's order, and Vᵀ is
// read in plain key order, by a 4-D map over v as it lies: no rewrite of V at all.
// Five dimensions leave none for K's batches: they are folded into its heads or
// its keys (kp_batch_heads, kp_batch_keys), which K's strides must allow, and Tk
// is a multiple of 16 (no group of 16 spans two heads or batches); the mask reads
// each column's key.
#include "attention_common.cuh"
#include "dispatch.cuh"
#include "fp8_common.cuh"
#include "launchers.cuh"

namespace te_fuser {
namespace {

using namespace attention;

constexpr int kStages = 3;  // the K / Vᵀ ring

// d (=|+=) a·b, 64 x 128 x 32: a (64 x 32) and b (128 x 32) K-major in shared memory.
__device__ __forceinline__ void mma_ss_n128_first(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(TE_WGMMA("m64n128k32", "e4m3.e4m3", 0, TE_R64, "%64, %65", "1, 1") : TE_D64("=f") : "l"(a), "l"(b));
}
__device__ __forceinline__ void mma_ss_n128(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(TE_WGMMA("m64n128k32", "e4m3.e4m3", 1, TE_R64, "%64, %65", "1, 1") : TE_D64("+f") : "l"(a), "l"(b));
}

// d (=|+=) a·b, 64 x N x 32: a (64 x 32) in registers (the A fragment), b (N x 32)
// K-major in shared memory.
__device__ __forceinline__ void mma_rs_n128_first(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(TE_WGMMA("m64n128k32", "e4m3.e4m3", 0, TE_R64, "{%64, %65, %66, %67}, %68", "1, 1")
               : TE_D64("=f") : TE_A_OPERANDS);
}
__device__ __forceinline__ void mma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(TE_WGMMA("m64n128k32", "e4m3.e4m3", 1, TE_R64, "{%64, %65, %66, %67}, %68", "1, 1")
               : TE_D64("+f") : TE_A_OPERANDS);
}
__device__ __forceinline__ void mma_rs_n64_first(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(TE_WGMMA("m64n64k32", "e4m3.e4m3", 0, TE_R32, "{%32, %33, %34, %35}, %36", "1, 1")
               : TE_D32("=f") : TE_A_OPERANDS);
}
__device__ __forceinline__ void mma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(TE_WGMMA("m64n64k32", "e4m3.e4m3", 1, TE_R32, "{%32, %33, %34, %35}, %36", "1, 1")
               : TE_D32("+f") : TE_A_OPERANDS);
}

// The P V step at head dim D: first overwrites d, else adds to it.
template <int D>
__device__ __forceinline__ void pv_step(float (&d)[D / 2], const uint32_t (&a)[4], uint64_t b, bool first) {
  if constexpr (D == 128) {
    first ? mma_rs_n128_first(d, a, b) : mma_rs_n128(d, a, b);
  } else {
    first ? mma_rs_n64_first(d, a, b) : mma_rs_n64(d, a, b);
  }
}

// Four probabilities -> four E4M3 bytes of one 32-bit word, the first in the low byte.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return (lo & 0xFFFFu) | (hi << 16);
}

constexpr int kRawSlots = 2;  // V tiles as copied, ahead of their rewrite (AttentionFp8Args::v_in_kernel)

// Shared memory of a forward block (bytes past a 1024-byte aligned start). One
// producer thread issues the tensor copies and arrives on a full barrier, then
// once more when the stage's Vᵀ is in (rewritten by the producer warpgroup from a
// raw slot, or copied with K). The registers a thread keeps are the measured best
// (RESULTS run 207): the consumers 232 at head dim 128 under the causal mask
// (2.8-3.6% faster than 224), 224 elsewhere (3.4% faster not causal, 9% at head
// dim 64); the producer what the pool leaves (128·40 + 256·232 and 128·56 + 256·224
// are the 384 · 168 registers the block starts with).
template <int D>
struct ForwardSmem
    : RingBarriers<kStages, 2 * kBlockM * D + 2 * kStages * kBlockN * D + kRawSlots * kBlockN * D> {
  using Ring = RingBarriers<kStages, 2 * kBlockM * D + 2 * kStages * kBlockN * D + kRawSlots * kBlockN * D>;
  static constexpr int q_bytes = kBlockM * D;
  static constexpr int tile_bytes = kBlockN * D;
  static constexpr int q = 0;                           // two buffers of kBlockM x D
  static constexpr int k = q + 2 * q_bytes;             // kStages x (kBlockN x D)
  static constexpr int v = k + kStages * tile_bytes;    // kStages x (D x kBlockN)
  static constexpr int raw = v + kStages * tile_bytes;  // kRawSlots x (kBlockN x D), then the barriers
  static constexpr int bytes = Ring::bytes + 8 * kRawSlots;  // and raw_full of each raw slot
  static constexpr int producer_arrivals = 1;
  static constexpr int later_tile_arrivals = 1;
  static constexpr bool generic_copies = false;  // tensor copies write through the async proxy wgmma reads
  template <bool CAUSAL>
  static constexpr int consumer_registers = D == 128 && CAUSAL ? 232 : 224;
  template <bool CAUSAL>
  static constexpr int producer_registers = D == 128 && CAUSAL ? 40 : 56;
  static __device__ __forceinline__ uint32_t raw_full(uint32_t base, int r) { return base + Ring::bytes + 8 * r; }
  static __device__ __forceinline__ void init_more(uint32_t base) {
#pragma unroll
    for (int r = 0; r < kRawSlots; ++r) barrier_init(raw_full(base, r), 1);  // the copying thread
  }
};

// The tensor maps the producer copies through: q, k and v as (D, T, heads, batch)
// in boxes of (D, 128, 1, 1), Vᵀ as (positions, batch · kv heads · D) in boxes of
// (128, D) (where a launch before rewrote V: unset where v_in_kernel); each box
// lands swizzled as the tile's wgmma descriptor reads it (a V box as K's would).
// With keys_permuted: k as (D, 8, 2, Tk / 16, batch · kv heads) or (D, 8, 2, batch
// · Tk / 16, kv heads) with key strides 2, 1 and 16 in boxes of (D, 8, 2, 8, 1),
// vt over v with its keys inner as (Tk, D, kv heads, batch) in boxes of (128, D,
// 1, 1); v unset.
struct ForwardMaps {
  CUtensorMap q, k, v, vt;
};

// Named barrier 3: the producer warpgroup's threads (1 and 2 are the consumers' turns).
__device__ __forceinline__ void producers_sync() { asm volatile("bar.sync 3, %0;\n" ::"n"(kWarpgroup) : "memory"); }

__device__ __forceinline__ uint4 load_shared16(uint32_t addr) {
  uint4 x;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
               : "r"(addr)
               : "memory");
  return x;
}
__device__ __forceinline__ void store_shared4(uint32_t addr, uint32_t x) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(x) : "memory");
}
__device__ __forceinline__ void store_shared16(uint32_t addr, uint4 x) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
               : "memory");
}

// One V tile (raw: 128 keys x D bytes as a tensor copy lands them, rows under the
// D-byte swizzle) rewritten as Vᵀ (vt: D rows of 128 positions, the 128-byte
// swizzle, the keys permuted as the top of the file says), by 128 threads (the
// producer warpgroup's, or v_keys_inner_kernel's block). Lane (t, c) of warp w
// takes keys 16c + 2t + (0, 1, 8, 9) at the 16 bytes dq = w (and w + 4 at head dim
// 128) of each: four 16-byte loads, each 4 x 4 block of bytes turned by byte
// permutes, sixteen words stored at position 16c + 4t of rows 16dq .. 16dq + 15.
// No two lanes of a store share a bank, nor two lanes of a load's 8-lane phase: the
// lanes of odd c load each pair of keys the other way round (under either swizzle
// a key's parity moves its chunk to the other half of the banks).
template <int D>
__device__ __forceinline__ void rewrite_v_tile(uint32_t raw, uint32_t vt, int tid) {
  const int lane = tid % 32, t = lane % 4, c = lane / 4;
  const int key = 16 * c + 2 * t, swap = c % 2;
  // bytes (b, b + 1) of word j of keys `first` and first + 1, interleaved: lo for b
  // = 0, hi for b = 2 (the selector of the pair loaded in order, or swapped; hi's
  // picks each two bytes further)
  const uint32_t lo_sel = swap ? 0x1504u : 0x5140u;
  const auto pairs = [&](int first, int dq, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
    const uint4 x = load_shared16(raw + swizzled<D>(first + swap, dq));
    const uint4 y = load_shared16(raw + swizzled<D>(first + 1 - swap, dq));
    const uint32_t wx[4] = {x.x, x.y, x.z, x.w}, wy[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo[j] = __byte_perm(wx[j], wy[j], lo_sel);
      hi[j] = __byte_perm(wx[j], wy[j], lo_sel + 0x2222u);
    }
  };
#pragma unroll 1
  for (int u = 0; u < D / 64; ++u) {
    const int dq = tid / 32 + 4 * u;
    uint32_t lo01[4], hi01[4], lo89[4], hi89[4];
    pairs(key, dq, lo01, hi01);
    pairs(key + 8, dq, lo89, hi89);
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // bytes 4j .. 4j + 3 of the 16: rows 16dq + 4j + b
      const uint32_t rows[4] = {__byte_perm(lo01[j], lo89[j], 0x5410), __byte_perm(lo01[j], lo89[j], 0x7632),
                                __byte_perm(hi01[j], hi89[j], 0x5410), __byte_perm(hi01[j], hi89[j], 0x7632)};
#pragma unroll
      for (int b = 0; b < 4; ++b) store_shared4(vt + swizzled<kBlockN>(16 * dq + 4 * j + b, c) + 4 * t, rows[b]);
    }
  }
}

// Item w's Q block into Q buffer `buffer`: a tensor copy whose bytes complete the
// buffer's full barrier (one arrival expecting them).
template <int D>
__device__ __forceinline__ void copy_q(const ForwardMaps& maps, uint32_t base, const BlockWork& w, int buffer) {
  using S = ForwardSmem<D>;
  const uint32_t full = S::q_full(base, buffer);
  barrier_arrive_expect_bytes(full, S::q_bytes);
  tensor_copy_4d(base + S::q + buffer * S::q_bytes, &maps.q, 0, w.m0, w.h, w.b, full);
}

// Key tile j's K into stage s, its bytes counted on the stage's full barrier (the
// caller's arrival expects them).
template <int D>
__device__ __forceinline__ void copy_k(const AttentionFp8Args& a, const ForwardMaps& maps, uint32_t base,
                                       const BlockWork& w, int j, int s) {
  using S = ForwardSmem<D>;
  if (a.keys_permuted) {  // 8 groups of 16 keys from the tile's first, each as (8 x stride 2, 2 x stride 1)
    tensor_copy_5d(base + S::k + s * S::tile_bytes, &maps.k, 0, 0, 0, (w.b * a.kp_batch_keys + j * kBlockN) / 16,
                   w.b * a.kp_batch_heads + w.hk, S::full(base, s));
  } else {
    tensor_copy_4d(base + S::k + s * S::tile_bytes, &maps.k, 0, j * kBlockN, w.hk, w.b, S::full(base, s));
  }
}

// The producer warpgroup for item n (its first tile the block's t0), one thread of
// it: Q, then K and Vᵀ of every key tile (produce_ring), each a tensor copy whose
// bytes complete the buffer's or stage's full barrier, on which the thread then
// arrives once more (ForwardSmem::later_tile_arrivals).
template <int D>
__device__ __forceinline__ void produce_copied_v(const AttentionFp8Args& a, const ForwardMaps& maps, uint32_t base,
                                                 const BlockWork& w, int n, int t0, int tid) {
  using S = ForwardSmem<D>;
  if (tid != 0) return;
  const int vt_row = (w.b * a.hkv + w.hk) * D;
  auto copy_tile = [&](int j, int s) {
    const uint32_t full = S::full(base, s);
    barrier_arrive_expect_bytes(full, 2 * S::tile_bytes);
    copy_k<D>(a, maps, base, w, j, s);
    if (a.keys_permuted) {  // v as it lies, its keys inner
      tensor_copy_4d(base + S::v + s * S::tile_bytes, &maps.vt, j * kBlockN, 0, w.hk, w.b, full);
    } else {
      tensor_copy_2d(base + S::v + s * S::tile_bytes, &maps.vt, j * kBlockN, vt_row, full);
    }
    barrier_arrive(full);
  };
  produce_ring<S>(base, n, t0, w.tiles, [&](int buffer) { copy_q<D>(maps, base, w, buffer); }, copy_tile);
}

// The producer warpgroup for item n with V rewritten in the kernel, all 128
// threads: thread 0 copies Q and each tile's K (its bytes on the stage's full
// barrier) and V into raw slot t % kRawSlots (raw_full), kRawSlots tiles ahead;
// every thread, for each tile once both consumers released its stage, rewrites
// the raw tile into the stage's Vᵀ (rewrite_v_tile), fences its writes for the
// tensor cores and meets the others, after which thread 0 arrives on the full
// barrier and refills the raw slot. The raw slot's phase is the tile's t / kRawSlots.
template <int D>
__device__ __forceinline__ void produce_rewritten_v(const AttentionFp8Args& a, const ForwardMaps& maps, uint32_t base,
                                                    const BlockWork& w, int n, int t0, int tid) {
  using S = ForwardSmem<D>;
  auto copy_raw = [&](int j) {
    const int r = (t0 + j) % kRawSlots;
    barrier_arrive_expect_bytes(S::raw_full(base, r), S::tile_bytes);
    tensor_copy_4d(base + S::raw + r * S::tile_bytes, &maps.v, 0, j * kBlockN, w.hk, w.b, S::raw_full(base, r));
  };
  if (tid == 0) {
    if (n >= 2) barrier_wait(S::q_empty(base, n % 2), ((n / 2) - 1) & 1);
    copy_q<D>(maps, base, w, n % 2);
    for (int j = 0; j < min(kRawSlots, w.tiles); ++j) copy_raw(j);  // every raw slot's last tile rewritten
  }
  for (int j = 0; j < w.tiles; ++j) {
    const int t = t0 + j, s = t % kStages, r = t % kRawSlots;
    if (t >= kStages) barrier_wait(S::empty(base, s), ((t / kStages) - 1) & 1);
    const uint32_t full = S::full(base, s);
    if (tid == 0) {
      barrier_arrive_expect_bytes(full, S::tile_bytes);
      copy_k<D>(a, maps, base, w, j, s);
    }
    barrier_wait(S::raw_full(base, r), (t / kRawSlots) & 1);
    rewrite_v_tile<D>(base + S::raw + r * S::tile_bytes, base + S::v + s * S::tile_bytes, tid);
    fence_for_tensor_cores();  // the stores before wgmma's reads, the raw loads before the slot's next copy
    producers_sync();
    if (tid == 0) {
      barrier_arrive(full);
      if (j + kRawSlots < w.tiles) copy_raw(j + kRawSlots);
    }
  }
}

// The producer warpgroup for item n: V rewritten in the kernel or copied as a
// launch before rewrote it.
template <int D>
__device__ __forceinline__ void produce(const AttentionFp8Args& a, const ForwardMaps& maps, uint32_t base,
                                        const BlockWork& w, int n, int t0, int tid) {
  if (n == 0 && tid == 0) {
    prefetch_tensor_map(&maps.q);
    prefetch_tensor_map(&maps.k);
    prefetch_tensor_map(a.v_in_kernel ? &maps.v : &maps.vt);
  }
  if (a.v_in_kernel) {  // never with keys_permuted
    produce_rewritten_v<D>(a, maps, base, w, n, t0, tid);
  } else {
    produce_copied_v<D>(a, maps, base, w, n, t0, tid);
  }
}

// The descriptors of a stage's tiles: K (keys x D) and Vᵀ (D x 128 positions).
// Made before mma_fence: ptxas serializes every wgmma of a kernel where other
// instructions define a wgmma's inputs between the fence and the products.
template <int D>
__device__ __forceinline__ uint64_t k_descriptor(uint32_t base, int s) {
  return tile_descriptor<D>(base + ForwardSmem<D>::k + s * kBlockN * D);
}
template <int D>
__device__ __forceinline__ uint64_t v_descriptor(uint32_t base, int s) {
  return tile_descriptor<kBlockN>(base + ForwardSmem<D>::v + s * D * kBlockN);
}

// S = Q Kᵀ of one key tile issued (between mma_fence and mma_commit).
template <int D>
__device__ __forceinline__ void issue_scores(float (&sc)[64], uint64_t q_desc, uint64_t k_desc) {
  mma_ss_n128_first(sc, q_desc, k_desc);
#pragma unroll
  for (int kk = 1; kk < D / 32; ++kk) mma_ss_n128(sc, q_desc + 2 * kk, k_desc + 2 * kk);
}

// Tile j's S = Q Kᵀ in the consumer's turn at the tensor cores, waited on.
template <int D>
__device__ __forceinline__ void scores_in_turn(float (&sc)[64], uint64_t q_desc, uint64_t k_desc, const Turns& turns,
                                               int j) {
  turns.take();
  mma_fence();
  issue_scores<D>(sc, q_desc, k_desc);
  mma_commit();
  mma_wait_all();
  fence_registers(sc);
  turns.pass(j);
}

// d (+)= P V of one key tile issued: P the A fragments, V the stage's Vᵀ tile;
// ACCUMULATE false overwrites d.
template <int D, bool ACCUMULATE>
__device__ __forceinline__ void issue_values(float (&d)[D / 2], const uint32_t (&p8)[4][4], uint64_t v_desc) {
#pragma unroll
  for (int c = 0; c < 4; ++c) pv_step<D>(d, p8[c], v_desc + 2 * c, !ACCUMULATE && c == 0);
}

// softmax_rows on one tile of S, then P (times p_scale) cast to E4M3 as the A
// fragment of four k32 steps: step c's word w holds, for row0 (w even) or row0 + 8
// (w odd), S columns v2 = 4c + 2·(w / 2) + (0, 1): the thread's columns 2t, 2t + 1,
// 2t + 8, 2t + 9 of 16, or, where K came permuted (KP), 2t, 2t + 8, 2t + 1, 2t + 9
// (keys 4t .. 4t + 3; see the top of the file).
template <bool CAUSAL, bool KP>
__device__ __forceinline__ void softmax_tile(float (&sc)[64], uint32_t (&p8)[4][4], float (&alpha)[2],
                                             ConsumerRows& rows, int n0, int tk) {
  softmax_rows<CAUSAL, KP>(sc, alpha, rows, n0, tk);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int first = 4 * (4 * c + 2 * (w / 2)) + 2 * (w % 2);
      p8[c][w] = KP ? e4m3x4(sc[first], sc[first + 4], sc[first + 1], sc[first + 5])
                    : e4m3x4(sc[first], sc[first + 1], sc[first + 4], sc[first + 5]);
    }
  }
}

// A consumer warpgroup, each tile in order: S = Q Kᵀ, the softmax, O_tile = P V a
// fresh product added to O in fp32 (the Triton kernel's numerics).
template <int D, bool CAUSAL, bool KP>
__device__ __forceinline__ void consume_in_order(uint32_t base, int t0, int tiles, int tk, uint64_t q_desc,
                                                 const Turns& turns, ConsumerRows& rows, float (&acc)[D / 2]) {
  using S = ForwardSmem<D>;
  for (int j = 0; j < tiles; ++j) {
    const int s = (t0 + j) % kStages;
    wait_tile<S>(base, t0 + j);
    float sc[64];
    const uint64_t k_desc = k_descriptor<D>(base, s), v_desc = v_descriptor<D>(base, s);
    scores_in_turn<D>(sc, q_desc, k_desc, turns, j);
    float alpha[2];
    uint32_t p8[4][4];
    softmax_tile<CAUSAL, KP>(sc, p8, alpha, rows, j * kBlockN, tk);
    float tile_o[D / 2];
    mma_fence();
    issue_values<D, false>(tile_o, p8, v_desc);
    mma_commit();
    mma_wait_all();
    fence_registers(tile_o);
    release_tile<S>(base, t0 + j);  // its K and Vᵀ read
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = acc[i] * alpha[(i / 2) % 2] + tile_o[i];
  }
}

// One tile of consume_overlapped: tile j's S = Q Kᵀ and tile j - 1's P V (P from
// `previous`) issued together, the softmax of tile j (its P into `next`), then O
// rescaled. P alternates between two register sets rather than being copied
// (ptxas would see a copy's P rewritten while the product still reads it and
// serialize every product of the kernel). It still gives both sets the same
// registers and so waits for P V before the softmax, not after it; keeping the
// wait below the softmax was measured slower (ARCHITECTURE, RESULTS runs 201-202).
template <int D, bool CAUSAL, bool KP>
__device__ __forceinline__ void overlapped_tile(uint32_t base, int t0, int j, int tk, uint64_t q_desc,
                                                const Turns& turns, ConsumerRows& rows, float (&acc)[D / 2],
                                                uint32_t (&previous)[4][4], uint32_t (&next)[4][4]) {
  using S = ForwardSmem<D>;
  const int t = t0 + j;
  wait_tile<S>(base, t);
  const uint64_t k_desc = k_descriptor<D>(base, t % kStages), v_desc = v_descriptor<D>(base, (t - 1) % kStages);
  float sc[64];
  float alpha[2];
  turns.take();
  mma_fence();
  issue_scores<D>(sc, q_desc, k_desc);
  mma_commit();
  issue_values<D, true>(acc, previous, v_desc);
  mma_commit();
  turns.pass(j);
  mma_wait_all_but_newest();  // the scores
  fence_registers(sc);
  softmax_tile<CAUSAL, KP>(sc, next, alpha, rows, j * kBlockN, tk);
  mma_wait_all();  // P V of tile j - 1
  fence_registers(acc);
  fence_registers(previous);  // read by that product until here
  release_tile<S>(base, t - 1);
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] *= alpha[(i / 2) % 2];
}

// The last tile's P V of consume_overlapped, and its stage released.
template <int D>
__device__ __forceinline__ void last_values(uint32_t base, int t0, int tiles, float (&acc)[D / 2],
                                            uint32_t (&p8)[4][4]) {
  const int t = t0 + tiles - 1;
  const uint64_t v_desc = v_descriptor<D>(base, t % kStages);
  mma_fence();
  issue_values<D, true>(acc, p8, v_desc);
  mma_commit();
  mma_wait_all();
  fence_registers(acc);
  fence_registers(p8);
  release_tile<ForwardSmem<D>>(base, t);
}

// A consumer warpgroup with the next tile's S = Q Kᵀ and the last tile's P V in
// flight while it runs a softmax (a.overlap; overlapped_tile): P V adds into O in
// the tensor cores' accumulator (O rescaled in registers first), so O's sum over
// the tiles goes through their narrower accumulation: other bits than
// consume_in_order's, within the same bound.
template <int D, bool CAUSAL, bool KP>
__device__ __forceinline__ void consume_overlapped(uint32_t base, int t0, int tiles, int tk, uint64_t q_desc,
                                                   const Turns& turns, ConsumerRows& rows, float (&acc)[D / 2]) {
  using S = ForwardSmem<D>;
  uint32_t even[4][4], odd[4][4];  // P of the even and of the odd tiles
  {
    float sc[64];
    float alpha[2];
    wait_tile<S>(base, t0);
    scores_in_turn<D>(sc, q_desc, k_descriptor<D>(base, t0 % kStages), turns, 0);
    softmax_tile<CAUSAL, KP>(sc, even, alpha, rows, 0, tk);  // O is 0: alpha scales nothing
  }
  int j = 1;
  for (; j + 1 < tiles; j += 2) {
    overlapped_tile<D, CAUSAL, KP>(base, t0, j, tk, q_desc, turns, rows, acc, even, odd);
    overlapped_tile<D, CAUSAL, KP>(base, t0, j + 1, tk, q_desc, turns, rows, acc, odd, even);
  }
  if (j < tiles) {
    overlapped_tile<D, CAUSAL, KP>(base, t0, j, tk, q_desc, turns, rows, acc, even, odd);
    last_values<D>(base, t0, tiles, acc, odd);
  } else {
    last_values<D>(base, t0, tiles, acc, even);
  }
}

// A consumer warpgroup: 64 query rows of item n (its first tile the block's t0)
// through every key tile, its Q buffer released once every tile is read, then o
// and lse.
template <int D, bool CAUSAL, bool KP, typename TOut>
__device__ __forceinline__ void consume(const AttentionFp8Args& a, uint32_t base, const BlockWork& w, int n, int t0,
                                        int group, int tid) {
  using S = ForwardSmem<D>;
  ConsumerRows rows = ConsumerRows::of(w.m0, group, tid, a.qk_scale * a.scales[0] * a.scales[1], log2f(a.scales[3]));
  float acc[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;
  // this warpgroup's 64 rows of Q: whole swizzle groups
  const uint64_t q_desc = tile_descriptor<D>(base + S::q + (n % 2) * S::q_bytes + 64 * group * D);
  const Turns turns{a.turns, group, w.tiles};
  turns.start();
  wait_q<S>(base, n);
  if (a.overlap) {
    consume_overlapped<D, CAUSAL, KP>(base, t0, w.tiles, a.tk, q_desc, turns, rows, acc);
  } else {
    consume_in_order<D, CAUSAL, KP>(base, t0, w.tiles, a.tk, q_desc, turns, rows, acc);
  }
  release_q<S>(base, n);
  store_rows<D, TOut>(a, acc, rows, a.scales[2], w.b, w.h, tid % 32);
}

template <int D, bool CAUSAL, bool KP, typename TOut>
__global__ void __launch_bounds__(kForwardThreads, 1)
    attention_fp8_forward_kernel(const __grid_constant__ AttentionFp8Args a, const __grid_constant__ ForwardMaps maps) {
  extern __shared__ uint8_t smem_raw[];
  run_block<ForwardSmem<D>, CAUSAL>(
      a, smem_raw,
      [&](uint32_t base, const BlockWork& w, int n, int t0, int tid) { produce<D>(a, maps, base, w, n, t0, tid); },
      [&](uint32_t base, const BlockWork& w, int n, int t0, int group, int tid) {
        consume<D, CAUSAL, KP, TOut>(a, base, w, n, t0, group, tid);
      });
}

// --------------------------------------------------------------------------
// Vᵀ with its keys permuted (see the top of the file).
// --------------------------------------------------------------------------

// Block (128 keys, one kv head; rewrite_v_tile's 128 threads): the keys' rows into
// shared memory under the D-byte swizzle, as a tensor copy lands them (zeros past
// the last key), rewrite_v_tile into a Vᵀ tile, its rows out to vt. Every copy
// is of whole 16-byte chunks, eight lanes a 128-byte line.
template <int D>
__global__ void __launch_bounds__(kWarpgroup) v_keys_inner_kernel(const __grid_constant__ AttentionFp8Args a) {
  __shared__ alignas(1024) uint8_t raw[kBlockN * D];
  __shared__ alignas(1024) uint8_t tile[D * kBlockN];
  constexpr int chunks = kBlockN * D / 16 / kWarpgroup;  // a thread's, each way
  const int bh = blockIdx.y;
  const int b = bh / a.hkv, hk = bh % a.hkv;
  const int n0 = blockIdx.x * kBlockN;
  const uint8_t* v = a.v + int64_t(b) * a.v_stride_b + int64_t(hk) * a.v_stride_h;
  const uint32_t raw_at = shared_address(raw), tile_at = shared_address(tile);
  uint4 x[chunks];
#pragma unroll
  for (int i = 0; i < chunks; ++i) {  // every load in flight before the first store
    const int n = threadIdx.x + i * kWarpgroup, r = n / (D / 16);
    x[i] = make_uint4(0u, 0u, 0u, 0u);
    if (n0 + r < a.tk) x[i] = *reinterpret_cast<const uint4*>(v + int64_t(n0 + r) * a.v_stride_t + 16 * (n % (D / 16)));
  }
#pragma unroll
  for (int i = 0; i < chunks; ++i) {
    const int n = threadIdx.x + i * kWarpgroup;
    store_shared16(raw_at + swizzled<D>(n / (D / 16), n % (D / 16)), x[i]);
  }
  __syncthreads();
  rewrite_v_tile<D>(raw_at, tile_at, threadIdx.x);
  __syncthreads();
  uint8_t* vt = a.vt + int64_t(bh) * D * a.vt_pitch + n0;
#pragma unroll
  for (int i = 0; i < chunks; ++i) {
    const int n = threadIdx.x + i * kWarpgroup, d = n / (kBlockN / 16), c = n % (kBlockN / 16);
    *reinterpret_cast<uint4*>(vt + int64_t(d) * a.vt_pitch + 16 * c) = load_shared16(tile_at + swizzled<kBlockN>(d, c));
  }
}

// The forward's tensor maps (ForwardMaps's layouts) of a's q, k and vt.
template <int D>
ForwardMaps forward_maps(const AttentionFp8Args& a) {
  static_assert(kBlockM == kBlockN, "q and k copied in boxes of one shape");
  ForwardMaps maps{};
  const uint32_t rows[4] = {uint32_t(D), uint32_t(kBlockN), 1u, 1u};
  maps.q = byte_tensor_map<4>(a.q, {uint64_t(D), uint64_t(a.tq), uint64_t(a.h), uint64_t(a.batch)},
                              {uint64_t(a.q_stride_t), uint64_t(a.q_stride_h), uint64_t(a.q_stride_b)}, rows,
                              "attention_fp8_forward's q");
  if (a.keys_permuted) {
    const uint64_t st = uint64_t(a.k_stride_t), fold = a.kp_batch_keys ? uint64_t(a.batch) : 1u;
    maps.k = byte_tensor_map<5>(
        a.k, {uint64_t(D), 8u, 2u, fold * uint64_t(a.tk) / 16, uint64_t(a.hkv) * (uint64_t(a.batch) / fold)},
        {2 * st, st, 16 * st, uint64_t(a.k_stride_h)}, {uint32_t(D), 8u, 2u, uint32_t(kBlockN / 16), 1u},
        "attention_fp8_forward's k (its keys permuted)");
    maps.vt = byte_tensor_map<4>(a.v, {uint64_t(a.tk), uint64_t(D), uint64_t(a.hkv), uint64_t(a.batch)},
                                 {uint64_t(a.v_stride_d), uint64_t(a.v_stride_h), uint64_t(a.v_stride_b)},
                                 {uint32_t(kBlockN), uint32_t(D), 1u, 1u}, "attention_fp8_forward's v (keys inner)");
    return maps;
  }
  maps.k = byte_tensor_map<4>(a.k, {uint64_t(D), uint64_t(a.tk), uint64_t(a.hkv), uint64_t(a.batch)},
                              {uint64_t(a.k_stride_t), uint64_t(a.k_stride_h), uint64_t(a.k_stride_b)}, rows,
                              "attention_fp8_forward's k");
  maps.v = byte_tensor_map<4>(a.v, {uint64_t(D), uint64_t(a.tk), uint64_t(a.hkv), uint64_t(a.batch)},
                              {uint64_t(a.v_stride_t), uint64_t(a.v_stride_h), uint64_t(a.v_stride_b)}, rows,
                              "attention_fp8_forward's v");
  if (!a.v_in_kernel) {
    maps.vt = byte_tensor_map<2>(a.vt, {uint64_t(a.vt_pitch), uint64_t(a.batch) * a.hkv * D},
                                 {uint64_t(a.vt_pitch)}, {uint32_t(kBlockN), uint32_t(D)},
                                 "attention_fp8_forward's vt");
  }
  return maps;
}

template <int D, bool CAUSAL, typename TOut>
void launch_forward(const AttentionFp8Args& a, cudaStream_t stream) {
  if (a.keys_permuted) {
    launch_blocks<attention_fp8_forward_kernel<D, CAUSAL, true, TOut>, ForwardSmem<D>>(
        a, stream, "attention_fp8_forward", forward_maps<D>(a));
  } else {
    launch_blocks<attention_fp8_forward_kernel<D, CAUSAL, false, TOut>, ForwardSmem<D>>(
        a, stream, "attention_fp8_forward", forward_maps<D>(a));
  }
}

template <int D>
void launch_transpose(const AttentionFp8Args& a, cudaStream_t stream) {
  const dim3 grid(unsigned(a.vt_pitch / kBlockN), unsigned(a.batch * a.hkv));
  v_keys_inner_kernel<D><<<grid, kWarpgroup, 0, stream>>>(a);
  check_launch("attention_fp8_forward (the keys-inner V)");
}

template <int D>
void launch_with_dim(const AttentionFp8Args& a, int out_type, cudaStream_t stream) {
  if (!a.v_in_kernel && !a.keys_permuted) launch_transpose<D>(a, stream);
  dispatch_hp(out_type, "attention_fp8_forward", [&](auto tag) {
    using TOut = typename decltype(tag)::type;
    if (a.causal) {
      launch_forward<D, true, TOut>(a, stream);
    } else {
      launch_forward<D, false, TOut>(a, stream);
    }
  });
}

}  // namespace

int64_t attention_fp8_vt_pitch(int64_t tk) { return (tk + kBlockN - 1) / kBlockN * kBlockN; }

void launch_attention_fp8_keys_inner(const AttentionFp8Args& a, void* stream) {
  if (a.batch <= 0 || a.hkv <= 0 || a.vt_pitch <= 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (a.head_dim == 128) {
    launch_transpose<128>(a, s);
  } else if (a.head_dim == 64) {
    launch_transpose<64>(a, s);
  } else {
    throw std::invalid_argument("attention_fp8_keys_inner: head dim " + std::to_string(a.head_dim) +
                                " is not 64 or 128");
  }
}

void launch_attention_fp8_forward(const AttentionFp8Args& a, int out_type, void* stream) {
  if (a.batch <= 0 || a.h <= 0 || a.tq <= 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (a.head_dim == 128) {
    launch_with_dim<128>(a, out_type, s);
  } else if (a.head_dim == 64) {
    launch_with_dim<64>(a, out_type, s);
  } else {
    throw std::invalid_argument("attention_fp8_forward: head dim " + std::to_string(a.head_dim) +
                                " is not 64 or 128");
  }
}

}  // namespace te_fuser
