// The CUDA backend's gradient compression (cuda_compress.cu).
// STUB: each op still forwards to Backend's default, which throws one line naming the op.
#include "loom/backend/cuda/cuda_backend_internal.h"

namespace loom::cuda_backend_detail {

bool compress_ops_complete() { return false; }

void CudaBackend::topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) { Backend::topk_extract(acc, idx, val, scratch); }
void CudaBackend::scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out) { Backend::scatter_add(idx, val, out); }
void CudaBackend::scatter_zero(const Tensor& idx, const Tensor& x) { Backend::scatter_zero(idx, x); }
void CudaBackend::dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip) { Backend::dgc_accumulate(g, u, v, momentum, clip); }
void CudaBackend::onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) { Backend::onebit_encode(acc, words, scale); }
void CudaBackend::onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) { Backend::onebit_decode_add(words, scales, out); }
void CudaBackend::qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) { Backend::qsgd_encode(g, codes, norm, spec); }
void CudaBackend::qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out) { Backend::qsgd_decode_add(codes, norms, levels, out); }
void CudaBackend::lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) { Backend::lowrank_project(m, q, out, transpose); }
void CudaBackend::orthonormalize_columns(const Tensor& p) { Backend::orthonormalize_columns(p); }
void CudaBackend::lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta) { Backend::lowrank_expand(p, q, out, alpha, beta); }

}  // namespace loom::cuda_backend_detail
