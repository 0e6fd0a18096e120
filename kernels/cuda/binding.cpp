// Python binding of the CUDA launchers. Tensors arrive as raw device addresses
// (Tensor.data_ptr()) and the stream as its cudaStream_t value: the Python
// launchers have already checked every shape, dtype and device. The tensor-scaled
// casts also have entries that take the input tensor and allocate their outputs
// here (cast_current, cast_tensorwise): one call from Python per cast.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "dtype_codes.h"
#include "launchers.cuh"

namespace te_fuser {
// cublaslt_gemm.cpp
at::Tensor fp8_gemm_tensorwise(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                               const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                               at::ScalarType out_dtype, bool fast_accum, int64_t stream);
std::optional<at::Tensor> fp8_gemm_lean(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                        const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                                        const std::optional<at::Tensor>& residual, at::ScalarType out_dtype,
                                        bool fast_accum, int64_t activation, bool bias_as_bf16,
                                        int64_t device, int64_t stream,
                                        const std::optional<std::vector<int64_t>>& a_shape);
at::Tensor fp8_gemm_scaled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                           const at::Tensor& scale_b, int64_t a_mode, int64_t b_mode,
                           const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, int64_t stream);
bool fp8_gemm_block_supported();
int64_t fp8_gemm_plans();
int64_t fp8_gemm_set_workspace_limit(int64_t bytes);
std::tuple<at::Tensor, int64_t> fp8_gemm_tensorwise_candidate(const at::Tensor& a, const at::Tensor& b,
                                                              const at::Tensor& scale_a, const at::Tensor& scale_b,
                                                              at::ScalarType out_dtype, bool fast_accum,
                                                              int64_t candidate, int64_t stream);
}  // namespace te_fuser

