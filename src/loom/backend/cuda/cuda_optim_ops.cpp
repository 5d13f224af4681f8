// The CUDA backend's elementwise optimizers (SGD, Adagrad, RMSprop, Adam/AdamW/AMSGrad, Lion,
// Adam-mini), Muon's steps (momentum, the Newton-Schulz start, the decayed update, scale_transpose
// and axpy) and the soft-target loss: the host side. Each op validates its operands as the CPU
// backend does (cpu/cpu_optim_ops.cpp, cpu_soft_target.cpp: the same one-line errors), computes
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

namespace loom::cuda_backend_detail {

bool optim_ops_complete() { return true; }

namespace {

using checks::expect_dtype;
using checks::expect_numel;
using checks::rows_of;
using Named = std::initializer_list<std::pair<const char*, const Tensor*>>;

// x is f32; each of `same` is f32 with x's numel, or undefined (an optional state operand).
int64_t check_flat(const char* op, const Tensor& x, const char* what, Named same) {
  expect_dtype(x, DTYPE_F32, op, what);
  for (const auto& [name, t] : same) {
    if (!t->defined()) continue;
    expect_dtype(*t, DTYPE_F32, op, name);
    expect_numel(*t, x.numel(), op, name);
  }
  return x.numel();
}
float* f32(const Tensor& t) { return dptr<float>(t); }
float* opt(const Tensor& t) { return t.defined() ? dptr<float>(t) : nullptr; }

}  // namespace

void CudaBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, const OptimHyper& h) {
  const int64_t n = check_flat("sgd_step", param, "param", {{"grad", &grad}, {"buf", &buf}});
  const float mu = static_cast<float>(h.momentum), damp = static_cast<float>(h.dampening);
  cuda::sgd_step(f32(param), f32(grad), opt(buf), n, static_cast<float>(h.lr), h.weight_decay, h.grad_scale, mu, damp,
                 h.nesterov, h.step == 1, stream());
}

void CudaBackend::adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum, const OptimHyper& h) {
  LOOM_CHECK(sum.defined(), "adagrad_step: needs the sum operand");
  const int64_t n = check_flat("adagrad_step", param, "param", {{"grad", &grad}, {"sum", &sum}});
  cuda::adagrad_step(f32(param), f32(grad), f32(sum), n, static_cast<float>(h.lr), h.weight_decay, h.grad_scale,
                     static_cast<float>(h.eps), stream());
}

void CudaBackend::rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg,
                               const Tensor& buf, const OptimHyper& h) {
  LOOM_CHECK(square.defined(), "rmsprop_step: needs the square operand");
  const int64_t n =
      check_flat("rmsprop_step", param, "param", {{"grad", &grad}, {"square", &square}, {"avg", &avg}, {"buf", &buf}});
  cuda::rmsprop_step(f32(param), f32(grad), f32(square), opt(avg), opt(buf), n, static_cast<float>(h.lr),
                     h.weight_decay, h.grad_scale, static_cast<float>(h.beta2), static_cast<float>(h.eps),
                     static_cast<float>(h.momentum), stream());
}

void CudaBackend::adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                            const Tensor& vmax, const OptimHyper& h) {
  LOOM_CHECK(m.defined() && v.defined(), "adam_step: needs the m and v operands");
  const int64_t n = check_flat("adam_step", param, "param", {{"grad", &grad}, {"m", &m}, {"v", &v}, {"vmax", &vmax}});
  const float eta = static_cast<float>(h.lr);
  const float bias1 = static_cast<float>(1.0 - std::pow(h.beta1, static_cast<double>(h.step)));
  const float bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, static_cast<double>(h.step))));
  const float step_size = eta / bias1;
  const float l2 = h.decoupled ? 0.0f : h.weight_decay, decay = h.decoupled ? 1.0f - eta * h.weight_decay : 1.0f;
  cuda::adam_step(f32(param), f32(grad), f32(m), f32(v), opt(vmax), n, step_size, l2, decay, h.grad_scale,
                  static_cast<float>(h.beta1), static_cast<float>(h.beta2), static_cast<float>(h.eps), bias2_sqrt,
                  stream());
}

void CudaBackend::lion_step(const Tensor& param, const Tensor& grad, const Tensor& m, const OptimHyper& h) {
  LOOM_CHECK(m.defined(), "lion_step: needs the m operand");
  const int64_t n = check_flat("lion_step", param, "param", {{"grad", &grad}, {"m", &m}});
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  cuda::lion_step(f32(param), f32(grad), f32(m), n, eta, decay, h.grad_scale, static_cast<float>(h.beta1),
                  static_cast<float>(h.beta2), stream());
}

