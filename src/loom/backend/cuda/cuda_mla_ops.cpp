// The CUDA backend's multi-head latent attention (cuda_mla.cu).
// STUB: each op still forwards to Backend's default, which throws one line naming the op.
#include "loom/backend/cuda/cuda_backend_internal.h"

namespace loom::cuda_backend_detail {

bool mla_ops_complete() { return false; }

void CudaBackend::mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim, const RopeSpec& rope, int64_t pos_offset, bool inverse) { Backend::mla_rope(x, heads, stride, offset, rope_dim, rope, pos_offset, inverse); }
void CudaBackend::mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs, const Tensor& out, const MlaDims& dims) { Backend::mla_attention_forward(q, kr, kv, probs, out, dims); }
void CudaBackend::mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs, const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr, const Tensor& dp_row, const MlaDims& dims) { Backend::mla_attention_backward(q, kr, kv, probs, dout, dq, dkv, dkr, dp_row, dims); }
void CudaBackend::mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out, const MlaDims& dims) { Backend::mla_attend_latents(q, latents, kv_b, out, dims); }

}  // namespace loom::cuda_backend_detail