namespace {

template <typename P>
P* as_ptr(int64_t address) {
  return reinterpret_cast<P*>(static_cast<intptr_t>(address));
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

// A contiguous tensor of `dtype` and `sizes` on base's storage, `byte_offset` bytes
// past base's data (a multiple of dtype's size), made without the dispatcher:
// select() or view() each cost microseconds a call, and a cast returns up to five
// such pieces of one allocation. The piece shares base's memory, not its
// version counter or autograd history (base is a fresh allocation here).
at::Tensor piece_of(const at::Tensor& base, int64_t byte_offset, at::ScalarType dtype, at::IntArrayRef sizes) {
  const caffe2::TypeMeta meta = c10::scalarTypeToTypeMeta(dtype);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(base.storage()),
                                                   base.key_set(), meta);
  const int64_t base_bytes = base.storage_offset() * static_cast<int64_t>(base.dtype().itemsize());
  impl->set_storage_offset((base_bytes + byte_offset) / static_cast<int64_t>(meta.itemsize()));
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

// Bytes rounded up to a multiple of 16 (cuBLASLt wants 16-byte aligned scales).
constexpr int64_t aligned16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

using te_fuser::hp_code_or_none;

void amax(int64_t x, int hp_type, int64_t numel, int64_t amax_out, int64_t stream) {
  te_fuser::launch_amax(as_ptr<const void>(x), hp_type, numel, as_ptr<float>(amax_out), as_stream(stream));
}

void cast(int64_t x, int hp_type, int fp8_type, int64_t rows, int64_t cols, int64_t out, int64_t out_t,
          int64_t scale, int64_t amax_out, int64_t amax_in, int64_t scale_out, int64_t scale_inv_out, double epsilon,
          bool power_2, int64_t column_partials, int64_t stream) {
  te_fuser::CastScaling scaling;
  scaling.scale = as_ptr<const float>(scale);
  scaling.amax_out = as_ptr<float>(amax_out);
  scaling.amax_in = as_ptr<const float>(amax_in);
  scaling.scale_out = as_ptr<float>(scale_out);
  scaling.scale_inv_out = as_ptr<float>(scale_inv_out);
  scaling.epsilon = static_cast<float>(epsilon);  // rounds as torch.tensor(epsilon, dtype=float32)
  scaling.power_2 = power_2;
  scaling.column_partials = as_ptr<float>(column_partials);
  te_fuser::launch_cast(as_ptr<const void>(x), hp_type, fp8_type, rows, cols, as_ptr<uint8_t>(out),
                        as_ptr<uint8_t>(out_t), scaling, as_stream(stream));
}

void quantize_rowwise(int64_t x, int hp_type, int fp8_type, int64_t rows, int64_t cols, int64_t out,
                      int64_t scale_inv, bool power_2, double epsilon, int64_t stream) {
  te_fuser::launch_quantize_rowwise(as_ptr<const void>(x), hp_type, fp8_type, rows, cols, as_ptr<uint8_t>(out),
                                    as_ptr<float>(scale_inv), power_2, static_cast<float>(epsilon), as_stream(stream));
}

void quantize_mxfp8(int64_t x, int hp_type, int fp8_type, int64_t numel, int64_t out, int64_t scales,
                    int64_t stream) {
  te_fuser::launch_quantize_mxfp8(as_ptr<const void>(x), hp_type, fp8_type, numel, as_ptr<uint8_t>(out),
                                  as_ptr<uint8_t>(scales), as_stream(stream));
}

void epilogue(int64_t y, int y_type, int64_t bias, int bias_type, int64_t residual, int residual_type, int64_t out,
              int out_type, int64_t rows, int64_t out_cols, int activation, int64_t stream) {
  te_fuser::launch_epilogue(as_ptr<const void>(y), y_type, as_ptr<const void>(bias), bias_type,
                            as_ptr<const void>(residual), residual_type, as_ptr<void>(out), out_type, rows, out_cols,
                            activation, as_stream(stream));
}

constexpr int64_t kTile = 128;  // rows of one tile of the transposing cast (cast_kernels.cu)

at::ScalarType fp8_scalar_type(int fp8_type) {
  return fp8_type == 0 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

using MaybeTensor = std::optional<at::Tensor>;

// Bytes rounded up to a multiple of 256: where a fresh allocation would start, so a
// piece is as aligned as its own allocation would be (cuBLASLt keeps a GEMM's plan
// per operand alignment and picks its kernel by it).
constexpr int64_t aligned256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// A cast's outputs as pieces of one allocation (one allocator call where there
// were up to four): the FP8 copies of x and, with sums, the tiles' column sums
// (rows, cols as the kernel sees x), then `stats_floats` fp32 statistics. The
// pieces live as long as the longest-lived of them; a cast's copies and scales are
// kept and freed together (a backward keeps both copies of what it saved), and the
// column sums' partials are a tile row per 128 rows of x.
struct CastOutputs {
  MaybeTensor data, data_t, partials;
  at::Tensor stats;
};

CastOutputs cast_outputs(const at::Tensor& x, int fp8_type, int64_t rows, int64_t cols, bool rowwise,
                         bool columnwise, bool sums, int64_t stats_floats) {
  const int64_t bytes = rows * cols;  // one byte per FP8 element
  const int64_t tiles = (rows + kTile - 1) / kTile;
  int64_t end = 0;
  const int64_t data_at = end;
  if (rowwise) end += aligned256(bytes);
  const int64_t data_t_at = end;
  if (columnwise) end += aligned256(bytes);
  const int64_t partials_at = end;
  if (sums) end += aligned256(tiles * cols * 4);
  const int64_t stats_at = end;
  end += stats_floats * 4;
  const at::Tensor base = at::empty({end > 0 ? end : 1}, x.options().dtype(at::kByte));
  const at::ScalarType fp8 = fp8_scalar_type(fp8_type);
  CastOutputs out;
  // x's own shape (a checked launcher's 1-D or 2-D x), or its 2-D flattening (a lean entry's x of more dims)
  if (rowwise) out.data = piece_of(base, data_at, fp8, x.dim() < 3 ? x.sizes() : at::IntArrayRef({rows, cols}));
  if (columnwise) out.data_t = piece_of(base, data_t_at, fp8, {cols, rows});
  if (sums) out.partials = piece_of(base, partials_at, at::kFloat, {tiles, cols});
  if (stats_floats > 0) out.stats = piece_of(base, stats_at, at::kFloat, {stats_floats});
  return out;
}

uint8_t* bytes_of(const MaybeTensor& t) { return t ? static_cast<uint8_t*>(t->data_ptr()) : nullptr; }

// The column sums' tensor (cols,): fp32, or bf16 with sums_bf16 (a bf16 bias's
// gradient, each total rounded once); a new tensor, a gradient that outlives the partials.
at::Tensor sums_tensor(const at::Tensor& like, int64_t cols, bool sums_bf16) {
  return at::empty({cols}, like.options().dtype(sums_bf16 ? at::kBFloat16 : at::kFloat));
}

// The tiles' column sums added up over the row tiles (see sums_tensor), in one launch.
MaybeTensor summed(const MaybeTensor& partials, bool sums_bf16, int64_t stream) {
  if (!partials) return std::nullopt;
  const int64_t tiles = partials->size(0), cols = partials->size(1);
  at::Tensor sums = sums_tensor(*partials, cols, sums_bf16);
  te_fuser::launch_sum_rows(partials->data_ptr<float>(), 1, tiles, cols, sums.data_ptr(), as_stream(stream),
                            sums_bf16);
  return sums;
}

// A cast that runs as one launch of `blocks` blocks (blocks > 0): its blocks set on
// `scaling`, and with column sums the (cols,) tensor the launch writes them into
// (see sums_tensor); nothing otherwise.
MaybeTensor one_launch(te_fuser::CastScaling& scaling, int64_t blocks, const CastOutputs& out, int64_t cols,
                       const at::Tensor& x, bool sums_bf16) {
  if (blocks <= 0) return std::nullopt;
  scaling.one_launch_blocks = blocks;
  if (!out.partials) return std::nullopt;
  at::Tensor sums = sums_tensor(x, cols, sums_bf16);
  scaling.sums_out = sums.data_ptr();
  scaling.sums_bf16 = sums_bf16;
  return sums;
}

bool one_launch_casts(bool enable) { return te_fuser::set_one_launch_casts(enable); }

bool one_launch_casts_in_capture(bool enable) { return te_fuser::set_one_launch_casts_in_capture(enable); }

// Current scaling: (data, data_t, scale, scale_inv, amax, column sums); amax_given
// skips the amax pass. x is contiguous, 16-byte aligned, on the current device.
// amax, scale and scale_inv are 16-byte aligned pieces of the outputs' allocation
// (cuBLASLt refuses scale pointers that are not, CUBLAS_STATUS_NOT_SUPPORTED),
// followed by the amax pass's per-block maxima, which the cast reduces: nothing is
// zeroed first.
std::tuple<MaybeTensor, MaybeTensor, at::Tensor, at::Tensor, at::Tensor, MaybeTensor> cast_current(
    const at::Tensor& x, int hp_type, int fp8_type, int64_t rows, int64_t cols, bool power_2, double epsilon,
    bool rowwise, bool columnwise, const MaybeTensor& amax_given, bool sums, bool round_bf16, bool sums_bf16,
    int64_t stream) {
  const int64_t one = columnwise ? te_fuser::cast_one_launch_blocks(hp_type, fp8_type, true, sums, rows, cols,
                                                                    as_stream(stream)) : 0;
  const int64_t partial_count = amax_given ? 0 : (one > 0 ? one : te_fuser::amax_partial_count(x.numel()));
  const CastOutputs out = cast_outputs(x, fp8_type, rows, cols, rowwise, columnwise, sums, 12 + partial_count);
  const at::Tensor& stats = out.stats;
  const at::Tensor amax = amax_given ? amax_given->reshape({}) : piece_of(stats, 0, at::kFloat, {});
  const at::Tensor scale = piece_of(stats, 16, at::kFloat, {});
  const at::Tensor scale_inv = piece_of(stats, 32, at::kFloat, {});
  te_fuser::CastScaling scaling;
  if (amax_given) {
    scaling.amax_in = amax_given->data_ptr<float>();
  } else {
    uint32_t* partials = reinterpret_cast<uint32_t*>(stats.data_ptr<float>() + 12);
    if (one > 0) {
      scaling.block_partials = partials;  // the one launch's own amax pass fills them
    } else {
      te_fuser::launch_amax_partials(x.data_ptr(), hp_type, x.numel(), partials, as_stream(stream));
    }
    scaling.amax_partials = partials;
    scaling.amax_partial_count = partial_count;
    scaling.amax_total_out = amax.data_ptr<float>();
  }
  const MaybeTensor one_launch_sums = one_launch(scaling, one, out, cols, x, sums_bf16);
  scaling.scale_out = scale.data_ptr<float>();
  scaling.scale_inv_out = scale_inv.data_ptr<float>();
  scaling.epsilon = static_cast<float>(epsilon);  // rounds as torch.tensor(epsilon, dtype=float32)
  scaling.power_2 = power_2;
  scaling.column_partials = out.partials ? out.partials->data_ptr<float>() : nullptr;
  scaling.round_bf16 = round_bf16;
  te_fuser::launch_cast(x.data_ptr(), hp_type, fp8_type, rows, cols, bytes_of(out.data), bytes_of(out.data_t),
                        scaling, as_stream(stream));
  return {out.data, out.data_t, scale, scale_inv, amax,
          one > 0 ? one_launch_sums : summed(out.partials, sums_bf16, stream)};
}

// Delayed scaling with the given scale: (data, data_t, column sums, amax); amax(|x|)
// is written into amax_out (fp32, one element), or without one into a new (1,)
// tensor of its own (it outlives the copies' allocation: a delayed update reads it
// after they may be gone).
std::tuple<MaybeTensor, MaybeTensor, MaybeTensor, at::Tensor> cast_tensorwise(
    const at::Tensor& x, int hp_type, int fp8_type, int64_t rows, int64_t cols, const at::Tensor& scale,
    const MaybeTensor& amax_out, bool rowwise, bool columnwise, bool sums, bool round_bf16, bool sums_bf16,
    int64_t stream) {
  const int64_t one = columnwise ? te_fuser::cast_one_launch_blocks(hp_type, fp8_type, false, sums, rows, cols,
                                                                    as_stream(stream)) : 0;
  const CastOutputs out = cast_outputs(x, fp8_type, rows, cols, rowwise, columnwise, sums, one);  // the blocks' maxima
  const at::Tensor amax = amax_out ? *amax_out : at::empty({1}, x.options().dtype(at::kFloat));
  te_fuser::CastScaling scaling;
  scaling.scale = scale.data_ptr<float>();
  scaling.amax_out = amax.data_ptr<float>();
  scaling.column_partials = out.partials ? out.partials->data_ptr<float>() : nullptr;
  scaling.round_bf16 = round_bf16;
  if (one > 0) scaling.block_partials = reinterpret_cast<uint32_t*>(out.stats.data_ptr<float>());
  const MaybeTensor one_launch_sums = one_launch(scaling, one, out, cols, x, sums_bf16);
  te_fuser::launch_cast(x.data_ptr(), hp_type, fp8_type, rows, cols, bytes_of(out.data), bytes_of(out.data_t),
                        scaling, as_stream(stream));
  return {out.data, out.data_t, one > 0 ? one_launch_sums : summed(out.partials, sums_bf16, stream), amax};
}

// The new state of a delayed-scaling update, pieces of one allocation: the history,
// then scale, scale_inv, count and (with_amax) an amax slot, each 16 bytes apart
// (cuBLASLt wants its scales 16-byte aligned).
struct UpdateState {
  at::Tensor history, scale, scale_inv, count, amax;
};

UpdateState update_state(const at::Tensor& like, int64_t length, bool with_amax) {
  const int64_t scales_at = aligned16(length * 4);
  const at::Tensor state = at::empty({scales_at + (with_amax ? 64 : 48)}, like.options().dtype(at::kByte));
  UpdateState out;
  out.history = piece_of(state, 0, at::kFloat, {length});
  out.scale = piece_of(state, scales_at, at::kFloat, {});
  out.scale_inv = piece_of(state, scales_at + 16, at::kFloat, {});
  out.count = piece_of(state, scales_at + 32, at::kLong, {});
  if (with_amax) out.amax = piece_of(state, scales_at + 48, at::kFloat, {1});
  return out;
}

// Delayed scaling's cast and the state update from its amax in one call: (data,
// data_t, column sums, amax, history, scale, scale_inv, count), the state new
// tensors (see delayed_scale_update). As one launch, block 0 of the cast updates
// the state; otherwise (no transposed copy, a stream being captured) the update
// is a second launch. history: contiguous fp32 (length,); scale and count: the
// quantizer's one-element fp32 and int64 tensors, on x's device.
std::tuple<MaybeTensor, MaybeTensor, MaybeTensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
cast_tensorwise_update(const at::Tensor& x, int hp_type, int fp8_type, int64_t rows, int64_t cols,
                       const at::Tensor& scale, const at::Tensor& history, const at::Tensor& count,
                       int64_t margin_steps, double margin_rest, double fmax, bool algo_max, bool rowwise,
                       bool columnwise, bool sums, bool round_bf16, bool sums_bf16, int64_t stream) {
  const int64_t one = columnwise ? te_fuser::cast_one_launch_blocks(hp_type, fp8_type, false, sums, rows, cols,
                                                                    as_stream(stream)) : 0;
  const CastOutputs out = cast_outputs(x, fp8_type, rows, cols, rowwise, columnwise, sums, one);
  const int64_t length = history.numel();
  const UpdateState next = update_state(history, length, true);
  te_fuser::CastScaling scaling;
  scaling.scale = scale.data_ptr<float>();
  scaling.amax_out = next.amax.data_ptr<float>();
  scaling.column_partials = out.partials ? out.partials->data_ptr<float>() : nullptr;
  scaling.round_bf16 = round_bf16;
  if (one > 0) scaling.block_partials = reinterpret_cast<uint32_t*>(out.stats.data_ptr<float>());
  const MaybeTensor one_launch_sums = one_launch(scaling, one, out, cols, x, sums_bf16);
  te_fuser::DelayedUpdate update;
  update.history = history.data_ptr<float>();
  update.count = count.data_ptr<int64_t>();
  update.new_history = next.history.data_ptr<float>();
  update.new_scale = next.scale.data_ptr<float>();
  update.new_scale_inv = next.scale_inv.data_ptr<float>();
  update.new_count = next.count.data_ptr<int64_t>();
  update.length = length;
  update.margin_steps = static_cast<int>(margin_steps);
  update.margin_rest = static_cast<float>(margin_rest);
  update.fmax = static_cast<float>(fmax);
  update.algo_max = algo_max;
  te_fuser::launch_cast(x.data_ptr(), hp_type, fp8_type, rows, cols, bytes_of(out.data), bytes_of(out.data_t),
                        scaling, as_stream(stream), one > 0 ? update : te_fuser::DelayedUpdate{});
  const MaybeTensor column_sums = one > 0 ? one_launch_sums : summed(out.partials, sums_bf16, stream);
  if (one <= 0) {
    te_fuser::launch_delayed_scale_update(update.history, scaling.amax_out, scaling.scale, update.count,
                                          update.new_history, update.new_scale, update.new_scale_inv,
                                          update.new_count, length, update.margin_steps, update.margin_rest,
                                          update.fmax, algo_max, as_stream(stream));
  }
  return {out.data, out.data_t, column_sums, next.amax, next.history, next.scale, next.scale_inv, next.count};
}

// The ops' lean casts (below) take x as it comes, two or more dims, and check it
// here: a high-precision dtype, contiguous, 16-byte aligned, on `device` (torch's
// current device, which the caller passes with that device's current stream),
// with columns (and, for the column sums, the transposed copy and an element).
// (hp code, rows, cols) of its 2-D flattening, or hp -1: the caller's checked path,
// which says what is wrong or copies what it must.
struct LeanInput {
  int hp = -1;
  int64_t rows = 0, cols = 0;
};

LeanInput lean_input(const at::Tensor& x, bool columnwise, bool sums, int64_t device) {
  LeanInput in;
  const int hp = hp_code_or_none(x.scalar_type());
  if (hp < 0 || !x.is_cuda() || x.get_device() != device || x.dim() < 2 || !x.is_contiguous() ||
      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) {
    return in;
  }
  const int64_t cols = x.size(-1);
  if (cols == 0 || (sums && (!columnwise || x.numel() == 0))) return in;
  in.hp = hp;
  in.rows = x.numel() / cols;
  in.cols = cols;
  return in;
}

// A one-element state tensor of `dtype` on `device`.
bool state_scalar(const at::Tensor& t, at::ScalarType dtype, int64_t device) {
  return t.scalar_type() == dtype && t.is_cuda() && t.get_device() == device && t.numel() == 1;
}

using LeanCast = std::optional<std::tuple<MaybeTensor, MaybeTensor, at::Tensor, MaybeTensor>>;

// Current scaling's cast of x's 2-D flattening, x checked here (see lean_input):
// (data, data_t, scale_inv, column sums) as cast_current gives them, on `stream`
// (`device`'s current stream); None for an x the Python path must look at.
LeanCast cast_current_lean(const at::Tensor& x, int fp8_type, bool power_2, double epsilon, bool rowwise,
                           bool columnwise, bool sums, bool round_bf16, bool sums_bf16, int64_t device,
                           int64_t stream) {
  const LeanInput in = lean_input(x, columnwise, sums, device);
  if (in.hp < 0) return std::nullopt;
  auto out = cast_current(x, in.hp, fp8_type, in.rows, in.cols, power_2, epsilon, rowwise, columnwise,
                          std::nullopt, sums, round_bf16, sums_bf16, stream);
  return std::make_tuple(std::get<0>(out), std::get<1>(out), std::get<3>(out), std::get<5>(out));
}

// cast_tensorwise_update with x and the state checked here (the state: fp32 scale,
// contiguous fp32 history, int64 count, on x's device), x of two or more dims:
// its outputs, or None for a case the Python path must look at (it then casts and
// records the amax apart).
std::optional<std::tuple<MaybeTensor, MaybeTensor, MaybeTensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor>>
cast_tensorwise_update_lean(const at::Tensor& x, int fp8_type, const at::Tensor& scale, const at::Tensor& history,
                            const at::Tensor& count, int64_t margin_steps, double margin_rest, double fmax,
                            bool algo_max, bool rowwise, bool columnwise, bool sums, bool round_bf16,
                            bool sums_bf16, int64_t device, int64_t stream) {
  const LeanInput in = lean_input(x, columnwise, sums, device);
  if (in.hp < 0 || !state_scalar(scale, at::kFloat, device) || !state_scalar(count, at::kLong, device) ||
      history.scalar_type() != at::kFloat || !history.is_cuda() || history.get_device() != device ||
      history.dim() != 1 || history.numel() == 0 || !history.is_contiguous()) {
    return std::nullopt;
  }
  return cast_tensorwise_update(x, in.hp, fp8_type, in.rows, in.cols, scale, history, count, margin_steps,
                                margin_rest, fmax, algo_max, rowwise, columnwise, sums, round_bf16, sums_bf16,
                                stream);
}

// Delayed scaling's state update: (history, scale, scale_inv, count), new tensors,
// pieces of one allocation: the history, then scale and scale_inv 16 bytes apart
// (as cuBLASLt wants them), then the count.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> delayed_scale_update(
    const at::Tensor& history, const at::Tensor& amax, const at::Tensor& scale, const at::Tensor& count,
    int64_t margin_steps, double margin_rest, double fmax, bool algo_max, int64_t stream) {
  const int64_t length = history.numel();
  const UpdateState next = update_state(history, length, false);
  te_fuser::launch_delayed_scale_update(
      history.data_ptr<float>(), amax.data_ptr<float>(), scale.data_ptr<float>(), count.data_ptr<int64_t>(),
      next.history.data_ptr<float>(), next.scale.data_ptr<float>(), next.scale_inv.data_ptr<float>(),
      next.count.data_ptr<int64_t>(), length, static_cast<int>(margin_steps),
      static_cast<float>(margin_rest), static_cast<float>(fmax), algo_max, as_stream(stream));
  return {next.history, next.scale, next.scale_inv, next.count};
}

// The same update for the quantizers of one configuration in one launch (per 32),
// each read where its tensors are: (histories (n, length), scales (n,) and
// scale_invs (n,) with their elements 16 bytes apart, counts (n,)), new tensors.
// Every tensor is checked here (dtype, device, size; the histories contiguous),
// the caller having checked only the configuration.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> delayed_scale_update_many(
    const std::vector<at::Tensor>& histories, const std::vector<at::Tensor>& amaxes,
    const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& counts, int64_t margin_steps,
    double margin_rest, double fmax, bool algo_max, int64_t stream) {
  const int64_t n = static_cast<int64_t>(histories.size());
  if (n == 0 || static_cast<int64_t>(amaxes.size()) != n || static_cast<int64_t>(scales.size()) != n ||
      static_cast<int64_t>(counts.size()) != n) {
    throw std::invalid_argument(
        "delayed_scale_update_many: amax_histories, amaxes, scales and nonfinite_counts must be equally long and "
        "not empty");
  }
  const at::Tensor& first = histories[0];
  const int64_t length = first.numel();
  const c10::Device device = first.device();
  auto fits = [&](const at::Tensor& t, at::ScalarType dtype, bool history) {
    return t.scalar_type() == dtype && t.device() == device &&
           (history ? (t.dim() == 1 && t.numel() == length && t.is_contiguous()) : t.numel() == 1);
  };
  std::vector<const float*> h(n), a(n), s(n);
  std::vector<const int64_t*> c(n);
  for (int64_t i = 0; i < n; ++i) {
    const char* bad = !fits(histories[i], at::kFloat, true) ? "amax_histories"
                      : !fits(amaxes[i], at::kFloat, false) ? "amaxes"
                      : !fits(scales[i], at::kFloat, false) ? "scales"
                      : !fits(counts[i], at::kLong, false)  ? "nonfinite_counts"
                                                             : nullptr;
    if (bad != nullptr || length == 0 || !first.is_cuda()) {
      throw std::invalid_argument(std::string("delayed_scale_update_many: ") + (bad ? bad : "amax_histories") +
                                  "[" + std::to_string(i) +
                                  "] does not fit: contiguous 1-D fp32 CUDA histories of one length, one-element "
                                  "fp32 amaxes and scales and int64 counts, all on one device");
    }
    h[i] = histories[i].data_ptr<float>();
    a[i] = amaxes[i].data_ptr<float>();
    s[i] = scales[i].data_ptr<float>();
    c[i] = counts[i].data_ptr<int64_t>();
  }
  const auto options = first.options();
  at::Tensor new_history = at::empty({n, length}, options);
  at::Tensor padded = at::empty({2, n, 4}, options);  // scale, then scale_inv: 16 bytes a row
  at::Tensor new_scale = padded.as_strided({n}, {4}, padded.storage_offset());
  at::Tensor new_scale_inv = padded.as_strided({n}, {4}, padded.storage_offset() + 4 * n);
  at::Tensor new_count = at::empty({n}, options.dtype(at::kLong));
  te_fuser::launch_delayed_scale_update_many(h.data(), a.data(), s.data(), c.data(), n, new_history.data_ptr<float>(),
                                             padded.data_ptr<float>(), padded.data_ptr<float>() + 4 * n,
                                             new_count.data_ptr<int64_t>(), length, static_cast<int>(margin_steps),
                                             static_cast<float>(margin_rest), static_cast<float>(fmax), algo_max,
                                             as_stream(stream));
  return {new_history, new_scale, new_scale_inv, new_count};
}

int hp_code(at::ScalarType t) {
  const int code = hp_code_or_none(t);
  if (code < 0) throw std::invalid_argument("te_fuser norm kernels: a float32, bfloat16 or float16 tensor is needed");
  return code;
}

// A contiguous fp32 rotary table (seq, dim) on `device`.
bool rotary_table(const at::Tensor& t, int64_t seq, int64_t dim, int64_t device) {
  return t.scalar_type() == at::kFloat && t.is_cuda() && t.get_device() == device && t.dim() == 2 &&
         t.size(0) == seq && t.size(1) == dim && t.is_contiguous();
}

// RoPE of x (B, T, heads, D) with the tables cos and sin (T, D) (see launch_rotary):
// a new y in out_dtype, or x itself in place (its rotated heads rewritten). None
// for operands the Python path must look at (it checks, names what is wrong or
// goes to another backend): x not a contiguous CUDA tensor of a high-precision
// dtype on `device`, an odd or zero head dim, tables not contiguous fp32 (T, D) on
// it, rotated_heads outside [0, heads], in place into another dtype, more token
// rows than a grid holds.
std::optional<at::Tensor> rotary_lean(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                      int64_t rotated_heads, bool inverse, at::ScalarType out_dtype, bool in_place,
                                      int64_t device, int64_t stream) {
  const int hp = hp_code_or_none(x.scalar_type()), out = hp_code_or_none(out_dtype);
  if (hp < 0 || out < 0 || !x.is_cuda() || x.get_device() != device || x.dim() != 4 || !x.is_contiguous()) {
    return std::nullopt;
  }
  const int64_t rows = x.size(0) * x.size(1), seq = x.size(1), heads = x.size(2), dim = x.size(3);
  if (dim == 0 || dim % 2 != 0 || rotated_heads < 0 || rotated_heads > heads || (in_place && out != hp) ||
      rows > std::numeric_limits<int32_t>::max() || heads * dim > std::numeric_limits<int32_t>::max() ||
      !rotary_table(cos, seq, dim, device) || !rotary_table(sin, seq, dim, device)) {
    return std::nullopt;
  }
  at::Tensor y = in_place ? x : at::empty(x.sizes(), x.options().dtype(out_dtype));
  const int64_t covered = in_place ? rotated_heads : heads;
  if (rows > 0 && covered > 0) {
    te_fuser::launch_rotary(x.data_ptr(), hp, y.data_ptr(), out, cos.data_ptr<float>(), sin.data_ptr<float>(), rows,
                            seq, static_cast<int>(heads), static_cast<int>(rotated_heads), static_cast<int>(covered),
                            static_cast<int>(dim / 2), inverse, as_stream(stream));
  }
  return y;
}

// The backward of Bias -> activation (see launch_dact_dbias): (dx of x's shape and
// dtype, dbias (cols,) fp32), new tensors. None for operands the Python path must
// look at: dy and x not contiguous CUDA tensors of one high-precision dtype and
// shape on `device`, x without a last dim, an activation code not of the unary
// kinds, more row tiles than a grid holds.
std::optional<std::tuple<at::Tensor, at::Tensor>> dact_dbias_lean(const at::Tensor& dy, const at::Tensor& x,
                                                                   int64_t kind, int64_t device, int64_t stream) {
  const int type = hp_code_or_none(x.scalar_type());
  const bool unary = kind == te_fuser::kGradGelu || kind == te_fuser::kGradRelu || kind == te_fuser::kGradSilu ||
                     kind == te_fuser::kGradQgelu || kind == te_fuser::kGradSrelu;
  if (type < 0 || !unary || dy.scalar_type() != x.scalar_type() || !x.is_cuda() || !dy.is_cuda() ||
      x.get_device() != device || dy.get_device() != device || x.dim() == 0 || !dy.sizes().equals(x.sizes()) ||
      !x.is_contiguous() || !dy.is_contiguous()) {
    return std::nullopt;
  }
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dbias = at::empty({cols}, x.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return std::make_tuple(dx, dbias.zero_());
  const int64_t tile_rows = te_fuser::dact_dbias_tile_rows(rows);
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  at::Tensor partials = at::empty({tiles, cols}, x.options().dtype(at::kFloat));
  te_fuser::launch_dact_dbias(dy.data_ptr(), x.data_ptr(), type, dx.data_ptr(), partials.data_ptr<float>(), rows,
                              cols, static_cast<int>(kind), as_stream(stream));
  te_fuser::launch_sum_rows(partials.data_ptr<float>(), 1, tiles, cols, dbias.data_ptr<float>(), as_stream(stream));
  return std::make_tuple(dx, dbias);
}

// LayerNorm over x's last dim: (y in out_dtype of x's shape, mean, rstd (rows,)), new
// tensors (x row-major, of two or more dims, its rows those of its 2-D flattening;
// weight and bias fp32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm(const at::Tensor& x, const at::Tensor& weight,
                                                          const at::Tensor& bias, double eps, at::ScalarType out_dtype,
                                                          int64_t stream) {
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  at::Tensor stats = at::empty({2 * rows}, x.options().dtype(at::kFloat));
  at::Tensor mean = piece_of(stats, 0, at::kFloat, {rows}), rstd = piece_of(stats, rows * 4, at::kFloat, {rows});
  if (rows > 0 && n > 0) {
    te_fuser::launch_layer_norm(x.data_ptr(), hp_code(x.scalar_type()), weight.data_ptr<float>(),
                                bias.data_ptr<float>(), y.data_ptr(), hp_code(out_dtype), mean.data_ptr<float>(),
                                rstd.data_ptr<float>(), rows, n, static_cast<float>(eps), as_stream(stream));
  }
  return {y, mean, rstd};
}

// Its backward: (dx in x's dtype, dweight, dbias), new tensors; the chunks' partial
// sums of the parameter gradients are added here, in one reduction. grad_add (x's
// shape, row-major) is added to dx in fp32 before its rounding.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_grad(const at::Tensor& dy, const at::Tensor& x,
                                                               const at::Tensor& weight, const at::Tensor& mean,
                                                               const at::Tensor& rstd,
                                                               const std::optional<at::Tensor>& grad_add,
                                                               int64_t stream) {
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  at::Tensor dx = at::empty_like(x);
  if (rows == 0 || n == 0) {
    at::Tensor zeros = at::zeros({2 * n}, x.options().dtype(at::kFloat));
    return {dx, piece_of(zeros, 0, at::kFloat, {n}), piece_of(zeros, n * 4, at::kFloat, {n})};
  }
  const int64_t chunks =
      te_fuser::layer_norm_grad_chunks(rows, n, hp_code(x.scalar_type()), hp_code(dy.scalar_type()));
  at::Tensor partial = at::empty({2, chunks, n}, x.options().dtype(at::kFloat));
  te_fuser::launch_layer_norm_grad(dy.data_ptr(), hp_code(dy.scalar_type()), x.data_ptr(), hp_code(x.scalar_type()),
                                   weight.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                   grad_add ? grad_add->data_ptr() : nullptr,
                                   grad_add ? hp_code(grad_add->scalar_type()) : 0, dx.data_ptr(),
                                   partial.data_ptr<float>(), rows, n, chunks, as_stream(stream));
  at::Tensor sums = at::empty({2 * n}, x.options().dtype(at::kFloat));  // the chunks added up, in chunk order
  te_fuser::launch_sum_rows(partial.data_ptr<float>(), 2, chunks, n, sums.data_ptr<float>(), as_stream(stream));
  return {dx, piece_of(sums, 0, at::kFloat, {n}), piece_of(sums, n * 4, at::kFloat, {n})};
}

