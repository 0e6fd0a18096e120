// The pieces of the hand-written Hopper attention kernels (attention_kernels.cu:
// FP8; attention_hp_kernels.cu: bf16 and fp16) that do not depend on the element
// type: shared-memory addresses, mbarriers and asynchronous copies (16-byte and
// tensor copies, and the tensor maps of the latter), the swizzle and wgmma's
// descriptors of K-major tiles, the wgmma fences and operand lists, a consumer
// warpgroup's rows and online softmax, its turns at the tensor cores and its
// stores, the 16-byte copying producer's side of the ring, and a block's setup
// and launch.
//
// Layout of a block (both kernels): 128 queries of one head; warpgroup 0 the
// producer, warpgroups 1 and 2 consumers of 64 rows each; key tiles of 128. A
// consumer thread holds, in wgmma's accumulator layout, rows row0 and row0 + 8 and
// of every 8 columns the two from col (sc[i]: row (i / 2) % 2, column
// 8·(i / 4) + col + i % 2).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "dispatch.cuh"

namespace te_fuser {
namespace attention {

constexpr int kBlockM = 128;  // queries of a block: two consumer warpgroups of 64 rows
constexpr int kBlockN = 128;  // keys of a tile
constexpr int kWarpgroup = 128;
constexpr int kForwardThreads = 3 * kWarpgroup;
constexpr float kLn2 = 0.6931471805599453f;

// --------------------------------------------------------------------------
// Shared memory: addresses, barriers, asynchronous copies, swizzle.
// --------------------------------------------------------------------------

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}

// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One arrival on the barrier that also expects `bytes` more bytes of asynchronous
// copies (the tensor copies' complete_tx) before its phase completes.
__device__ __forceinline__ void barrier_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

// A box of the tensor `map` (a __grid_constant__ CUtensorMap) at coordinates
// (c0 innermost ..) into shared memory at dst, by the tensor memory accelerator:
// swizzled as the map says, zeros outside the tensor, its bytes counted on `bar`.
__device__ __forceinline__ void tensor_copy_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tensor_copy_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                               uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tensor_copy_5d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                               int c4, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], "
      "[%7];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

// The map's descriptor fetched ahead of its first copy.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 16 bytes from global to shared memory, asynchronously; zeros where !valid.
__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// Named barriers 1 and 2 (0 is __syncthreads'): the consumers' turns at the tensor cores.
__device__ __forceinline__ void turn_wait(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(2 * 128) : "memory");
}
__device__ __forceinline__ void turn_pass(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(2 * 128) : "memory");
}

__device__ __forceinline__ void copies_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// One arrival on the barrier once every cp.async this thread has issued so far has
// landed (the thread goes on at once; .noinc: the barrier's count includes it).
__device__ __forceinline__ void barrier_arrive_when_copied(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Shared-memory writes this thread has seen land (cp.async writes through the
// generic proxy; a barrier wait made them visible) ordered before its tensor
// cores' reads (wgmma reads through the async proxy).
__device__ __forceinline__ void fence_for_tensor_cores() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of ROW-byte rows
// under the ROW-byte swizzle (ROW 128 or 64; the tile 1024-byte aligned).
template <int ROW>
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  static_assert(ROW == 128 || ROW == 64, "rows of 64 or 128 bytes");
  const uint32_t linear = uint32_t(row * ROW + chunk * 16);
  constexpr uint32_t mask = ROW == 128 ? 7u : 3u;
  return linear ^ (((linear >> 7) & mask) << 4);
}

// wgmma's descriptor of a K-major tile of ROW-byte rows at shared address `addr`:
// the start address (16-byte units), the leading offset (unused by swizzled
// K-major tiles: 1), the stride between 8-row groups, the swizzle (1: 128 B, 2: 64 B).
// Adding 2 to it moves the start 32 bytes along K (the next k32 step).
template <int ROW>
__device__ __forceinline__ uint64_t tile_descriptor(uint32_t addr) {
  constexpr uint64_t swizzle = ROW == 128 ? 1 : 2;
  constexpr uint64_t group_stride = (8 * ROW) >> 4;
  return uint64_t((addr >> 4) & 0x3FFFu) | (uint64_t(1) << 16) | (group_stride << 32) | (swizzle << 62);
}

// --------------------------------------------------------------------------
// wgmma.
// --------------------------------------------------------------------------

__device__ __forceinline__ void mma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void mma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void mma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void mma_wait_all_but_newest() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}

