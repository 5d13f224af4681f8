// The CUDA backend's low-precision quantizers, rounding, dropout and bf16 attention (cuda_quant.cu).
// STUB: each op still forwards to Backend's default, which throws one line naming the op.
#include "loom/backend/cuda/cuda_backend_internal.h"

namespace loom::cuda_backend_detail {

bool quant_ops_complete() { return false; }
bool bf16_attention_ops_complete() { return false; }

float CudaBackend::amax(const Tensor& x) { return Backend::amax(x); }
void CudaBackend::fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post) { Backend::fake_quant(x, out, grid, scale, post); }
void CudaBackend::quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale) { Backend::quant_codes_bf16(x, out, grid, scale); }
void CudaBackend::fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows, int64_t block_cols) { Backend::fake_quant_blocks(x, out, grid, block_rows, block_cols); }
void CudaBackend::fake_quant_mxfp4(const Tensor& x, const Tensor& out) { Backend::fake_quant_mxfp4(x, out); }
void CudaBackend::fake_quant_nvfp4(const Tensor& x, const Tensor& out) { Backend::fake_quant_nvfp4(x, out); }
void CudaBackend::round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw) { Backend::round_bf16(x, stochastic, draw); }
void CudaBackend::dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw) { Backend::dropout(x, out, p, draw); }
void CudaBackend::attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head, int64_t n_kv_head) { Backend::attention_forward_bf16(qkv, out, probs, n_head, n_kv_head); }
void CudaBackend::attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs, const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) { Backend::attention_backward_bf16(dout, qkv, out, probs, dqkv, n_head, n_kv_head); }

}  // namespace loom::cuda_backend_detail