// A contiguous, 16-byte aligned CUDA tensor on `device`.
bool plain_on(const at::Tensor& t, int64_t device) {
  return t.is_cuda() && t.get_device() == device && t.is_contiguous() &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// A contiguous fp32 vector of n elements on `device` (16-byte aligned: aligned).
bool fp32_vector(const at::Tensor& t, int64_t n, int64_t device, bool aligned) {
  return t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n && t.is_cuda() &&
         t.get_device() == device && t.is_contiguous() &&
         (!aligned || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0);
}

// layer_norm with its operands checked here: the same result, y of x's shape, or
// None for operands the Python path must look at (x not a contiguous, 16-byte
// aligned CUDA tensor of two or more dims and a high-precision dtype on `device`,
// weight and bias not aligned contiguous fp32 (N,) there, an out_dtype (default
// x's) not of the three). x of more dims is normalized over its last as its 2-D
// flattening, which spares the host a reshape on either side.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> layer_norm_lean(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    std::optional<at::ScalarType> out_dtype, int64_t device, int64_t stream) {
  const at::ScalarType out = out_dtype.value_or(x.scalar_type());
  if (x.dim() < 2 || hp_code_or_none(x.scalar_type()) < 0 || hp_code_or_none(out) < 0 || !plain_on(x, device) ||
      !fp32_vector(weight, x.size(-1), device, true) || !fp32_vector(bias, x.size(-1), device, true)) {
    return std::nullopt;
  }
  return layer_norm(x, weight, bias, eps, out, stream);
}

