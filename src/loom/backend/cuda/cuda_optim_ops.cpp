// The CUDA backend's elementwise optimizers, Muon's steps and the soft-target loss (cuda_optim.cu).
// STUB: each op still forwards to Backend's default, which throws one line naming the op.
#include "loom/backend/cuda/cuda_backend_internal.h"

namespace loom::cuda_backend_detail {

bool optim_ops_complete() { return false; }

void CudaBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, const OptimHyper& hyper) { Backend::sgd_step(param, grad, buf, hyper); }
void CudaBackend::adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum, const OptimHyper& hyper) { Backend::adagrad_step(param, grad, sum, hyper); }
void CudaBackend::rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg, const Tensor& buf, const OptimHyper& hyper) { Backend::rmsprop_step(param, grad, square, avg, buf, hyper); }
void CudaBackend::adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& vmax, const OptimHyper& hyper) { Backend::adam_step(param, grad, m, v, vmax, hyper); }
void CudaBackend::lion_step(const Tensor& param, const Tensor& grad, const Tensor& m, const OptimHyper& hyper) { Backend::lion_step(param, grad, m, hyper); }
void CudaBackend::adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const OptimHyper& hyper) { Backend::adam_mini_step(param, grad, m, v, hyper); }
void CudaBackend::scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose) { Backend::scale_transpose(src, dst, scale, transpose); }
void CudaBackend::axpy(const Tensor& y, const Tensor& x, float alpha) { Backend::axpy(y, x, alpha); }
void CudaBackend::soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale, const Tensor& losses, const Tensor& grad) { Backend::soft_target_loss(logits, teacher, temperature, grad_scale, losses, grad); }
void CudaBackend::muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u, const OptimHyper& hyper) { Backend::muon_momentum(grad, buf, u, hyper); }
void CudaBackend::newton_schulz_normalize(const Tensor& u, const Tensor& x) { Backend::newton_schulz_normalize(u, x); }
void CudaBackend::decayed_update(const Tensor& param, const Tensor& u, float decay, float step) { Backend::decayed_update(param, u, decay, step); }

}  // namespace loom::cuda_backend_detail
