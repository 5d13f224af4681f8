// The CUDA backend's elementwise optimizers (SGD, Adagrad, RMSprop, Adam/AdamW/AMSGrad, Lion,
// Adam-mini), Muon's steps (momentum, the Newton-Schulz start, the decayed update, scale_transpose
// and axpy) and the soft-target loss: the host side. Each op validates its operands with the checks
// it shares with the CPU backend (optim_checks.h: the same one-line errors), computes
// the CPU kernel's scalar constants in the same precision and order (so the device applies the
// same float arithmetic per element), then enqueues the kernels of cuda_optim.cu on stream().
// No op synchronizes or copies to the host: newton_schulz_normalize keeps 1 / ||u|| in device
// memory (workspace(), with the partial sums of its norm) and the scaling kernel reads it there.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_optim.h"
#include "loom/backend/optim_checks.h"

namespace loom::cuda_backend_detail {

bool optim_ops_complete() { return true; }

namespace {

using checks::rows_of;

float* f32(const Tensor& t) { return dptr<float>(t); }

}  // namespace

void CudaBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, const OptimHyper& h) {
  const int64_t n = checks::check_sgd_step(param, grad, buf);
  const float mu = static_cast<float>(h.momentum), damp = static_cast<float>(h.dampening);
  cuda::sgd_step(f32(param), f32(grad), dptr_or_null<float>(buf), n, static_cast<float>(h.lr), h.weight_decay, h.grad_scale, mu, damp,
                 h.nesterov, h.step == 1, stream());
}

void CudaBackend::adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum, const OptimHyper& h) {
  const int64_t n = checks::check_adagrad_step(param, grad, sum);
  cuda::adagrad_step(f32(param), f32(grad), f32(sum), n, static_cast<float>(h.lr), h.weight_decay, h.grad_scale,
                     static_cast<float>(h.eps), stream());
}

void CudaBackend::rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg,
                               const Tensor& buf, const OptimHyper& h) {
  const int64_t n = checks::check_rmsprop_step(param, grad, square, avg, buf);
  cuda::rmsprop_step(f32(param), f32(grad), f32(square), dptr_or_null<float>(avg), dptr_or_null<float>(buf), n, static_cast<float>(h.lr),
                     h.weight_decay, h.grad_scale, static_cast<float>(h.beta2), static_cast<float>(h.eps),
                     static_cast<float>(h.momentum), stream());
}

void CudaBackend::adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                            const Tensor& vmax, const OptimHyper& h) {
  const int64_t n = checks::check_adam_step(param, grad, m, v, vmax);
  const float eta = static_cast<float>(h.lr);
  const float bias1 = static_cast<float>(1.0 - std::pow(h.beta1, static_cast<double>(h.step)));
  const float bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, static_cast<double>(h.step))));
  const float step_size = eta / bias1;
  const float l2 = h.decoupled ? 0.0f : h.weight_decay, decay = h.decoupled ? 1.0f - eta * h.weight_decay : 1.0f;
  cuda::adam_step(f32(param), f32(grad), f32(m), f32(v), dptr_or_null<float>(vmax), n, step_size, l2, decay, h.grad_scale,
                  static_cast<float>(h.beta1), static_cast<float>(h.beta2), static_cast<float>(h.eps), bias2_sqrt,
                  stream());
}

void CudaBackend::lion_step(const Tensor& param, const Tensor& grad, const Tensor& m, const OptimHyper& h) {
  const int64_t n = checks::check_lion_step(param, grad, m);
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  cuda::lion_step(f32(param), f32(grad), f32(m), n, eta, decay, h.grad_scale, static_cast<float>(h.beta1),
                  static_cast<float>(h.beta2), stream());
}

void CudaBackend::adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                                 const OptimHyper& h) {
  const auto [n, nblocks, bn] = checks::check_adam_mini_step(param, grad, m, v);
  const float bias1 = static_cast<float>(1.0 - std::pow(h.beta1, static_cast<double>(h.step)));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  cuda::adam_mini_step(f32(param), f32(grad), f32(m), f32(v), nblocks, bn, eta, decay, h.grad_scale,
                       static_cast<float>(h.beta1), static_cast<float>(h.eps), bias1, h.beta2, bias2, stream());
}

void CudaBackend::scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose) {
  const auto [rows, cols] = checks::check_scale_transpose(src, dst);
  if (src.numel() == 0) return;
  cuda::scale_transpose(f32(src), f32(dst), rows, cols, scale, nullptr, transpose, stream());
}

void CudaBackend::axpy(const Tensor& y, const Tensor& x, float alpha) {
  const int64_t n = checks::check_axpy(y, x);
  cuda::axpy(f32(y), f32(x), n, alpha, stream());
}

void CudaBackend::soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale,
                                   const Tensor& losses, const Tensor& grad) {
  const auto [N, V] = checks::check_soft_target_loss(logits, teacher, temperature, losses, grad);
  cuda::soft_target_loss(f32(logits), f32(teacher), f32(losses), f32(grad), N, V, static_cast<double>(temperature),
                         grad_scale, stream());
}

void CudaBackend::muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u, const OptimHyper& h) {
  const int64_t n = checks::check_muon_momentum(grad, buf, u);
  cuda::muon_momentum(f32(grad), f32(buf), f32(u), n, static_cast<float>(h.momentum), h.grad_scale, h.nesterov,
                      stream());
}

void CudaBackend::newton_schulz_normalize(const Tensor& u, const Tensor& x) {
  if (checks::check_newton_schulz_normalize(u, x) == 0) return;
  // The scratch: 1 / ||u|| (read by the scaling kernel), then the partial sums and a flag.
  float* inv = static_cast<float*>(workspace(16 + cuda::inverse_norm_scratch_bytes()));
  cuda::inverse_norm(f32(u), u.numel(), inv, inv + 4, stream());
  const int64_t rows = rows_of(u), cols = u.dim(-1);
  cuda::scale_transpose(f32(u), f32(x), rows, cols, 1.0f, inv, rows > cols, stream());
}

void CudaBackend::decayed_update(const Tensor& param, const Tensor& u, float decay, float step) {
  const int64_t n = checks::check_decayed_update(param, u);
  cuda::decayed_update(f32(param), f32(u), n, decay, step, stream());
}

}  // namespace loom::cuda_backend_detail
