// The tensor-scaled FP8 GEMM straight through cuBLASLt, its setup done once per problem.
//
// out (M, N) = (a (M, K) @ b (N, K)^T) * scale_a * scale_b [+ bias (N,)], a and b FP8,
// each row-major along K: the layout Hopper's FP8 tensor cores want. In cuBLASLt's
// column-major terms the row-major (M, N) output is a column-major N x M matrix
// D = op(A) op(B) with A = b (column-major K x N, transposed) and B = a (column-major
// K x M): the "TN" form, the only one cuBLASLt runs FP8 in.
//
// torch._scaled_mm builds the matmul descriptor and the three matrix layouts and
// asks cuBLASLt's heuristic for an algorithm on every call. Here they are built
// once per (shape, dtypes, bias, accumulation, pointer alignments, scale modes,
// device) and kept; a call sets the scale and bias pointers on the kept descriptor,
// allocates the output and enqueues the matmul. The algorithm is the heuristic's
// first choice, as torch's.
//
// Block-scaled operands (Hopper, cuBLASLt >= 12.9) take the same path with a scale
// mode per operand: 1x128 (one fp32 scale per 128 elements of a row along K) or
// 128x128 (one per tile). cuBLASLt reads a 1x128 operand's scales K-block by
// K-block, the rows inner: an array (ceil(K/128), rows); a 128x128 operand's as a
// row-major (ceil(rows/128), ceil(K/128)) grid.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "dtype_codes.h"
#include "launchers.cuh"

namespace te_fuser {

// Whether block-scaled GEMMs run here: cuBLASLt 12.9 or later, built against and loaded.
bool fp8_gemm_block_supported() {
  static const bool supported = CUBLAS_VERSION >= 120900 && cublasLtGetVersion() >= 120900;  // asked once
  return supported;
}

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

void check(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "te_fuser cuBLASLt FP8 GEMM: ", what, " failed (cublasStatus ",
              static_cast<int>(status), ")");
}

cudaDataType_t fp8_type(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat8_e4m3fn) return CUDA_R_8F_E4M3;
  if (t.scalar_type() == at::kFloat8_e5m2) return CUDA_R_8F_E5M2;
  TORCH_CHECK(false, "te_fuser cuBLASLt FP8 GEMM: ", name, " must be float8_e4m3fn or float8_e5m2, got ",
              t.scalar_type());
}

cudaDataType_t hp_type(at::ScalarType t, const char* name) {
  if (t == at::kBFloat16) return CUDA_R_16BF;
  if (t == at::kHalf) return CUDA_R_16F;
  if (t == at::kFloat) return CUDA_R_32F;
  TORCH_CHECK(false, "te_fuser cuBLASLt FP8 GEMM: ", name, " must be bfloat16, float16 or float32, got ", t);
}

// The largest power of two (up to 256) that divides the address: cuBLASLt's
// heuristic is told how aligned each pointer is, so a kept algorithm is only
// reused for pointers at least as aligned as the ones it was chosen for.
int alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && address % align) align /= 2;
  return align;
}

using Key = std::tuple<int64_t, int64_t, int64_t, int, int, int, int, bool, int, int, int, int, int, int64_t, int, int>;

// An operand's scale mode: one fp32 scale, 1x128 blocks along K, or 128x128 tiles.
enum ScaleMode : int { kScaleTensor = 0, kScaleVec128 = 1, kScaleBlock128 = 2 };

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;  // what the algorithm asks of the workspace
};

struct Device {
  cublasLtHandle_t handle = nullptr;
  at::Tensor workspace;
};

struct Cache {
  std::mutex mutex;
  std::map<Key, Plan> plans;
  std::map<int, Device> devices;
  // The most workspace a new plan's algorithm may ask for (the heuristic's
  // preference); part of the plan's key, so plans made under another limit stay.
  int64_t workspace_limit = static_cast<int64_t>(kWorkspaceBytes);
};