// The products as inline PTX. d is the fp32 accumulator fragment (64 or 32
// registers; asm operands %0 .. %63 or %31); a "first" step only writes d
// (scale-d 0, "=f"), so the instructions that read the last tile's d are no inputs
// of it; the others add to it ("+f").
#define TE_D8(c, i) c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3]), c(d[i + 4]), c(d[i + 5]), c(d[i + 6]), c(d[i + 7])
#define TE_D32(c) TE_D8(c, 0), TE_D8(c, 8), TE_D8(c, 16), TE_D8(c, 24)
#define TE_D64(c) TE_D32(c), TE_D8(c, 32), TE_D8(c, 40), TE_D8(c, 48), TE_D8(c, 56)
#define TE_R32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define TE_R64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// One wgmma of `shape` and input `types` into fp32: d, the operands, then the
// immediates after scale-d (scale-a, scale-b and, 16-bit inputs, the transposes).
#define TE_WGMMA(shape, types, scale_d, d_regs, operands, immediates)                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " #scale_d ", 0;\n"                                  \
  "wgmma.mma_async.sync.aligned." shape ".f32." types " " d_regs ", " operands ", p, " \
  immediates ";\n}\n"
// A from registers (its four words a[0..3]), then b's descriptor.
#define TE_A_OPERANDS "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)

// After mma_wait_all: the registers' reads stay behind the wait.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// After mma_wait_all: A fragments an asynchronous product read stay as they are until here.
__device__ __forceinline__ void fence_registers(uint32_t (&p)[4][4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int w = 0; w < 4; ++w) asm volatile("" : "+r"(p[c][w])::"memory");
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename TOut>
__device__ __forceinline__ void store_pair(TOut* p, float a, float b);
template <>
__device__ __forceinline__ void store_pair<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ void store_pair<__half>(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

// A consumer's view of its block: its rows and columns in the accumulator layout,
// the scales, and the running maximum and sum of its two rows.
struct ConsumerRows {
  int row0;          // this thread's rows: row0 and row0 + 8
  int col;           // its columns of every 8: col and col + 1
  int first_row;     // the warpgroup's first row
  float qk_scale;    // softmax_scale · log2 e (FP8: times q's and k's scale_inv)
  float p_shift;     // log2 p_scale (FP8; 0 where P is not scaled)
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};  // this thread's part of each row's sum (its lanes' parts added at the end)

  // Thread tid of consumer `group` of the block whose first row is m0.
  static __device__ __forceinline__ ConsumerRows of(int m0, int group, int tid, float qk_scale, float p_shift) {
    ConsumerRows rows;
    rows.row0 = m0 + 64 * group + 16 * (tid / 32) + (tid % 32) / 4;
    rows.col = 2 * (tid % 4);
    rows.first_row = m0 + 64 * group;
    rows.qk_scale = qk_scale;
    rows.p_shift = p_shift;
    return rows;
  }
};

// The online softmax on one tile of S (rows row0, row0 + 8; key n0 + 8·(i / 4) +
// col + i % 2 in sc[i], or with KEYS_PERMUTED the key K's permuted copy put in that
// column; row (i / 2) % 2): masked keys to -inf (past tk, and above
// the diagonal when causal), the new running maximum, alpha = exp2(m_old - m_new)
// per row, and sc[i] = p · p_scale = exp2(s · qk_scale - m_new + p_shift), added to
// the rows' sums (p_shift 0 where P is not scaled).
template <bool CAUSAL, bool KEYS_PERMUTED = false>
__device__ __forceinline__ void softmax_rows(float (&sc)[64], float (&alpha)[2], ConsumerRows& rows, int n0,
                                             int tk) {
  if (n0 + kBlockN > tk || (CAUSAL && n0 + kBlockN - 1 > rows.first_row)) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      // column c = 8 (i / 4) + col + i % 2 of S holds key c, or, where K's rows were
      // copied permuted (attention_kernels.cu), key 16 (c / 16) + 2 (c % 8) + (c / 8) % 2
      const int key = KEYS_PERMUTED ? n0 + 16 * (i / 8) + 2 * (rows.col + i % 2) + (i / 4) % 2
                                    : n0 + 8 * (i / 4) + rows.col + i % 2;
      const int row = rows.row0 + 8 * ((i / 2) % 2);
      if (key >= tk || (CAUSAL && key > row)) sc[i] = -INFINITY;
    }
  }
  float shift[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int v2 = 0; v2 < 16; ++v2) mx = fmaxf(mx, fmaxf(sc[4 * v2 + 2 * r], sc[4 * v2 + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
    const float m_new = fmaxf(rows.m[r], mx * rows.qk_scale);  // qk_scale > 0: the scaled maximum, exactly
    alpha[r] = fast_exp2(rows.m[r] - m_new);
    shift[r] = rows.p_shift - m_new;
    rows.m[r] = m_new;
  }
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    sc[i] = fast_exp2(fmaf(sc[i], rows.qk_scale, shift[(i / 2) % 2]));
    sum[(i / 2) % 2] += sc[i];
  }
  rows.l[0] = rows.l[0] * alpha[0] + sum[0];
  rows.l[1] = rows.l[1] * alpha[1] + sum[1];
}