// layer_norm_grad with its operands checked here, or None (see layer_norm_lean):
// dy and grad_add of x's shape (two or more dims, dx then of it too) and a
// high-precision dtype, aligned and contiguous on `device`, weight as in the
// forward, mean and rstd contiguous fp32 (rows,) there.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> layer_norm_grad_lean(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& grad_add, int64_t device, int64_t stream) {
  if (x.dim() < 2 || hp_code_or_none(x.scalar_type()) < 0 || hp_code_or_none(dy.scalar_type()) < 0 ||
      !dy.sizes().equals(x.sizes()) || !plain_on(x, device) || !plain_on(dy, device)) {
    return std::nullopt;
  }
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  if (!fp32_vector(weight, n, device, true) || !fp32_vector(mean, rows, device, false) ||
      !fp32_vector(rstd, rows, device, false)) {
    return std::nullopt;
  }
  if (grad_add && (!grad_add->sizes().equals(x.sizes()) || hp_code_or_none(grad_add->scalar_type()) < 0 ||
                   !plain_on(*grad_add, device))) {
    return std::nullopt;
  }
  return layer_norm_grad(dy, x, weight, mean, rstd, grad_add, stream);
}

// The Hopper attention kernels' schedule (AttentionShape::turns,
// AttentionFp8Args::overlap and v_in_kernel): the consumers' turns at the tensor
// cores (the same bits either way); FP8 only, the next tile's product in flight
// during the softmax (other bits; the default, as the faster on the H200 at every
// shape measured but one, within 2% there: RESULTS.md run 186), and V's keys-inner
// tiles made by the producer warpgroup rather than by a launch before (the same
// bits): 0 never, 1 always, 2 (the default) up to 2048 keys. The kernel's rewrite
// is made once per query block that reads a tile, the launch's once per tile: the
// kernel's was the faster at 1024 keys (10% at head dim 64, 14% at 128) and at
// 2048 (4% at head dim 64, 8% at 128), level at 4096 keys with head dim 64 and
// 3-10% the slower at 128 (RESULTS.md runs 248-250, 261 and 262). Set for this
// process.
bool attention_turns_state = true;
bool attention_overlap_state = true;
int64_t attention_v_in_kernel_state = 2;
// Both persistent forwards: their items dealt out forwards and backwards in turn
// (attention_common.cuh's for_each_item), or forwards every round.
bool attention_mirrored_state = true;