void CudaBackend::adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                                 const OptimHyper& h) {
  const char* op = "adam_mini_step";
  LOOM_CHECK(m.defined() && v.defined(), op, ": needs the m and v operands");
  const int64_t n = check_flat(op, param, "param", {{"grad", &grad}, {"m", &m}});
  expect_dtype(v, DTYPE_F32, op, "v");
  const int64_t nblocks = v.numel(), bn = n / std::max<int64_t>(nblocks, 1);
  LOOM_CHECK(nblocks > 0 && bn * nblocks == n, op, ": v ", v.describe(), " does not split ", param.describe(),
             " into whole blocks");
  const float bias1 = static_cast<float>(1.0 - std::pow(h.beta1, static_cast<double>(h.step)));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  cuda::adam_mini_step(f32(param), f32(grad), f32(m), f32(v), nblocks, bn, eta, decay, h.grad_scale,
                       static_cast<float>(h.beta1), static_cast<float>(h.eps), bias1, h.beta2, bias2, stream());
}

void CudaBackend::scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose) {
  expect_dtype(src, DTYPE_F32, "scale_transpose", "src");
  expect_dtype(dst, DTYPE_F32, "scale_transpose", "dst");
  expect_numel(dst, src.numel(), "scale_transpose", "dst");
  if (src.numel() == 0) return;
  cuda::scale_transpose(f32(src), f32(dst), rows_of(src), src.dim(-1), scale, nullptr, transpose, stream());
}

void CudaBackend::axpy(const Tensor& y, const Tensor& x, float alpha) {
  const int64_t n = check_flat("axpy", y, "y", {{"x", &x}});
  cuda::axpy(f32(y), f32(x), n, alpha, stream());
}

void CudaBackend::soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale,
                                   const Tensor& losses, const Tensor& grad) {
  LOOM_CHECK(logits.dtype() == DTYPE_F32 && teacher.dtype() == DTYPE_F32 && grad.dtype() == DTYPE_F32 &&
             losses.dtype() == DTYPE_F32, "soft_target_loss: f32 operands expected");
  LOOM_CHECK(logits.numel() == teacher.numel() && logits.numel() == grad.numel() && logits.numel() > 0,
             "soft_target_loss: logits ", logits.describe(), ", teacher ", teacher.describe(), ", grad ", grad.describe());
  LOOM_CHECK(temperature > 0.0f, "soft_target_loss: temperature ", temperature, " must be > 0");
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  LOOM_CHECK(losses.numel() == N, "soft_target_loss: losses ", losses.describe(), " for ", N, " rows");
  cuda::soft_target_loss(f32(logits), f32(teacher), f32(losses), f32(grad), N, V, static_cast<double>(temperature),
                         grad_scale, stream());
}

void CudaBackend::muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u, const OptimHyper& h) {
  LOOM_CHECK(buf.defined() && u.defined(), "muon_momentum: needs the buf and u operands");
  const int64_t n = check_flat("muon_momentum", grad, "grad", {{"buf", &buf}, {"u", &u}});
  cuda::muon_momentum(f32(grad), f32(buf), f32(u), n, static_cast<float>(h.momentum), h.grad_scale, h.nesterov,
                      stream());
}

void CudaBackend::newton_schulz_normalize(const Tensor& u, const Tensor& x) {
  expect_dtype(u, DTYPE_F32, "newton_schulz_normalize", "u");
  expect_dtype(x, DTYPE_F32, "scale_transpose", "dst");  // the CPU's messages: its second step is scale_transpose
  expect_numel(x, u.numel(), "scale_transpose", "dst");
  if (u.numel() == 0) return;
  // The scratch: 1 / ||u|| (read by the scaling kernel), then the partial sums and a flag.
  float* inv = static_cast<float*>(workspace(16 + cuda::inverse_norm_scratch_bytes()));
  cuda::inverse_norm(f32(u), u.numel(), inv, inv + 4, stream());
  const int64_t rows = rows_of(u), cols = u.dim(-1);
  cuda::scale_transpose(f32(u), f32(x), rows, cols, 1.0f, inv, rows > cols, stream());
}

void CudaBackend::decayed_update(const Tensor& param, const Tensor& u, float decay, float step) {
  const int64_t n = check_flat("decayed_update", param, "param", {{"u", &u}});
  cuda::decayed_update(f32(param), f32(u), n, decay, step, stream());
}

}  // namespace loom::cuda_backend_detail