// Turns of a block's two consumer warpgroups at the tensor cores (when on): consumer 0 waits on named barrier 1 and
// passes to 2, consumer 1 the other way round; consumer 1 passes first and skips
// its last pass, so every barrier sees as many passes as waits.
struct Turns {
  bool on;
  int group;
  int tiles;
  __device__ __forceinline__ void start() const {
    if (on && group == 1) turn_pass(1);
  }
  __device__ __forceinline__ void take() const {
    if (on) turn_wait(1 + group);
  }
  __device__ __forceinline__ void pass(int j) const {
    if (on && !(group == 1 && j == tiles - 1)) turn_pass(2 - group);
  }
};

// o = out_scale · acc / l and lse = (m + log2 l - p_shift) · ln 2 of the rows before
// a.tq, from a consumer's accumulator (rows row0 and row0 + 8, columns col + 8·v2
// and one more). Args: the forward's operands (o, its strides, lse, h, tq).
template <int D, typename TOut, typename Args>
__device__ __forceinline__ void store_rows(const Args& a, const float (&acc)[D / 2], const ConsumerRows& rows,
                                           float out_scale, int b, int h, int lane) {
  TOut* o = static_cast<TOut*>(a.o) + int64_t(b) * a.o_stride_b + int64_t(h) * a.o_stride_h;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = rows.l[r];
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 1);
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 2);
    const int row = rows.row0 + 8 * r;
    if (row >= a.tq) continue;
    const float inv = out_scale / l;
    TOut* o_row = o + int64_t(row) * a.o_stride_t + rows.col;
#pragma unroll
    for (int v2 = 0; v2 < D / 8; ++v2) {
      store_pair(o_row + 8 * v2, acc[4 * v2 + 2 * r] * inv, acc[4 * v2 + 2 * r + 1] * inv);
    }
    if (lane % 4 == 0) a.lse[(int64_t(b) * a.h + h) * a.tq + row] = (rows.m[r] + log2f(l) - rows.p_shift) * kLn2;
  }
}