Cache& cache() {
  static Cache* kept = new Cache();  // never destroyed: cuBLASLt may be unloaded before static destructors run
  return *kept;
}

template <typename T>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value, const char* what) {
  check(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), what);
}

Device& device_state(Cache& c, const at::Tensor& like) {
  const int index = like.get_device();
  auto found = c.devices.find(index);
  if (found != c.devices.end()) return found->second;
  Device fresh;
  check(cublasLtCreate(&fresh.handle), "cublasLtCreate");
  fresh.workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)}, like.options().dtype(at::kByte));
  return c.devices.emplace(index, std::move(fresh)).first->second;
}

#if CUBLAS_VERSION >= 120900
cublasLtMatmulMatrixScale_t cublas_scale_mode(int mode) {
  if (mode == kScaleVec128) return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  if (mode == kScaleBlock128) return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}
#endif

// How many fp32 scales an operand of `rows` x `k` holds under `mode`.
int64_t scale_count(int mode, int64_t rows, int64_t k) {
  const int64_t k_blocks = (k + 127) / 128;
  if (mode == kScaleVec128) return k_blocks * rows;
  if (mode == kScaleBlock128) return k_blocks * ((rows + 127) / 128);
  return 1;
}

Plan build_plan(cublasLtHandle_t handle, int64_t m, int64_t n, int64_t k, cudaDataType_t a_type,
                cudaDataType_t b_type, cudaDataType_t out_type, std::optional<cudaDataType_t> bias_type,
                bool fast_accum, int align_a, int align_b, int align_d, int candidate, int64_t workspace_limit,
                int a_mode, int b_mode, const void* scale_a, const void* scale_b) {
  Plan plan;
  check(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  set(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "TRANSA");
  set(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "TRANSB");
  set(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum), "FAST_ACCUM");
  if (a_mode != kScaleTensor || b_mode != kScaleTensor) {  // b is cuBLASLt's A, a its B
#if CUBLAS_VERSION >= 120900
    set(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, cublas_scale_mode(b_mode), "A_SCALE_MODE");
    set(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, cublas_scale_mode(a_mode), "B_SCALE_MODE");
#endif
  }
  // the scales' pointers known to the heuristic too (each call sets its own before the matmul)
  set(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_b, "A_SCALE_POINTER");
  set(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_a, "B_SCALE_POINTER");
  if (bias_type) {
    set(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS, "EPILOGUE");
    set(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, *bias_type, "BIAS_DATA_TYPE");
  }
  check(cublasLtMatrixLayoutCreate(&plan.a, b_type, k, n, k), "layout of b");  // b (N, K) row-major
  check(cublasLtMatrixLayoutCreate(&plan.b, a_type, k, m, k), "layout of a");  // a (M, K) row-major
  check(cublasLtMatrixLayoutCreate(&plan.d, out_type, n, m, n), "layout of out");  // out (M, N) row-major

  cublasLtMatmulPreference_t preference = nullptr;
  check(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
  const size_t workspace = static_cast<size_t>(workspace_limit);
  const uint32_t aligns[4] = {static_cast<uint32_t>(align_b), static_cast<uint32_t>(align_a),
                              static_cast<uint32_t>(align_d), static_cast<uint32_t>(align_d)};
  check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                             sizeof(workspace)), "workspace preference");
  const cublasLtMatmulPreferenceAttributes_t align_attributes[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    check(cublasLtMatmulPreferenceSetAttribute(preference, align_attributes[i], &aligns[i], sizeof(aligns[i])),
          "alignment preference");
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(candidate + 1);
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d,
                                                               preference, candidate + 1, results.data(), &found);
  cublasLtMatmulPreferenceDestroy(preference);
  check(status, "cublasLtMatmulAlgoGetHeuristic");
  TORCH_CHECK(found > candidate, "te_fuser cuBLASLt FP8 GEMM: no algorithm ", candidate, " for M=", m, " N=", n,
              " K=", k, " (the heuristic has ", found, ")");
  plan.algo = results[candidate].algo;
  plan.workspace = results[candidate].workspaceSize;
  return plan;
}

}  // namespace

