// The CUDA backend's DoRA's row ops, NF4 and the integer-weight kernels (cuda_weights.cu).
// STUB: each op still forwards to Backend's default, which throws one line naming the op.
#include "loom/backend/cuda/cuda_backend_internal.h"

namespace loom::cuda_backend_detail {

bool dora_ops_complete() { return false; }
bool nf4_ops_complete() { return false; }
bool int_weight_ops_complete() { return false; }

void CudaBackend::row_norms(const Tensor& x, const Tensor& norms) { Backend::row_norms(x, norms); }
void CudaBackend::dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms, const Tensor& out) { Backend::dora_weight(merged, base, magnitude, norms, out); }
void CudaBackend::dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms, const Tensor& dmagnitude) { Backend::dora_backward(grad, merged, magnitude, norms, dmagnitude); }
void CudaBackend::nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps, const Nf4Spec& spec, int64_t first, const Tensor& out) { Backend::nf4_dequantize(codes, absmax_codes, absmax_steps, spec, first, out); }
void CudaBackend::int_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& y, float beta, const Tensor* bias) { Backend::int_linear(x, codes, scales, zeros, spec, input_scale, y, beta, bias); }
void CudaBackend::int_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& out) { Backend::int_dequantize(codes, scales, zeros, spec, input_scale, out); }

}  // namespace loom::cuda_backend_detail