// A block's mbarriers, placed at byte AT of its shared memory (past its buffers):
// q_full and q_empty of the two Q buffers, then full and empty of each of STAGES
// ring stages. A kernel's shared-memory layout derives from it, and may restate
// how many producer threads arrive on a full barrier (the copying threads), how
// the copies write (generic_copies: cp.async, which the consumers fence for their
// tensor cores) and the registers each role keeps after setmaxnreg (per mask).
template <int STAGES, int AT>
struct RingBarriers {
  static constexpr int stages = STAGES;
  static constexpr int bytes = AT + 8 * (4 + 2 * STAGES);
  static constexpr int producer_arrivals = kWarpgroup;
  static constexpr int later_tile_arrivals = 0;  // a full barrier's arrivals after the copies' (work on the tile)
  static constexpr bool generic_copies = true;  // cp.async: a consumer fences what it waited for (wait_q, wait_tile)
  template <bool CAUSAL>
  static constexpr int producer_registers = 48;
  template <bool CAUSAL>
  static constexpr int consumer_registers = 224;
  static __device__ __forceinline__ uint32_t q_full(uint32_t base, int b) { return base + AT + 8 * b; }
  static __device__ __forceinline__ uint32_t q_empty(uint32_t base, int b) { return base + AT + 8 * (2 + b); }
  static __device__ __forceinline__ uint32_t full(uint32_t base, int s) { return base + AT + 8 * (4 + s); }
  static __device__ __forceinline__ uint32_t empty(uint32_t base, int s) { return base + AT + 8 * (4 + STAGES + s); }
  // A kernel's barriers past these (at `bytes`), initialized by thread 0 with the ring's.
  static __device__ __forceinline__ void init_more(uint32_t) {}
};

// What a block works on: batch b, query head h, its kv head hk, the first query row
// m0 and the key tiles its queries see (causal: those up to its last row's diagonal).
struct BlockWork {
  int b, h, hk, m0, tiles;
};

// The work items of a forward: its query blocks of 128 rows for every (batch, head).
template <typename Args>
__host__ __device__ __forceinline__ int work_items(const Args& a) {
  return (a.tq + kBlockM - 1) / kBlockM * (a.batch * a.h);
}

// Work item `item`: the items run longest first (causal: the last query blocks,
// whose rows see the most keys), every (batch, head) at one rank before the next.
template <bool CAUSAL, typename Args>
__device__ __forceinline__ BlockWork block_work(const Args& a, int item) {
  const int blocks = (a.tq + kBlockM - 1) / kBlockM;
  const int heads = a.batch * a.h;
  const int rank = item / heads, bh = item % heads;
  const int block = CAUSAL ? blocks - 1 - rank : rank;
  BlockWork w;
  w.b = bh / a.h;
  w.h = bh % a.h;
  w.hk = w.h / (a.h / a.hkv);
  w.m0 = block * kBlockM;
  const int key_end = CAUSAL ? min(a.tk, w.m0 + kBlockM) : a.tk;
  w.tiles = (key_end + kBlockN - 1) / kBlockN;
  return w;
}

// The block's shared memory (1024-byte aligned), its barriers initialized (Smem:
// q_full and q_empty of two Q buffers, full and empty of Smem::stages stages) and
// seen by every thread.
template <typename Smem>
__device__ __forceinline__ uint32_t block_shared_memory(uint8_t* smem_raw) {
  const uint32_t base = (shared_address(smem_raw) + 1023u) & ~1023u;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int buffer = 0; buffer < 2; ++buffer) {
      barrier_init(Smem::q_full(base, buffer), Smem::producer_arrivals);  // the producer's copying threads
      barrier_init(Smem::q_empty(base, buffer), 2 * kWarpgroup);  // both consumers' threads
    }
#pragma unroll
    for (int s = 0; s < Smem::stages; ++s) {
      // the producer's copying threads, and its arrivals once it worked on the tile
      barrier_init(Smem::full(base, s), Smem::producer_arrivals + Smem::later_tile_arrivals);
      barrier_init(Smem::empty(base, s), 2 * kWarpgroup);  // both consumers' threads
    }
    Smem::init_more(base);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  return base;
}