namespace {

// The GEMM with the heuristic's candidate-th algorithm (0: its first choice): the
// output and the algorithm's workspace bytes.
std::tuple<at::Tensor, int64_t> run_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                         const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                                         at::ScalarType out_dtype, bool fast_accum, int candidate, int64_t stream,
                                         int a_mode = kScaleTensor, int b_mode = kScaleTensor) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1) && a.is_contiguous() && b.is_contiguous(),
              "te_fuser cuBLASLt FP8 GEMM: a (M, K) and b (N, K) must be contiguous with one K, got ", a.sizes(),
              " and ", b.sizes());
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  const cudaDataType_t a_type = fp8_type(a, "a"), b_type = fp8_type(b, "b"), out_type = hp_type(out_dtype, "out");
  std::optional<cudaDataType_t> bias_type;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "te_fuser cuBLASLt FP8 GEMM: bias must be contiguous with shape (", n, "), got ", bias->sizes());
    bias_type = hp_type(bias->scalar_type(), "bias");
  }
  TORCH_CHECK((a_mode == kScaleTensor && b_mode == kScaleTensor) || fp8_gemm_block_supported(),
              "te_fuser cuBLASLt FP8 GEMM: block-scaled operands need cuBLASLt >= 12.9 (built against ",
              CUBLAS_VERSION, ", running ", cublasLtGetVersion(), ")");
  const int modes[2] = {a_mode, b_mode};
  const int64_t rows[2] = {m, n};
  const at::Tensor* scales[2] = {&scale_a, &scale_b};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& s = *scales[i];
    TORCH_CHECK(modes[i] >= kScaleTensor && modes[i] <= kScaleBlock128, "te_fuser cuBLASLt FP8 GEMM: scale mode of ",
                i ? "b" : "a", " must be 0 (tensor), 1 (1x128) or 2 (128x128), got ", modes[i]);
    const int64_t count = scale_count(modes[i], rows[i], k);
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == count &&
                    alignment(s.data_ptr()) >= 16,
                "te_fuser cuBLASLt FP8 GEMM: the scales of ", i ? "b" : "a", " must be a contiguous, 16-byte aligned "
                "fp32 tensor of ", count, " elements, got ", s.scalar_type(), " with ", s.numel(),
                s.is_contiguous() ? "" : ", not contiguous");
  }
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const Key key{m, n, k, a_type, b_type, out_type, bias_type ? static_cast<int>(*bias_type) : -1, fast_accum,
                alignment(a.data_ptr()), alignment(b.data_ptr()), alignment(out.data_ptr()), a.get_device(),
                candidate, c.workspace_limit, a_mode, b_mode};
  Device& device = device_state(c, a);
  auto found = c.plans.find(key);
  if (found == c.plans.end()) {
    found = c.plans.emplace(key, build_plan(device.handle, m, n, k, a_type, b_type, out_type, bias_type,
                                            fast_accum, std::get<8>(key), std::get<9>(key), std::get<10>(key),
                                            candidate, c.workspace_limit, a_mode, b_mode, scale_a.data_ptr(),
                                            scale_b.data_ptr()))
                .first;
  }
  const Plan& plan = found->second;
  set(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_b.data_ptr(), "A_SCALE_POINTER");  // b is cuBLASLt's A
  set(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_a.data_ptr(), "B_SCALE_POINTER");
  if (bias) set(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->data_ptr(), "BIAS_POINTER");
  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(device.handle, plan.desc, &alpha, b.data_ptr(), plan.a, a.data_ptr(), plan.b, &beta,
                       out.data_ptr(), plan.d, out.data_ptr(), plan.d, &plan.algo, device.workspace.data_ptr(),
                       kWorkspaceBytes, reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream))),
        "cublasLtMatmul");
  return {out, static_cast<int64_t>(plan.workspace)};
}

}  // namespace

