// Host entry points of the CUDA kernels, in plain C++ types.
//
// The Python launchers (kernels/cuda/cast.py, gemm.py, scaling.py) check shapes, dtypes and
// devices, and binding.cpp's entries (or the launchers) allocate the outputs and
// pass raw device pointers here. Nothing here includes a torch header, so
// the kernels build and compile-check without a CUDA build of PyTorch.
//
// Type codes: high precision 0 = float32, 1 = bfloat16, 2 = float16;
// FP8 0 = e4m3fn, 1 = e5m2. `stream` is a cudaStream_t.
// Every function throws std::runtime_error when a launch fails.
#pragma once

#include <cstdint>

namespace te_fuser {

// Delayed scaling's state update from a cast's amax (device pointers; the rules of
// launch_delayed_scale_update): the history, the scale the cast used and the count
// read, the new history, scale, scale_inv and count written. The one-launch cast's
// block 0 runs it once the amax is reduced (new_history null: no update); the
// separate launches leave it to launch_delayed_scale_update.
struct DelayedUpdate {
  const float* history = nullptr;
  const int64_t* count = nullptr;
  float* new_history = nullptr;
  float* new_scale = nullptr;
  float* new_scale_inv = nullptr;
  int64_t* new_count = nullptr;
  int64_t length = 0;
  int margin_steps = 0;
  float margin_rest = 1.0f;
  float fmax = 0.0f;
  bool algo_max = true;
};

// Where a cast's scale comes from and where its by-products go (device pointers).
struct CastScaling {
  // Delayed scaling: the fp32 scale to cast with, and where amax(|x|) is written
  // (zeroed first, then reduced into).
  const float* scale = nullptr;
  float* amax_out = nullptr;
  // Current scaling: amax(|x|) given (amax_in), or the per-block partial maxima
  // of launch_amax_partials (fp32 bits), which the cast reduces and whose total
  // it writes to amax_total_out. The cast derives the scale from the amax and
  // writes the scale and its reciprocal once.
  const float* amax_in = nullptr;
  const uint32_t* amax_partials = nullptr;
  int64_t amax_partial_count = 0;
  float* amax_total_out = nullptr;
  float* scale_out = nullptr;
  float* scale_inv_out = nullptr;
  float epsilon = 0.0f;
  bool power_2 = false;
  // With a transposed copy (either scaling): also the column sums of each tile
  // (fp32, (row tiles, cols), row tile i holding rows [128 i, 128 i + 128)),
  // which the caller adds up over the row tiles (a bias gradient).
  float* column_partials = nullptr;
  // The cast reads x rounded to bf16 (bf16_value): the copies and the amax are those
  // of x.to(bfloat16), the column sums those of x as given. Transposing casts only.
  bool round_bf16 = false;
  // The transposing cast in one cooperative launch of this many blocks (from
  // cast_one_launch_blocks; 0: the separate launches). It needs block_partials, one
  // word per block: under current scaling without a given amax, the amax pass's
  // maxima (then also amax_partials, amax_partial_count = the blocks); under
  // delayed scaling, the blocks' maxima, whose maximum goes to amax_out (nothing
  // zeroed first). With column sums, sums_out (cols,) gets the tiles' sums added
  // up over the row tiles.
  int64_t one_launch_blocks = 0;
  uint32_t* block_partials = nullptr;
  void* sums_out = nullptr;
  // sums_out holds bf16 values (a bf16 bias's gradient): each fp32 total rounded
  // once to the nearest bf16, ties to even, as x.sum(0, dtype=float32).to(bfloat16).
  bool sums_bf16 = false;
};

// Blocks of the one-launch transposing cast of x (rows, cols) (see CastScaling),
// or 0 where the separate launches run: an empty x, a device without cooperative
// launches, one-launch casts turned off (set_one_launch_casts), or a stream being
// captured into a CUDA graph while they are off there (set_one_launch_casts_in_capture;
// captured, the launch is a cooperative kernel node).
int64_t cast_one_launch_blocks(int hp_type, int fp8_type, bool current, bool sums, int64_t rows, int64_t cols,
                               void* stream);
// Turns the one-launch casts on or off for this process; returns the previous state.
bool set_one_launch_casts(bool enable);
// Whether they also run in a CUDA graph being captured (default: yes); returns the previous state.
bool set_one_launch_casts_in_capture(bool enable);

// amax(|x|) of `numel` elements into amax_out (fp32, one element).
void launch_amax(const void* x, int hp_type, int64_t numel, float* amax_out, void* stream);

// The same pass without zeroing anything first: each block's maximum (fp32 bits)
// into partials[0, amax_partial_count(numel)), for a current-scaling cast to reduce.
int64_t amax_partial_count(int64_t numel);
void launch_amax_partials(const void* x, int hp_type, int64_t numel, uint32_t* partials, void* stream);

// out (batches, cols) = partials (batches, rows, cols) summed over the rows in fp32,
// each column's rows added in order (the same bits on every run); out_bf16: out
// holds bf16, each fp32 total rounded once to the nearest (ties to even).
void launch_sum_rows(const float* partials, int64_t batches, int64_t rows, int64_t cols, void* out, void* stream,
                     bool out_bf16 = false);

// Tensor-scaled cast of x (rows, cols), row-major. `out` (rows, cols) and / or
// `out_t` (cols, rows) may be null. Current scaling when scaling.amax_in is set,
// delayed scaling otherwise; scaling.column_partials needs out_t. `update`
// (delayed scaling, the one launch only: scaling.one_launch_blocks > 0) is the
// state update its block 0 runs from the amax; default: none.
void launch_cast(const void* x, int hp_type, int fp8_type, int64_t rows, int64_t cols, uint8_t* out,
                 uint8_t* out_t, const CastScaling& scaling, void* stream, const DelayedUpdate& update = {});

// One scale per row: out (rows, cols), scale_inv (rows,) fp32.
void launch_quantize_rowwise(const void* x, int hp_type, int fp8_type, int64_t rows, int64_t cols,
                             uint8_t* out, float* scale_inv, bool power_2, float epsilon, void* stream);

// MXFP8 along the last dim: one E8M0 byte per 32 consecutive elements
// (numel a multiple of 32; rows never straddle a block).
void launch_quantize_mxfp8(const void* x, int hp_type, int fp8_type, int64_t numel, uint8_t* out,
                           uint8_t* scales, void* stream);

// Activation codes of the GEMM epilogue.
enum EpilogueActivation : int { kActNone = 0, kActGelu = 1, kActRelu = 2, kActSilu = 3, kActSwiglu = 4 };

// The epilogue's bias type beside the high-precision codes: an fp32 bias that the
// kernel rounds to bf16 as it reads it (the bits of bias.to(bfloat16) first).
constexpr int kBiasFp32AsBf16 = 3;

// out (rows, out_cols) = activation(y + bias) + residual, in fp32, for a GEMM
// result y (rows, in_cols): in_cols = 2 * out_cols for SwiGLU, else out_cols.
// bias (in_cols,) and residual (rows, out_cols) may be null; bias_type may also be
// kBiasFp32AsBf16. out may alias y when both have the same type and shape.
// out_cols must be a multiple of 8.
void launch_epilogue(const void* y, int y_type, const void* bias, int bias_type, const void* residual,
                     int residual_type, void* out, int out_type, int64_t rows, int64_t out_cols, int activation,
                     void* stream);

// Delayed scaling's state after recording amax (one fp32) into history (length
// fp32, newest first), from the previous scale (fp32) and count of skipped calls
// (int64): new_history (length), new_scale, new_scale_inv, new_count. The margin
// divides in margin_steps steps of 2**64, then by margin_rest (a power of two).
void launch_delayed_scale_update(const float* history, const float* amax, const float* scale, const int64_t* count,
                                 float* new_history, float* new_scale, float* new_scale_inv, int64_t* new_count,
                                 int64_t length, int margin_steps, float margin_rest, float fmax, bool algo_max,
                                 void* stream);

// The same update for n quantizers of one configuration, read where each one's
// tensors are (host arrays of n device pointers), written stacked: new_history
// (n, length), new_scale and new_scale_inv 4 floats apart, new_count (n,). One
// launch per 32 quantizers.
void launch_delayed_scale_update_many(const float* const* histories, const float* const* amaxes,
                                      const float* const* scales, const int64_t* const* counts, int64_t n,
                                      float* new_history, float* new_scale, float* new_scale_inv, int64_t* new_count,
                                      int64_t length, int margin_steps, float margin_rest, float fmax, bool algo_max,
                                      void* stream);

// LayerNorm of x (rows, n), row-major, with fp32 weight and bias (n,): y (rows, n),
// mean and rstd (rows,) fp32.
void launch_layer_norm(const void* x, int x_type, const float* weight, const float* bias, void* y, int y_type,
                       float* mean, float* rstd, int64_t rows, int64_t n, float eps, void* stream);

// The row chunks of a LayerNorm backward of x and dy of these types: partial
// holds (2, chunks, n) fp32.
int64_t layer_norm_grad_chunks(int64_t rows, int64_t n, int x_type, int dy_type);

// Its dx (rows, n) in x's type, and per chunk of rows the partial sums of dweight
// (partial[0]) and dbias (partial[1]), from the forward's mean and rstd. add (rows,
// n) of add_type, or null: another use's gradient of x, added to dx in fp32 before
// its rounding.
void launch_layer_norm_grad(const void* dy, int dy_type, const void* x, int x_type, const float* weight,
                            const float* mean, const float* rstd, const void* add, int add_type, void* dx,
                            float* partial, int64_t rows, int64_t n, int64_t chunks, void* stream);

// Rotary position embedding of x (rows, heads, 2 * half), token row r at position
// r % seq of the fp32 tables cos and sin (seq, 2 * half): the first `rotated`
// heads rotated (inverse: the inverse rotation), the rest copied, into y of
// y_type, over the first `covered` heads (all of them, or in place, y == x, the
// rotated ones). Products and sums in fp32 without fused multiply-adds.
void launch_rotary(const void* x, int x_type, void* y, int y_type, const float* cos, const float* sin, int64_t rows,
                   int64_t seq, int heads, int rotated, int covered, int half, bool inverse, void* stream);

// Activation codes of the activations' backward (formats.ACTIVATION_CODES' unary kinds).
enum ActivationGrad : int { kGradGelu = 1, kGradRelu = 2, kGradSilu = 3, kGradQgelu = 5, kGradSrelu = 6 };

// The rows of x a tile of launch_dact_dbias sums (64, more for more than 65535 tiles).
int64_t dact_dbias_tile_rows(int64_t rows);

// The backward of Bias -> activation `kind` for dy and x (rows, cols), row-major, of
// one high-precision type: dx = dy * f'(x) rounded to that type, and into partials
// ((rows + t - 1) / t, cols) fp32, t = dact_dbias_tile_rows(rows), each tile's sums of
// the rounded dx over its rows, in order (launch_sum_rows adds them up).
void launch_dact_dbias(const void* dy, const void* x, int type, void* dx, float* partials, int64_t rows, int64_t cols,
                       int kind, void* stream);

// What the Hopper attention forwards share of their operands (see
// attention_common.cuh): q (batch, h, tq, head_dim), k and v (batch, hkv, tk,
// head_dim) and o (batch, h, tq, head_dim) as strides of views in elements (bytes
// for FP8), the head dim contiguous and every row 16-byte aligned; lse (batch, h,
// tq) fp32; qk_scale softmax_scale · log2 e.
struct AttentionShape {
  float* lse = nullptr;
  float qk_scale = 0.0f;
  int batch = 0, h = 0, hkv = 0, tq = 0, tk = 0, head_dim = 0;
  bool causal = false;
  bool turns = true;  // the consumer warpgroups take turns at S = Q Kᵀ (named barriers)
  bool mirrored = true;  // the persistent forwards deal their items out forwards and backwards in turn
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_t = 0;
  int64_t k_stride_b = 0, k_stride_h = 0, k_stride_t = 0;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_t = 0;
  int64_t o_stride_b = 0, o_stride_h = 0, o_stride_t = 0;
};

// The FP8 forward's (attention_kernels.cu): E4M3 q, k, v; vt a buffer of batch · hkv
// · head_dim · vt_pitch bytes (attention_fp8_vt_pitch) for V with its keys inner
// (unused where v_in_kernel); o of a high-precision type; scales the fp32
// q_scale_inv, k_scale_inv, v_scale_inv and p_scale.
struct AttentionFp8Args : AttentionShape {
  const uint8_t* q = nullptr;
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  uint8_t* vt = nullptr;
  void* o = nullptr;
  const float* scales = nullptr;
  bool overlap = false;  // the next tile's S = Q Kᵀ in flight during the softmax (other bits; see the kernel)
  bool v_in_kernel = false;  // each V tile rewritten keys inner in shared memory, not by a launch before (same bits)
  int64_t vt_pitch = 0;
  // v given with its keys inner (v_stride_t 1; v_stride_d between its head-dim
  // positions), K's rows copied permuted instead of V rewritten (no vt, no
  // v_in_kernel; see attention_kernels.cu): tk a multiple of 16, v's strides
  // multiples of 16, and k's batch stride hkv · k_stride_h (its batches folded into
  // its heads: kp_batch_heads = hkv) or tk · k_stride_t (into its keys:
  // kp_batch_keys = tk), so that K's map needs five dimensions.
  bool keys_permuted = false;
  int64_t v_stride_d = 1;
  int kp_batch_keys = 0, kp_batch_heads = 0;
};

// Positions of a row of vt: tk rounded up to the key tile.
int64_t attention_fp8_vt_pitch(int64_t tk);

// V rewritten into vt (keys inner, permuted as the kernel reads them, zeros past
// tk; or each tile of it in the kernel: args.v_in_kernel), then the forward into o
// and lse (out_type a high-precision code; head dim 64 or 128; sm_90a).
void launch_attention_fp8_forward(const AttentionFp8Args& args, int out_type, void* stream);

// The bf16 / fp16 forward's (attention_hp_kernels.cu): q, k, v and o of that type.
struct AttentionHpArgs : AttentionShape {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
};

// The forward into o and lse (type a high-precision code: bf16 or fp16; head dim 64
// or 128; sm_90a).
void launch_attention_hp_forward(const AttentionHpArgs& args, int type, void* stream);

// The bf16 / fp16 backward's (attention_hp_kernels.cu): q, k, v, o and dout (do)
// of that type, lse (B, H, Tq) fp32 contiguous; delta = rowsum(do ∘ o) (B, H, Tq)
// fp32 contiguous, which the dq kernel writes and the dk / dv kernel reads; dq (B,
// H, Tq, D), dk and dv (B, Hkv, Tk, D) of that type, dk and dv each the sum over the
// query heads of its kv head. Every gradient is written once, by one block (no
// atomics: the same bits every run).
struct AttentionBwdArgs : AttentionHpArgs {  // o: the forward's output, read here
  const void* dout = nullptr;
  float* delta = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* rows = nullptr;  // the steps' per-query columns ((B·H, ceil(Tq / 64), 2, 64): lse · log2 e, delta)
  float* dq_accum = nullptr;  // dq's fp32 chunks (B, H, ceil(Tq / 64), 64·D); their turn counters, then the
  int* dq_turns = nullptr;    // queue of chunks to store and its four counters, then a flag a chunk: its delta
                              // made (3·B·H·chunks + 4), zeros
  int* delta_ready = nullptr;  // set by the launch where the dk / dv kernel makes delta (those flags)
  int in_kernel = 0;           // what the whole backward's dk / dv kernel also does: kDqInKernel | kDeltaInKernel
  float softmax_scale = 0.0f;
  int64_t do_stride_b = 0, do_stride_h = 0, do_stride_t = 0;
  int64_t dq_stride_b = 0, dq_stride_h = 0, dq_stride_t = 0;
  int64_t dk_stride_b = 0, dk_stride_h = 0, dk_stride_t = 0;
  int64_t dv_stride_b = 0, dv_stride_h = 0, dv_stride_t = 0;
};

// What the whole backward's dk / dv kernel may also do (AttentionBwdArgs::in_kernel):
// store dq's chunks as they complete (no kernel after it), make delta where each
// query chunk has one first reader (lse alone before it).
constexpr int kDqInKernel = 1;
constexpr int kDeltaInKernel = 2;

// The whole backward (delta, then dk and dv with dq's chunks added in a fixed
// order, then dq; see kDqInKernel and kDeltaInKernel); dk and dv alone from a given delta (type bf16 or fp16; head dim
// 64 or 128; sm_90a).
void launch_attention_hp_backward(const AttentionBwdArgs& args, int type, void* stream);
void launch_attention_hp_dkdv(const AttentionBwdArgs& args, int type, void* stream);

// The first of the two alone: V (args.v, its strides, batch, hkv, tk, head_dim)
// into vt (args.vt, vt_pitch) (a test's view of what the forward reads).
void launch_attention_fp8_keys_inner(const AttentionFp8Args& args, void* stream);

}  // namespace te_fuser