// A warpgroup's registers a thread from here on (setmaxnreg): fewer, or more.
template <int N>
__device__ __forceinline__ void fewer_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void more_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// kernel launched on `grid` blocks of 384 threads with Smem::bytes of dynamic shared
// memory and the slack block_shared_memory aligns within (the attribute set once
// per kernel and device); its arguments a, then `more`.
template <auto kernel, typename Smem, typename Args, typename... More>
void launch_on(dim3 grid, const Args& a, cudaStream_t stream, const char* name, const More&... more) {
  constexpr int bytes = Smem::bytes + 1024;
  static bool sized[64] = {false};  // per kernel (a template argument) and device
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= 64 || !sized[device]) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), name);
    if (device >= 0 && device < 64) sized[device] = true;
  }
  kernel<<<grid, kForwardThreads, bytes, stream>>>(a, more...);
  check_launch(name);
}

// Launch of a forward kernel: one block an SM (or one an item, if fewer).
template <auto kernel, typename Smem, typename Args, typename... More>
void launch_blocks(const Args& a, cudaStream_t stream, const char* name, const More&... more) {
  launch_on<kernel, Smem>(dim3(unsigned(std::min(work_items(a), sm_count()))), a, stream, name, more...);
}

// The driver's cuTensorMapEncodeTiled, asked of the runtime once (no link to the
// driver library).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found),
               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled (tensor copies need CUDA 12 or later)");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The tensor map of a byte tensor of RANK dims at `data` (dims[0] innermost and
// contiguous; strides[i] the bytes between steps of dim i + 1), copied in boxes of
// `box` whose rows (box[0] bytes: 64 or 128) land under the swizzle of that many
// bytes, as wgmma's descriptors read them (tile_descriptor). `what` names the
// operand in an error.
template <int RANK>
CUtensorMap byte_tensor_map(const void* data, const uint64_t (&dims)[RANK], const uint64_t (&strides)[RANK - 1],
                            const uint32_t (&box)[RANK], const char* what) {
  CUtensorMap map;
  uint32_t unit[RANK];
  for (int i = 0; i < RANK; ++i) unit[i] = 1;
  const CUtensorMapSwizzle swizzle = box[0] == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const CUresult status = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, RANK, const_cast<void*>(data), dims, strides, box, unit,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    throw std::runtime_error(std::string("cuTensorMapEncodeTiled failed for ") + what + " (CUresult " +
                             std::to_string(int(status)) + ")");
  }
  return map;
}

// The ring of a block's shared memory (Smem: q_full and q_empty of two Q buffers,
// full and empty of Smem::stages stages). Item n's Q sits in buffer n % 2; the
// block's tile t (counted over its items) in stage t % stages; the round n / 2 or
// t / stages names the phase a barrier completes for it. A consumer's waits end
// with the copies ordered before its tensor cores' reads.
template <typename Smem>
__device__ __forceinline__ void wait_q(uint32_t base, int n) {
  barrier_wait(Smem::q_full(base, n % 2), (n / 2) & 1);
  if constexpr (Smem::generic_copies) fence_for_tensor_cores();
}
template <typename Smem>
__device__ __forceinline__ void release_q(uint32_t base, int n) {
  barrier_arrive(Smem::q_empty(base, n % 2));
}
template <typename Smem>
__device__ __forceinline__ void wait_tile(uint32_t base, int t) {
  barrier_wait(Smem::full(base, t % Smem::stages), (t / Smem::stages) & 1);
  if constexpr (Smem::generic_copies) fence_for_tensor_cores();
}
template <typename Smem>
__device__ __forceinline__ void release_tile(uint32_t base, int t) {
  barrier_arrive(Smem::empty(base, t % Smem::stages));
}

