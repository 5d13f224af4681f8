// The CUDA backend's DoRA row ops (row_norms, dora_weight, dora_backward), QLoRA's NF4
// dequantization and the integer-weight ops of quantized checkpoints (int_linear,
// int_dequantize): operand checks with the CPU backend's messages (cpu/cpu_quant_ops.cpp,
// cpu/cpu_int_linear.cpp), then the kernels of cuda_weights.cu on the backend's stream.
// - DoRA: each row's sum in double, in column order (the contract's order), so the results are
//   bitwise the CPU's; dora_backward is one pass (dot product and in-place gradient scaling).
// - nf4_dequantize: elementwise from the packed codes; f32 or bf16 (rounded to nearest even).
// - int_dequantize: s (q - z) (times the input scale), bitwise the CPU's.
// - int_linear: a tiled decode GEMM that dequantizes the codes in registers and accumulates in
//   f32 (weight-only) or quantizes each input row to int8 and sums exactly in int32 (W8A8, whose
//   per-row scales go to workspace()).
// - bf16_weight_linear: up to 16 input rows (decoding) a warp-per-row kernel reading the bf16
//   weight once; more rows the default (the weight widened by cast, then cuBLASLt's f32 GEMM).
// No op reads a host value or synchronizes.
#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_weights.h"

namespace loom::cuda_backend_detail {

bool dora_ops_complete() { return true; }
bool nf4_ops_complete() { return true; }
bool int_weight_ops_complete() { return true; }

namespace {

using checks::expect_dtype;
constexpr int64_t kBf16DirectRows = 16;  // bf16_weight_linear's own kernel up to here
using checks::expect_numel;

// DoRA's operands: a (rows, cols) f32 matrix and per-row f32 vectors (cpu_quant_ops.cpp's dora_rows).
int64_t dora_rows(const char* op, const Tensor& m, std::initializer_list<const Tensor*> vectors) {
  expect_dtype(m, DTYPE_F32, op, "matrix");
  LOOM_CHECK(m.ndim() == 2, op, ": expected a (rows, cols) matrix, got ", m.describe());
  for (const Tensor* v : vectors) {
    expect_dtype(*v, DTYPE_F32, op, "vector");
    expect_numel(*v, m.dim(0), op, "vector");
  }
  return m.dim(0);
}

int64_t row_bytes(int bits, int64_t cols) { return bits == 8 ? cols : (bits == 4 ? cols / 2 : cols / 8 * 3); }

// The packed weight's operands, with cpu_int_linear.cpp's checks and messages.
void check_int_weight(const char* op, const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros,
                      const IntWeightSpec& s, const Tensor* input_scale) {
  LOOM_CHECK(s.bits == 8 || s.bits == 4 || s.bits == 3, op, ": ", s.bits, " bits, expected 8, 4 or 3");
  LOOM_CHECK(s.group > 0 && s.cols > 0 && s.cols % 32 == 0 && s.group % 32 == 0 && s.cols % s.group == 0 &&
                 (!s.act_int8 || (s.bits == 8 && s.group == s.cols)),
             op, ": group ", s.group, " and ", s.cols, " columns do not fit the packed format");
  LOOM_CHECK(s.rows >= 0 && codes.dtype() == DTYPE_U8 && codes.numel() == s.rows * row_bytes(s.bits, s.cols), op,
             ": codes ", codes.describe(), " for (", s.rows, ", ", s.cols, ") at ", s.bits, " bits");
  LOOM_CHECK((scales.dtype() == DTYPE_F32 || scales.dtype() == DTYPE_F16) && scales.numel() == s.rows * (s.cols / s.group) &&
                 (!zeros.defined() || (zeros.dtype() == DTYPE_U8 && zeros.numel() == scales.numel())),
             op, ": scales ", scales.describe(), " / zeros ", zeros.defined() ? zeros.describe() : "(none)", " for (",
             s.rows, ", ", s.cols / s.group, ") groups");
  LOOM_CHECK(!x.defined() || (x.dtype() == DTYPE_F32 && x.numel() % s.cols == 0), op, ": x ", x.describe(), " for ",
             s.cols, " columns");
  LOOM_CHECK(input_scale == nullptr || (input_scale->dtype() == DTYPE_F32 && input_scale->numel() == s.cols), op,
             ": input scale for ", s.cols, " columns");
}

// The kernels' view of the group parameters: f32 or f16 scales, zeros or none (symmetric).
cuda::IntGroups int_groups(const Tensor& scales, const Tensor& zeros) {
  return {scales.device_ptr(), scales.dtype() == DTYPE_F16,
          zeros.defined() ? static_cast<const uint8_t*>(zeros.device_ptr()) : nullptr};
}

}  // namespace

void CudaBackend::row_norms(const Tensor& x, const Tensor& norms) {
  const int64_t rows = dora_rows("row_norms", x, {&norms}), cols = x.dim(1);
  cuda::row_norms(dptr<float>(x), dptr<float>(norms), rows, cols, stream());
}

void CudaBackend::dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms,
                              const Tensor& out) {
  const int64_t rows = dora_rows("dora_weight", merged, {&magnitude, &norms}), cols = merged.dim(1);
  expect_dtype(out, DTYPE_F32, "dora_weight", "out");
  expect_numel(out, merged.numel(), "dora_weight", "out");
  if (base.defined()) {
    expect_dtype(base, DTYPE_F32, "dora_weight", "base");
    expect_numel(base, merged.numel(), "dora_weight", "base");
  }
  cuda::dora_weight(dptr<float>(merged), dptr_or_null<float>(base), dptr<float>(magnitude),
                    dptr<float>(norms), dptr<float>(out), rows, cols, stream());
}