// Sets turns, overlap and mirrored as 0 or 1, v_in_kernel as 0, 1 or 2 (-1 leaves
// one); returns the previous four.
std::tuple<bool, bool, int64_t, bool> attention_schedule(int64_t turns, int64_t overlap, int64_t v_in_kernel,
                                                         int64_t mirrored) {
  const std::tuple<bool, bool, int64_t, bool> previous{attention_turns_state, attention_overlap_state,
                                                       attention_v_in_kernel_state, attention_mirrored_state};
  if (turns >= 0) attention_turns_state = turns != 0;
  if (overlap >= 0) attention_overlap_state = overlap != 0;
  if (v_in_kernel >= 0) attention_v_in_kernel_state = std::min<int64_t>(v_in_kernel, 2);
  if (mirrored >= 0) attention_mirrored_state = mirrored != 0;
  return previous;
}

// A 4-D view of `type` on `device` whose rows the Hopper attention kernels' copies
// read as 16-byte chunks: head dim 64 or 128 and contiguous, the start and the
// other strides multiples of 16 bytes.
bool attention_operand(const at::Tensor& t, at::ScalarType type, int64_t device) {
  if (t.scalar_type() != type || !t.is_cuda() || t.get_device() != device || t.dim() != 4 ||
      (t.size(3) != 64 && t.size(3) != 128) || t.stride(3) != 1 ||
      reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) {
    return false;
  }
  const int64_t per_chunk = 16 / t.element_size();
  for (int d = 0; d < 3; ++d) {
    if (t.stride(d) % per_chunk != 0 || t.size(d) > std::numeric_limits<int32_t>::max()) return false;
  }
  return true;
}