// The producer's side of the ring for item n, whose first tile is the block's
// tile t0: copy_q(buffer) once both consumers released the buffer's last Q, then
// copy_tile(j, stage) for each of `tiles` tiles once both released the stage's
// last tile. The producer never waits for a copy: a tile is published as soon as
// it is in, whatever the stages after it wait for. 16-byte copies
// (Smem::generic_copies) arrive on their barrier from each thread when they land
// (the consumers fence them for their tensor cores: wait_q, wait_tile); tensor
// copies are one thread's, whose copy_q and copy_tile arrive on the barrier with
// the bytes to expect before copying.
template <typename Smem, typename CopyQ, typename CopyTile>
__device__ __forceinline__ void produce_ring(uint32_t base, int n, int t0, int tiles, CopyQ copy_q,
                                             CopyTile copy_tile) {
  if (n >= 2) barrier_wait(Smem::q_empty(base, n % 2), ((n / 2) - 1) & 1);
  copy_q(n % 2);
  if constexpr (Smem::generic_copies) barrier_arrive_when_copied(Smem::q_full(base, n % 2));
  for (int j = 0; j < tiles; ++j) {
    const int t = t0 + j, s = t % Smem::stages;
    if (t >= Smem::stages) barrier_wait(Smem::empty(base, s), ((t / Smem::stages) - 1) & 1);
    copy_tile(j, s);
    if constexpr (Smem::generic_copies) barrier_arrive_when_copied(Smem::full(base, s));
  }
}

// This block's items: f(work, n, t0), n counting the block's items, t0 the tiles of
// the items before. The list is dealt out in rounds of gridDim.x items, in turn
// forwards and backwards (block i takes round 0's i-th item, round 1's i-th from the
// end, ...): under the causal mask items shrink down the list, so a block given a
// long item in one round gets a short one in the next, and the blocks end together.
// Dealt forwards every round, the first blocks would take the longest item of every
// round: 6% above the mean at 4 x 16 heads of 4096 queries on 132 SMs, against 0.1%
// (benchmarks/forward_items.py); measured there on an H100, the FP8 forward 1.3-1.5%
// and the bf16 one 3.7% faster, level at the GPT's 1024 keys (RESULTS.md run 270).
// a.mirrored off: forwards every round, to time against.
template <bool CAUSAL, typename Args, typename F>
__device__ __forceinline__ void for_each_item(const Args& a, F f) {
  const int items = work_items(a);
  const int blocks = int(gridDim.x), mirrored = a.mirrored ? blocks - 1 - int(blockIdx.x) : int(blockIdx.x);
  int t0 = 0;
  for (int n = 0;; ++n) {
    const int item = n * blocks + ((n & 1) ? mirrored : int(blockIdx.x));
    if (item >= items) break;  // a block's items only grow down the rounds
    const BlockWork w = block_work<CAUSAL>(a, item);
    f(w, n, t0);
    t0 += w.tiles;
  }
}

// A forward block, persistent: its shared memory, then item after item
// produce(base, work, n, t0, tid) in warpgroup 0 and consume(base, work, n, t0,
// group, tid) in consumers 0 and 1. The producer runs ahead into the next item
// (its Q in the other buffer, its tiles in the ring) while the consumers finish
// one and store it. Each role loops after its setmaxnreg: a loop both share would
// be compiled to the kernel's launch limit of registers.
template <typename Smem, bool CAUSAL, typename Args, typename Produce, typename Consume>
__device__ __forceinline__ void run_block(const Args& a, uint8_t* smem_raw, Produce produce, Consume consume) {
  const uint32_t base = block_shared_memory<Smem>(smem_raw);
  const int group = threadIdx.x / kWarpgroup;
  const int tid = threadIdx.x % kWarpgroup;
  if (group == 0) {
    fewer_registers<Smem::template producer_registers<CAUSAL>>();
    for_each_item<CAUSAL>(a, [&](const BlockWork& w, int n, int t0) { produce(base, w, n, t0, tid); });
    if constexpr (Smem::generic_copies) copies_wait_all();  // not gone before its last copies have landed (and arrived)
  } else {
    more_registers<Smem::template consumer_registers<CAUSAL>>();
    for_each_item<CAUSAL>(a, [&](const BlockWork& w, int n, int t0) { consume(base, w, n, t0, group - 1, tid); });
  }
}

}  // namespace attention
}  // namespace te_fuser
