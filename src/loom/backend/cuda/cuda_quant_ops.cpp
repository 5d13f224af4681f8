// The CUDA backend's low-precision ops (backend.h; kernels in cuda_quant.cu): amax, the fake
// quantizers of the fp16 / fp8 recipes and QAT (fake_quant, quant_codes_bf16, the DeepSeek-V3 block
// scaling, MXFP4, NVFP4), bf16 rounding (nearest and stochastic, a device Philox4x32-10), dropout
// (Philox mask), and the bf16 attention (bf16 copies of the operands through cuBLAS
// GemmStridedBatchedEx with fp32 accumulation, f32 softmax and dS kernels). Each op validates its
// operands with the CPU backend's checks and messages, then enqueues its kernels on stream().
// Every op but the attention is bitwise the CPU backend's (tests/test_backend_quant_ops.cpp,
// tests/test_backend_bf16_ops.cpp).
//
// Host synchronization: only amax, which returns a host float: one 4-byte read of the device
// result. fake_quant_nvfp4 needs the tensor's amax too, but its kernel reads it from device memory.
// Scratch: workspace() (amax's word; the bf16 attention's copies, in chunks of sequences so that
// it stays under ~256 MB whatever the batch).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_quant.h"

namespace loom::cuda_backend_detail {

bool quant_ops_complete() { return true; }
bool bf16_attention_ops_complete() { return true; }

namespace {

using checks::expect_dtype;
using checks::expect_numel;

// x f32; out (when given) of x's numel in `out_dtype` (the CPU's check_quant).
void check_quant(const char* op, const Tensor& x, const Tensor* out, DType out_dtype = DTYPE_F32) {
  expect_dtype(x, DTYPE_F32, op, "x");
  if (out == nullptr) return;
  expect_dtype(*out, out_dtype, op, "out");
  expect_numel(*out, x.numel(), op, "out");
}

// The (rows, last dim) view of x, for the row-blocked formats.
int64_t cols_of(const Tensor& x) { return x.ndim() == 0 ? 1 : x.dim(-1); }
int64_t rows_for(const Tensor& x) {
  const int64_t cols = cols_of(x);
  return cols == 0 ? 0 : x.numel() / cols;
}

cuda::QuantGrid quant_grid(const NumberGrid& g) { return {g.man_bits, g.emin, g.max, g.overflow}; }

cuda::PhiloxDraw philox_draw(const RoundingDraw& d) {
  return {static_cast<uint32_t>(d.seed), static_cast<uint32_t>(d.seed >> 32), d.stream, d.draw};
}

}  // namespace

float CudaBackend::amax(const Tensor& x) {
  check_quant("amax", x, nullptr);
  auto* result = static_cast<uint32_t*>(workspace(sizeof(uint32_t)));
  cuda::amax_bits(dptr<float>(x), x.numel(), result, stream());
  uint32_t bits = 0;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&bits, result, sizeof(bits), cudaMemcpyDeviceToHost, stream()));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream()));
  if (bits > 0x7F800000u) return NAN;  // a NaN anywhere (the CPU returns NAN itself)
  float m = 0.0f;
  std::memcpy(&m, &bits, sizeof(m));
  return m;
}

void CudaBackend::fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post) {
  check_quant("fake_quant", x, &out);
  cuda::fake_quant(dptr<float>(x), dptr<float>(out), x.numel(), quant_grid(grid), scale, post, stream());
}

void CudaBackend::quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale) {
  check_quant("quant_codes_bf16", x, &out, DTYPE_BF16);
  LOOM_CHECK(grid.man_bits <= 7, "quant_codes_bf16: a grid of ", grid.man_bits, " mantissa bits is not bf16 values");
  cuda::quant_codes_bf16(dptr<float>(x), dptr<uint16_t>(out), x.numel(), quant_grid(grid), scale, stream());
}

void CudaBackend::fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows,
                                    int64_t block_cols) {
  check_quant("fake_quant_blocks", x, &out);
  LOOM_CHECK(block_rows > 0 && block_cols > 0, "fake_quant_blocks: block ", block_rows, "x", block_cols);
  cuda::fake_quant_blocks(dptr<float>(x), dptr<float>(out), rows_for(x), cols_of(x), block_rows, block_cols,
                          quant_grid(grid), stream());
}

void CudaBackend::fake_quant_mxfp4(const Tensor& x, const Tensor& out) {
  check_quant("fake_quant_mxfp4", x, &out);
  cuda::fake_quant_mxfp4(dptr<float>(x), dptr<float>(out), rows_for(x), cols_of(x), stream());
}

void CudaBackend::fake_quant_nvfp4(const Tensor& x, const Tensor& out) {
  check_quant("fake_quant_nvfp4", x, &out);
  cuda::fake_quant_nvfp4(dptr<float>(x), dptr<float>(out), rows_for(x), cols_of(x), workspace(sizeof(uint32_t)),
                         stream());
}

void CudaBackend::round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw) {
  check_quant("round_bf16", x, nullptr);
  cuda::round_bf16(dptr<float>(x), x.numel(), stochastic, philox_draw(draw), stream());
}

void CudaBackend::dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw) {
  check_quant("dropout", x, &out);
  LOOM_CHECK(p >= 0.0f && p < 1.0f, "dropout: p = ", p, ", expected [0, 1)");
  const auto threshold = static_cast<uint64_t>(static_cast<double>(p) * 4294967296.0);  // as the CPU
  const float keep = 1.0f / (1.0f - p);
  cuda::dropout(dptr<float>(x), dptr<float>(out), x.numel(), threshold, keep, philox_draw(draw), stream());
}

void CudaBackend::attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                                         int64_t n_kv_head) {
  const char* op = "attention_forward_bf16";
  const auto [batch, seq_len, head_dim] = checks::check_attention(op, qkv, out, probs, n_head, n_kv_head, 0, false);
  expect_dtype(qkv, DTYPE_F32, op, "qkv");
  void* scratch = workspace(cuda::attention_bf16_forward_scratch_bytes(batch, seq_len, n_head, n_kv_head, head_dim));
  cuda::attention_forward_bf16(cublas(), dptr<float>(qkv), dptr<float>(out), dptr<float>(probs), scratch, batch,
                               seq_len, n_head, n_kv_head, head_dim, stream());
}

void CudaBackend::attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                                          const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) {
  const char* op = "attention_backward_bf16";
  const auto [batch, seq_len, head_dim] =
      checks::check_attention_backward(op, dout, qkv, out, probs, dqkv, n_head, n_kv_head, 0, false);
  expect_dtype(qkv, DTYPE_F32, op, "qkv");
  void* scratch = workspace(cuda::attention_bf16_backward_scratch_bytes(batch, seq_len, n_head, n_kv_head, head_dim));
  cuda::attention_backward_bf16(cublas(), dptr<float>(dout), dptr<float>(qkv), dptr<float>(out), dptr<float>(probs),
                                dptr<float>(dqkv), scratch, batch, seq_len, n_head, n_kv_head, head_dim, stream());
}

}  // namespace loom::cuda_backend_detail