// Whether t has a broadcast dim among its first three (stride 0 over more than one
// element), which the FP8 forward's tensor maps are not made for.
bool broadcast_dim(const at::Tensor& t) {
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) == 0) return true;
  }
  return false;
}

// q (B, H, Tq, D), k and v (B, Hkv, Tk, D) of `type` as attention_operand takes
// them, of one batch and head dim, with k and v of one shape, query heads a
// multiple of the kv heads, keys, and no more batch·heads than a grid holds.
bool attention_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::ScalarType type,
                        int64_t device) {
  return attention_operand(q, type, device) && attention_operand(k, type, device) &&
         attention_operand(v, type, device) && k.sizes().equals(v.sizes()) && q.size(0) == k.size(0) &&
         q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 && k.size(2) > 0 &&
         q.size(0) * q.size(1) <= 65535;
}

// The launch's shape of q, k, v, their output o and its lse (see AttentionShape).
void describe_attention(te_fuser::AttentionShape& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& o, const at::Tensor& lse, double softmax_scale, bool causal) {
  a.lse = lse.data_ptr<float>();
  a.qk_scale = static_cast<float>(softmax_scale * 1.4426950408889634);
  a.batch = static_cast<int>(q.size(0));
  a.h = static_cast<int>(q.size(1));
  a.hkv = static_cast<int>(k.size(1));
  a.tq = static_cast<int>(q.size(2));
  a.tk = static_cast<int>(k.size(2));
  a.head_dim = static_cast<int>(q.size(3));
  a.causal = causal;
  a.turns = attention_turns_state;
  a.mirrored = attention_mirrored_state;
  a.q_stride_b = q.stride(0), a.q_stride_h = q.stride(1), a.q_stride_t = q.stride(2);
  a.k_stride_b = k.stride(0), a.k_stride_h = k.stride(1), a.k_stride_t = k.stride(2);
  a.v_stride_b = v.stride(0), a.v_stride_h = v.stride(1), a.v_stride_t = v.stride(2);
  a.o_stride_b = o.stride(0), a.o_stride_h = o.stride(1), a.o_stride_t = o.stride(2);
}

// describe_attention, and the tensors' addresses, for the bf16 / fp16 Hopper kernels.
void describe_hp_attention(te_fuser::AttentionHpArgs& a, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse, double softmax_scale,
                           bool causal) {
  describe_attention(a, q, k, v, o, lse, softmax_scale, causal);
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.o = o.data_ptr();
}

// o (B, H, Tq, D) in `type`, a view of a (B, Tq, H, D) tensor (its (B, Tq, H·D)
// merge a view), and lse (B, H, Tq) fp32 of q's attention: new tensors.
std::tuple<at::Tensor, at::Tensor> attention_outputs(const at::Tensor& q, at::ScalarType type) {
  const int64_t batch = q.size(0), heads = q.size(1), tq = q.size(2), dim = q.size(3);
  return {at::empty({batch, tq, heads, dim}, q.options().dtype(type)).transpose(1, 2),
          at::empty({batch, heads, tq}, q.options().dtype(at::kFloat))};
}

// The bf16 / fp16 attention forward on Hopper (launch_attention_hp_forward): (o (B,
// H, Tq, D) in q's dtype, a view of a (B, Tq, H, D) tensor; lse (B, H, Tq) fp32),
// new tensors. None for operands the Python path must look at: q, k, v not views
// attention_operands takes (of one dtype).
std::optional<std::tuple<at::Tensor, at::Tensor>> attention_hp_forward_lean(const at::Tensor& q, const at::Tensor& k,
                                                                            const at::Tensor& v, double softmax_scale,
                                                                            bool causal, int64_t device,
                                                                            int64_t stream) {
  const at::ScalarType type = q.scalar_type();
  if ((type != at::kBFloat16 && type != at::kHalf) || !attention_operands(q, k, v, type, device)) return std::nullopt;
  auto [o, lse] = attention_outputs(q, type);
  te_fuser::AttentionHpArgs a;
  describe_hp_attention(a, q, k, v, o, lse, softmax_scale, causal);
  te_fuser::launch_attention_hp_forward(a, hp_code_or_none(type), as_stream(stream));
  return std::make_tuple(o, lse);
}

// Whether q, k, v, o and do of a bf16 / fp16 attention backward are views the Hopper
// backward kernels read (attention_operands; o and do of q's shape; no broadcast
// dim) and lse (and delta, if defined) fp32 (B, H, Tq) contiguous.
bool hp_backward_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                          const at::Tensor& dout, const at::Tensor& lse, const at::Tensor* delta, int64_t device) {
  const at::ScalarType type = q.scalar_type();
  const auto rows_of = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.is_cuda() && t.get_device() == device && t.is_contiguous() &&
           t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(2) == q.size(2);
  };
  return (type == at::kBFloat16 || type == at::kHalf) && attention_operands(q, k, v, type, device) &&
         attention_operand(o, type, device) && attention_operand(dout, type, device) && o.sizes().equals(q.sizes()) &&
         dout.sizes().equals(q.sizes()) && !broadcast_dim(q) && !broadcast_dim(k) && !broadcast_dim(v) &&
         !broadcast_dim(dout) && rows_of(lse) && (delta == nullptr || rows_of(*delta));
}

// The buffer of the Hopper backward's per-step query columns (launchers.cuh's
// AttentionBwdArgs::rows), which its first kernel fills.
at::Tensor step_columns(const at::Tensor& q, const at::Tensor& lse) {
  return at::empty({q.size(0) * q.size(1), (q.size(2) + 63) / 64, 2, 64}, lse.options());
}

// The launch's arguments of the Hopper backward kernels (dq, dk, dv: their outputs).
te_fuser::AttentionBwdArgs hp_backward_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& o, const at::Tensor& dout, const at::Tensor& lse,
                                            const at::Tensor& delta, const at::Tensor& dq, const at::Tensor& dk,
                                            const at::Tensor& dv, const at::Tensor& rows, double softmax_scale,
                                            bool causal) {
  te_fuser::AttentionBwdArgs a;
  describe_hp_attention(a, q, k, v, o, lse, softmax_scale, causal);
  a.dout = dout.data_ptr();
  a.delta = delta.defined() ? delta.data_ptr<float>() : nullptr;  // undefined: the kernels make it
  a.dq = dq.defined() ? dq.data_ptr() : nullptr;
  a.dk = dk.data_ptr();
  a.dv = dv.data_ptr();
  a.softmax_scale = static_cast<float>(softmax_scale);
  a.do_stride_b = dout.stride(0), a.do_stride_h = dout.stride(1), a.do_stride_t = dout.stride(2);
  a.rows = rows.data_ptr<float>();
  if (dq.defined()) a.dq_stride_b = dq.stride(0), a.dq_stride_h = dq.stride(1), a.dq_stride_t = dq.stride(2);
  a.dk_stride_b = dk.stride(0), a.dk_stride_h = dk.stride(1), a.dk_stride_t = dk.stride(2);
  a.dv_stride_b = dv.stride(0), a.dv_stride_h = dv.stride(1), a.dv_stride_t = dv.stride(2);
  return a;
}