// out (M, N) in out_dtype; scale_a, scale_b: fp32 one-element tensors, 16-byte aligned
// (cuBLASLt refuses others); bias (N,) of out_dtype or none.
at::Tensor fp8_gemm_tensorwise(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                               const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                               at::ScalarType out_dtype, bool fast_accum, int64_t stream) {
  return std::get<0>(run_gemm(a, b, scale_a, scale_b, bias, out_dtype, fast_accum, 0, stream));
}

// The same GEMM with block-scaled operands: a_mode, b_mode 0 (one scale), 1 (1x128)
// or 2 (128x128); each scale tensor contiguous in the order cuBLASLt reads (see the
// head of this file); bias (N,) of out_dtype or none. fast_accum is ignored by
// block-scaled GEMMs (they promote every 128-wide block), so it is not taken.
at::Tensor fp8_gemm_scaled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                           const at::Tensor& scale_b, int64_t a_mode, int64_t b_mode,
                           const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, int64_t stream) {
  return std::get<0>(run_gemm(a, b, scale_a, scale_b, bias, out_dtype, false, 0, stream, static_cast<int>(a_mode),
                              static_cast<int>(b_mode)));
}

namespace {

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// On `device`, contiguous and 16-byte aligned: what the kernels read as they are.
bool ready(const at::Tensor& t, int64_t device) {
  return t.is_cuda() && t.get_device() == device && t.is_contiguous() && alignment(t.data_ptr()) >= 16;
}

}  // namespace

// The ops' common FP8 GEMM in one call, its checks here: activation(a (M, K) @ b (N, K)^T
// * scale_a * scale_b + bias (N,)) + residual (M, N) as out_dtype, the bias in
// cuBLASLt's epilogue where it is of out_dtype and nothing else follows, else the
// product in fp32 through the epilogue kernel (bias_as_bf16: an fp32 bias read
// rounded to bf16), on `stream`, the current stream of `device` (torch's current
// device, both passed by the caller). The same bits as the Python path
// (kernels/cuda/gemm.py's _tensorwise) it stands in for; None for every case that
// path must look at itself (a tensor elsewhere than `device`, not contiguous or not
// 16-byte aligned, a dtype or shape it converts or refuses, swiglu), before
// anything is allocated or launched. `a_shape` (optional): the shape (..., K) of the
// tensor whose 2-D flattening a is; the result then comes in its dims, (..., N),
// and the residual may come in them too (a reshape on either side is a dispatch of
// its own on the host).
std::optional<at::Tensor> fp8_gemm_lean(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                        const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                                        const std::optional<at::Tensor>& residual, at::ScalarType out_dtype,
                                        bool fast_accum, int64_t activation, bool bias_as_bf16,
                                        int64_t device, int64_t stream,
                                        const std::optional<std::vector<int64_t>>& a_shape) {
  if (a.dim() != 2 || b.dim() != 2) return std::nullopt;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  if (a_shape) {  // (..., K) holding m rows (an owning vector: pybind's optional of a view would dangle)
    const std::vector<int64_t>& shape = *a_shape;
    if (shape.empty() || shape.back() != k || c10::multiply_integers(shape.begin(), shape.end() - 1) != m) {
      return std::nullopt;
    }
  }
  const at::ScalarType a_type = a.scalar_type(), b_type = b.scalar_type();
  if (b.size(1) != k || k % 16 || n % 16 || !is_fp8(a_type) || !is_fp8(b_type) ||
      (a_type == at::kFloat8_e5m2 && b_type == at::kFloat8_e5m2)) {
    return std::nullopt;
  }
  const int out_code = hp_code_or_none(out_dtype);
  // the activations that keep the width (swiglu halves it)
  if (out_code < 0 || activation < kActNone || activation > kActSilu || !ready(a, device) || !ready(b, device)) {
    return std::nullopt;
  }
  for (const at::Tensor* s : {&scale_a, &scale_b}) {
    if (s->scalar_type() != at::kFloat || s->numel() != 1 || !ready(*s, device)) return std::nullopt;
  }
  int residual_code = 0, bias_code = 0;
  if (residual) {
    const at::Tensor& r = *residual;
    residual_code = hp_code_or_none(r.scalar_type());
    // (M, N), or contiguous in the output's dims (..., N): the same elements in the same order
    if (r.dim() < 2 || r.size(-1) != n || r.numel() != m * n || (r.dim() != 2 && !a_shape) || residual_code < 0 ||
        !ready(r, device)) {
      return std::nullopt;
    }
  }
  if (bias) {
    const at::Tensor& v = *bias;
    bias_code = hp_code_or_none(v.scalar_type());
    if (v.dim() != 1 || v.size(0) != n || bias_code < 0 || !ready(v, device)) return std::nullopt;
  }
  const bool fused = activation != 0 || residual.has_value();
  if (bias_as_bf16 && !(fused && bias && bias->scalar_type() == at::kFloat)) return std::nullopt;
  const bool in_gemm = bias && !fused && out_dtype != at::kFloat && bias->scalar_type() == out_dtype;
  const bool epilogue = fused || (bias && !in_gemm);
  at::Tensor y = std::get<0>(run_gemm(a, b, scale_a, scale_b, in_gemm ? bias : std::nullopt,
                                      epilogue ? at::kFloat : out_dtype, fast_accum, 0, stream));
  at::Tensor out = y;
  if (epilogue) {
    out = out_dtype == at::kFloat ? y : at::empty({m, n}, y.options().dtype(out_dtype));  // fp32: in place
    launch_epilogue(y.data_ptr(), 0, bias ? bias->data_ptr() : nullptr,
                    bias ? (bias_as_bf16 ? kBiasFp32AsBf16 : bias_code) : 0,
                    residual ? residual->data_ptr() : nullptr, residual_code, out.data_ptr(), out_code, m, n,
                    static_cast<int>(activation), reinterpret_cast<void*>(static_cast<intptr_t>(stream)));
  }
  if (a_shape && a_shape->size() != 2) {  // a new tensor only this call holds: its sizes set in place, no view
    std::vector<int64_t> sizes = *a_shape;
    sizes.back() = n;
    out.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  }
  return out;
}