void CudaBackend::dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms,
                                const Tensor& dmagnitude) {
  const int64_t rows = dora_rows("dora_backward", merged, {&magnitude, &norms, &dmagnitude}), cols = merged.dim(1);
  expect_dtype(grad, DTYPE_F32, "dora_backward", "grad");
  expect_numel(grad, merged.numel(), "dora_backward", "grad");
  cuda::dora_backward(dptr<float>(grad), dptr<float>(merged), dptr<float>(magnitude), dptr<float>(norms),
                      dptr<float>(dmagnitude), rows, cols, stream());
}

void CudaBackend::nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps,
                                 const Nf4Spec& spec, int64_t first, const Tensor& out) {
  const char* op = "nf4_dequantize";
  expect_dtype(codes, DTYPE_U8, op, "codes");
  expect_dtype(absmax_codes, DTYPE_U8, op, "absmax_codes");
  expect_dtype(absmax_steps, DTYPE_F32, op, "absmax_steps");
  LOOM_CHECK(out.dtype() == DTYPE_F32 || out.dtype() == DTYPE_BF16, op, ": out is ", out.describe(),
             ", expected f32 or bf16");
  const int64_t n = out.numel(), end = first + n;
  const int64_t blocks = (end + kNf4Block - 1) / kNf4Block;
  LOOM_CHECK(first >= 0 && codes.numel() >= (end + 1) / 2 && absmax_codes.numel() >= blocks &&
                 absmax_steps.numel() >= (blocks + kNf4ScaleBlock - 1) / kNf4ScaleBlock,
             op, ": elements [", first, ", ", end, ") need ", (end + 1) / 2, " code bytes, ", blocks, " absmax codes and ",
             (blocks + kNf4ScaleBlock - 1) / kNf4ScaleBlock, " steps; got ", codes.describe(), ", ",
             absmax_codes.describe(), ", ", absmax_steps.describe());
  cuda::nf4_dequantize(dptr<uint8_t>(codes), dptr<uint8_t>(absmax_codes), dptr<float>(absmax_steps),
                       spec.values.data(), spec.absmax_mean, first, n, out.device_ptr(), out.dtype() == DTYPE_BF16,
                       stream());
}

void CudaBackend::int_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros,
                             const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& y, float beta,
                             const Tensor* bias) {
  check_int_weight("int_linear", x, codes, scales, zeros, spec, input_scale);
  LOOM_CHECK(x.defined(), "int_linear: x is undefined");
  const int64_t K = spec.cols, O = spec.rows, N = x.numel() / K;
  LOOM_CHECK(y.dtype() == DTYPE_F32 && y.numel() == N * O, "int_linear: y ", y.describe(), " for (", N, ", ", O, ")");
  LOOM_CHECK(bias == nullptr || (bias->dtype() == DTYPE_F32 && bias->numel() == O), "int_linear: bias for ", O, " rows");
  void* scratch = spec.act_int8 ? workspace(cuda::int_linear_scratch_bytes(N, true)) : nullptr;
  cuda::int_linear(dptr<float>(x), dptr<uint8_t>(codes), int_groups(scales, zeros), spec.bits, spec.group, O, K,
                   spec.act_int8, input_scale != nullptr ? dptr<float>(*input_scale) : nullptr,
                   dptr<float>(y), N, beta, bias != nullptr ? dptr<float>(*bias) : nullptr, scratch, stream());
}

void CudaBackend::bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) {
  const int64_t n = checks::check_bf16_weight_linear(x, w, y, bias);
  if (n > kBf16DirectRows) {
    Backend::bf16_weight_linear(x, w, y, beta, bias);
    return;
  }
  cuda::bf16_weight_linear(dptr<float>(x), static_cast<const uint16_t*>(w.device_ptr()), w.dim(0), w.dim(1),
                           dptr<float>(y), n, beta, bias != nullptr ? dptr<float>(*bias) : nullptr, stream());
}

void CudaBackend::int_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& zeros,
                                 const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& out) {
  check_int_weight("int_dequantize", Tensor{}, codes, scales, zeros, spec, input_scale);
  LOOM_CHECK(out.dtype() == DTYPE_F32 && out.numel() == spec.rows * spec.cols, "int_dequantize: out ", out.describe(),
             " for (", spec.rows, ", ", spec.cols, ")");
  cuda::int_dequantize(dptr<uint8_t>(codes), int_groups(scales, zeros), spec.bits, spec.group, spec.rows, spec.cols, input_scale != nullptr ? dptr<float>(*input_scale) : nullptr,
                       dptr<float>(out), stream());
}

}  // namespace loom::cuda_backend_detail