// dk and dv of the bf16 / fp16 attention backward on Hopper from a given delta
// (rowsum(do ∘ o), fp32 (B, H, Tq) contiguous; launch_attention_hp_dkdv): into
// dk_out and dv_out where given, else new tensors (B, Hkv, Tk, D). None for
// operands the Python path must look at.
std::optional<std::tuple<at::Tensor, at::Tensor>> attention_hp_dkdv(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout, const at::Tensor& lse,
    const at::Tensor& delta, double softmax_scale, bool causal, const std::optional<at::Tensor>& dk_out,
    const std::optional<at::Tensor>& dv_out, int64_t device, int64_t stream) {
  if (!hp_backward_operands(q, k, v, dout, dout, lse, &delta, device)) return std::nullopt;
  // given outputs (views of the fused gradient, say): k's type, shape and device, their
  // pairs of elements 4-byte aligned (the kernel stores two at a time)
  const auto writable = [&](const std::optional<at::Tensor>& out) {
    if (!out.has_value()) return true;
    const at::Tensor& t = *out;
    return t.scalar_type() == k.scalar_type() && t.is_cuda() && t.get_device() == device &&
           t.sizes().equals(k.sizes()) && t.stride(3) == 1 && t.stride(0) % 2 == 0 && t.stride(1) % 2 == 0 &&
           t.stride(2) % 2 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
  };
  if (!writable(dk_out) || !writable(dv_out)) return std::nullopt;
  at::Tensor dk = dk_out.has_value() ? *dk_out : at::empty(k.sizes(), k.options());
  at::Tensor dv = dv_out.has_value() ? *dv_out : at::empty(v.sizes(), v.options());
  const at::Tensor rows = step_columns(q, lse);
  const auto a = hp_backward_args(q, k, v, dout, dout, lse, delta, at::Tensor(), dk, dv, rows, softmax_scale, causal);
  te_fuser::launch_attention_hp_dkdv(a, hp_code_or_none(q.scalar_type()), as_stream(stream));
  return std::make_tuple(dk, dv);
}

// The bf16 / fp16 attention backward on Hopper: delta, then the dk / dv kernel that
// also adds each block's share of dq to fp32 chunks in a fixed order, then dq from
// them (or, as `in_kernel` asks: kDqInKernel | kDeltaInKernel, dq stored and delta made
// in the dk / dv kernel); (dq, dk, dv) of q's, k's, v's shapes, laid out as Triton's
// backward lays them out. None for operands the Python path must look at.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> attention_hp_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
    const at::Tensor& dout, double softmax_scale, bool causal, int64_t in_kernel, int64_t device, int64_t stream) {
  if (!hp_backward_operands(q, k, v, o, dout, lse, nullptr, device)) return std::nullopt;
  // (B, heads, T, D) views of one (B, T, H + 2·Hkv, D) buffer (the fused QKV tensor's
  // gradient, as Triton's backward writes it) where the lengths agree; else three
  // tensors in the (B, T, heads, D) layout
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3);
  at::Tensor dq, dk, dv;
  if (Tq == Tk) {
    const at::Tensor fused = at::empty({B, Tq, H + 2 * Hkv, D}, q.options());
    const auto views = fused.transpose(1, 2).split_with_sizes({H, Hkv, Hkv}, 1);
    dq = views[0], dk = views[1], dv = views[2];
  } else {
    dq = at::empty({B, Tq, H, D}, q.options()).transpose(1, 2);
    dk = at::empty({B, Tk, Hkv, D}, q.options()).transpose(1, 2);
    dv = at::empty({B, Tk, Hkv, D}, q.options()).transpose(1, 2);
  }
  const int64_t chunks = (Tq + 63) / 64;  // dq's chunks of 64 queries
  const at::Tensor dq_accum = at::empty({B, H, chunks, 64 * D}, lse.options());
  // a turn counter a chunk, then the queue of chunks stored in the kernel and its
  // four counters (DqQueue), then a flag a chunk: its delta made in the kernel
  const at::Tensor turns = at::zeros({3 * B * H * chunks + 4}, lse.options().dtype(at::kInt));
  const at::Tensor rows = step_columns(q, lse);
  auto a = hp_backward_args(q, k, v, o, dout, lse, at::Tensor(), dq, dk, dv, rows, softmax_scale, causal);
  a.dq_accum = dq_accum.data_ptr<float>();
  a.dq_turns = turns.data_ptr<int>();
  a.in_kernel = static_cast<int>(in_kernel);  // the launch keeps the stages it may run (causal, the layouts)
  te_fuser::launch_attention_hp_backward(a, hp_code_or_none(q.scalar_type()), as_stream(stream));
  return std::make_tuple(dq, dk, dv);
}

// V (B, Hkv, Tk, D) as the FP8 attention forward reads it: (B·Hkv, D, pitch)
// bytes, each row's positions holding the keys in the kernel's order, zeros past
// Tk (launch_attention_fp8_keys_inner). None for a v that attention_operand does
// not take.
std::optional<at::Tensor> attention_fp8_keys_inner(const at::Tensor& v, int64_t device, int64_t stream) {
  if (!attention_operand(v, at::kFloat8_e4m3fn, device) || v.size(2) == 0 || v.size(0) * v.size(1) > 65535) {
    return std::nullopt;
  }
  const int64_t pitch = te_fuser::attention_fp8_vt_pitch(v.size(2));
  at::Tensor vt = at::empty({v.size(0) * v.size(1), v.size(3), pitch}, v.options().dtype(at::kByte));
  te_fuser::AttentionFp8Args a;
  a.v = static_cast<const uint8_t*>(v.data_ptr());
  a.vt = vt.data_ptr<uint8_t>();
  a.batch = static_cast<int>(v.size(0));
  a.hkv = static_cast<int>(v.size(1));
  a.tk = static_cast<int>(v.size(2));
  a.head_dim = static_cast<int>(v.size(3));
  a.vt_pitch = pitch;
  a.v_stride_b = v.stride(0), a.v_stride_h = v.stride(1), a.v_stride_t = v.stride(2);
  te_fuser::launch_attention_fp8_keys_inner(a, as_stream(stream));
  return vt;
}

// Whether the FP8 forward reads v (B, Hkv, Tk, D) as it lies with its keys inner
// (key stride 1: a transposed copy, v's head-dim stride and the others multiples of
// 16 bytes) and k's rows permuted instead (AttentionFp8Args::keys_permuted): k's
// batches after its heads (batch stride Hkv head strides) or its keys (Tk key
// strides), Tk a multiple of 16.
bool keys_inner_v(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t device) {
  if (v.scalar_type() != at::kFloat8_e4m3fn || !v.is_cuda() || v.get_device() != device || v.dim() != 4 ||
      !v.sizes().equals(k.sizes()) || v.stride(2) != 1 || v.size(2) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 != 0) {
    return false;
  }
  for (const int d : {0, 1, 3}) {
    if (v.stride(d) % 16 != 0 || v.stride(d) <= 0) return false;
  }
  return attention_operand(q, at::kFloat8_e4m3fn, device) && attention_operand(k, at::kFloat8_e4m3fn, device) &&
         q.size(0) == k.size(0) && q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
         q.size(0) * q.size(1) <= 65535 && k.stride(1) > 0 && k.stride(2) > 0 &&
         (k.size(0) == 1 || k.stride(0) == k.size(1) * k.stride(1) || k.stride(0) == k.size(2) * k.stride(2));
}