// The same GEMM with the heuristic's candidate-th algorithm, and that algorithm's
// workspace bytes: for comparing the candidates (benchmarks/count_launches.py); an
// error names how many the heuristic has when there is no such candidate.
std::tuple<at::Tensor, int64_t> fp8_gemm_tensorwise_candidate(const at::Tensor& a, const at::Tensor& b,
                                                              const at::Tensor& scale_a, const at::Tensor& scale_b,
                                                              at::ScalarType out_dtype, bool fast_accum,
                                                              int64_t candidate, int64_t stream) {
  TORCH_CHECK(candidate >= 0 && candidate < 64, "te_fuser cuBLASLt FP8 GEMM: candidate must be in [0, 64), got ",
              candidate);
  return run_gemm(a, b, scale_a, scale_b, std::nullopt, out_dtype, fast_accum, static_cast<int>(candidate), stream);
}

// The most workspace the algorithm of a GEMM planned from now on may ask for, in
// bytes (0 to the 32 MiB the workspace holds; at start 32 MiB); returns the limit
// before. 0 keeps to algorithms that ask none (measured: the GPT's fprop and dgrad
// GEMMs keep their one memset a call either way, so it is not a workspace clear).
int64_t fp8_gemm_set_workspace_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= static_cast<int64_t>(kWorkspaceBytes),
              "te_fuser cuBLASLt FP8 GEMM: the workspace limit must be in [0, ", kWorkspaceBytes, "] bytes, got ",
              bytes);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const int64_t before = c.workspace_limit;
  c.workspace_limit = bytes;
  return before;
}

// How many problems have a kept descriptor and algorithm (for tests and reports).
int64_t fp8_gemm_plans() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return static_cast<int64_t>(c.plans.size());
}

}  // namespace te_fuser
