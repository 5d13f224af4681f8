// The CUDA backend's Adafactor, SM3, CAME and LDAdam (cuda_optim_factored.cu).
// STUB: each op still forwards to Backend's default, which throws one line naming the op.
#include "loom/backend/cuda/cuda_backend_internal.h"

namespace loom::cuda_backend_detail {

bool optim_factored_ops_complete() { return false; }

void CudaBackend::adafactor_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m, const Tensor& u, const OptimHyper& hyper) { Backend::adafactor_step(param, grad, state, m, u, hyper); }
void CudaBackend::sm3_step(const Tensor& param, const Tensor& grad, const Tensor& acc, const OptimHyper& hyper) { Backend::sm3_step(param, grad, acc, hyper); }
void CudaBackend::came_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m, const Tensor& res, const Tensor& u, const OptimHyper& hyper) { Backend::came_step(param, grad, state, m, res, u, hyper); }
void CudaBackend::leading_eigenvectors(const Tensor& s, const Tensor& p) { Backend::leading_eigenvectors(s, p); }
void CudaBackend::gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p) { Backend::gram_schmidt(y, fallback, p); }
void CudaBackend::ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const OptimHyper& hyper) { Backend::ldadam_rotate(p, prev, m, v, mt, vt, hyper); }
void CudaBackend::ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh, const OptimHyper& hyper) { Backend::ldadam_adam(m, v, mt, vt, gh, hyper); }
void CudaBackend::ldadam_apply(const Tensor& param, const Tensor& grad, const Tensor& d, const Tensor& e, bool transpose, const OptimHyper& hyper) { Backend::ldadam_apply(param, grad, d, e, transpose, hyper); }

}  // namespace loom::cuda_backend_detail