// The FP8 attention forward (see launch_attention_fp8_forward): (o (B, H, Tq, D) in
// out_dtype, a view of a (B, Tq, H, D) tensor; lse (B, H, Tq) fp32), new tensors.
// scales: the fp32 q_scale_inv, k_scale_inv, v_scale_inv and p_scale, contiguous.
// None for operands the Python path must look at: q, k, v not E4M3 views that
// attention_operands takes, scales not four contiguous fp32 on `device`, an
// out_dtype not bf16, fp16 or fp32.
std::optional<std::tuple<at::Tensor, at::Tensor>> attention_fp8_forward_lean(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& scales, double softmax_scale,
    bool causal, at::ScalarType out_dtype, int64_t device, int64_t stream) {
  const int out = hp_code_or_none(out_dtype);
  const bool keys_permuted = v.dim() == 4 && v.size(3) > 1 && v.stride(3) != 1 && keys_inner_v(q, k, v, device);
  if (out < 0 || !(keys_permuted || attention_operands(q, k, v, at::kFloat8_e4m3fn, device)) || broadcast_dim(q) ||
      broadcast_dim(k) || scales.scalar_type() != at::kFloat || !scales.is_cuda() || scales.get_device() != device ||
      scales.numel() != 4 || !scales.is_contiguous()) {
    return std::nullopt;
  }
  auto [o, lse] = attention_outputs(q, out_dtype);
  if (q.size(0) * q.size(1) * q.size(2) == 0) return std::make_tuple(o, lse);
  te_fuser::AttentionFp8Args a;
  describe_attention(a, q, k, v, o, lse, softmax_scale, causal);
  a.q = static_cast<const uint8_t*>(q.data_ptr());
  a.k = static_cast<const uint8_t*>(k.data_ptr());
  a.v = static_cast<const uint8_t*>(v.data_ptr());
  a.o = o.data_ptr();
  a.scales = scales.data_ptr<float>();
  a.overlap = attention_overlap_state;
  a.keys_permuted = keys_permuted;
  a.v_stride_d = v.stride(3);
  if (keys_permuted && (k.size(0) == 1 || k.stride(0) == k.size(1) * k.stride(1))) {
    a.kp_batch_heads = a.hkv;
  } else if (keys_permuted) {
    a.kp_batch_keys = a.tk;
  }
  a.v_in_kernel = !keys_permuted && (attention_v_in_kernel_state == 1 ||
                                     (attention_v_in_kernel_state == 2 && k.size(2) <= 2048));
  at::Tensor vt;  // V with its keys inner, where a launch before the forward makes it
  if (!a.v_in_kernel && !keys_permuted) {
    a.vt_pitch = te_fuser::attention_fp8_vt_pitch(k.size(2));
    vt = at::empty({k.size(0) * k.size(1) * q.size(3) * a.vt_pitch}, q.options().dtype(at::kByte));
    a.vt = vt.data_ptr<uint8_t>();
  }
  te_fuser::launch_attention_fp8_forward(a, out, as_stream(stream));
  return std::make_tuple(o, lse);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "te_fuser CUDA FP8 cast and GEMM-epilogue kernels (sm_90a)";
  m.def("amax", &amax, "amax(|x|) into a one-element fp32 buffer");
  m.def("cast", &cast, "tensor-scaled FP8 cast, optionally with a transposed copy");
  m.def("cast_current", &cast_current, "current scaling's amax and cast, outputs allocated here");
  m.def("delayed_scale_update", &delayed_scale_update, "delayed scaling's history, scale and count in one launch");
  m.def("delayed_scale_update_many", &delayed_scale_update_many,
        "delayed scaling's update of many quantizers of one configuration, one launch per 32, nothing stacked first");
  m.def("cast_tensorwise", &cast_tensorwise, "delayed scaling's cast with a given scale, outputs allocated here");
  m.def("cast_tensorwise_update", &cast_tensorwise_update,
        "delayed scaling's cast and its state update in one call (one launch where the cast is one)");
  m.def("cast_current_lean", &cast_current_lean,
        "current scaling's cast of x's 2-D flattening, x checked here: (data, data_t, scale_inv, sums) or None");
  m.def("cast_tensorwise_update_lean", &cast_tensorwise_update_lean,
        "cast_tensorwise_update of x's 2-D flattening with x and the state checked here, or None");
  m.def("one_launch_casts", &one_launch_casts,
        "turn the transposing casts' one cooperative launch on or off; returns the previous state");
  m.def("one_launch_casts_in_capture", &one_launch_casts_in_capture,
        "whether the one launch also runs in a CUDA graph being captured; returns the previous state");
  m.def("quantize_rowwise", &quantize_rowwise, "FP8 cast with one scale per row");
  m.def("quantize_mxfp8", &quantize_mxfp8, "MXFP8 cast: one E8M0 scale per 32 elements");
  m.def("dact_dbias_lean", &dact_dbias_lean,
        "the backward of Bias -> a unary activation: (dx, dbias fp32), operands checked here; None for a case the "
        "Python path takes");
  m.def("rotary_lean", &rotary_lean,
        "RoPE of x (B, T, heads, D) into a new tensor or in place, operands checked here; None for a case the "
        "Python path takes");
  m.def("attention_hp_forward_lean", &attention_hp_forward_lean,
        "the bf16 / fp16 attention forward on Hopper's tensor cores: (o, lse), operands checked here; None for a "
        "case the Python path takes");
  m.def("attention_fp8_keys_inner", &attention_fp8_keys_inner,
        "V as the FP8 attention forward reads it (keys inner, in the kernel's order), or None");
  m.def("attention_hp_dkdv", &attention_hp_dkdv,
        "dk and dv of the bf16 / fp16 attention backward on Hopper's tensor cores from a given delta "
        "(deterministic), or None for operands the Python path takes");
  m.def("attention_hp_backward", &attention_hp_backward,
        "the bf16 / fp16 attention backward on Hopper's tensor cores, (dq, dk, dv) (deterministic), with what its "
        "dk / dv kernel also does (1: dq stored, 2: delta made), or None for operands the Python path takes");
  m.def("attention_schedule", &attention_schedule,
        "the Hopper attention kernels' schedule: (turns, overlap, v_in_kernel, mirrored), 0 or 1 (v_in_kernel 2: "
        "by the shape), -1 to leave one; returns the previous four");
  m.def("attention_fp8_forward_lean", &attention_fp8_forward_lean,
        "the FP8 attention forward on Hopper's tensor cores: (o, lse), operands checked here; None for a case the "
        "Python path takes");
  m.def("layer_norm", &layer_norm, "LayerNorm forward, one warp per row, outputs allocated here");
  m.def("layer_norm_lean", &layer_norm_lean,
        "layer_norm with its operands checked here: (y, mean, rstd), or None for a case the Python path takes");
  m.def("layer_norm_grad_lean", &layer_norm_grad_lean,
        "layer_norm_grad with its operands checked here: (dx, dweight, dbias), or None for a case the Python path "
        "takes");
  m.def("layer_norm_grad", &layer_norm_grad, "LayerNorm backward: dx, dweight, dbias, outputs allocated here");
  m.def("epilogue", &epilogue, "bias + activation + residual over a GEMM result");
  m.def("fp8_gemm_tensorwise", &te_fuser::fp8_gemm_tensorwise,
        "tensor-scaled FP8 GEMM through cuBLASLt, its descriptors and algorithm kept per problem");
  m.def("fp8_gemm_lean", &te_fuser::fp8_gemm_lean,
        "the ops' common FP8 GEMM with its bias, activation and residual epilogue, checked here; None for a case "
        "the Python path takes");
  m.def("fp8_gemm_scaled", &te_fuser::fp8_gemm_scaled,
        "FP8 GEMM of tensor- or block-scaled (1x128, 128x128) operands through cuBLASLt, its plan kept per problem");
  m.def("fp8_gemm_block_supported", &te_fuser::fp8_gemm_block_supported,
        "whether block-scaled FP8 GEMMs run here (cuBLASLt >= 12.9, built against and loaded)");
  m.def("fp8_gemm_plans", &te_fuser::fp8_gemm_plans, "how many GEMM problems have a kept cuBLASLt plan");
  m.def("fp8_gemm_set_workspace_limit", &te_fuser::fp8_gemm_set_workspace_limit,
        "the most workspace a GEMM planned from now on may ask for (bytes); returns the limit before");
  m.def("fp8_gemm_tensorwise_candidate", &te_fuser::fp8_gemm_tensorwise_candidate,
        "the FP8 GEMM with the heuristic's n-th algorithm, and its workspace bytes");
}
