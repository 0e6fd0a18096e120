// Python binding of the CUDA launchers. Tensors arrive as raw device addresses
// (Tensor.data_ptr()) and the stream as its cudaStream_t value: the Python
// launchers have already checked every shape, dtype and device.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "launchers.cuh"

namespace {

template <typename P>
P* as_ptr(int64_t address) {
  return reinterpret_cast<P*>(static_cast<intptr_t>(address));
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "te_fuser CUDA FP8 cast and GEMM-epilogue kernels (sm_90a)";
  m.def("amax", &amax, "amax(|x|) into a one-element fp32 buffer");
  m.def("cast", &cast, "tensor-scaled FP8 cast, optionally with a transposed copy");
  m.def("quantize_rowwise", &quantize_rowwise, "FP8 cast with one scale per row");
  m.def("quantize_mxfp8", &quantize_mxfp8, "MXFP8 cast: one E8M0 scale per 32 elements");
  m.def("epilogue", &epilogue, "bias + activation + residual over a GEMM result");
}
