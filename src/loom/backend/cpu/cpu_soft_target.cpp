// Backend::soft_target_loss on the CPU (the contract in backend.h): one row per OpenMP iteration,
// its log-sum-exps and sums in double, so a row's result does not depend on the thread count.
#include <cmath>

#include "loom/backend/cpu/cpu_quant_ops.h"
#include "loom/backend/optim_checks.h"
#include "loom/core/error.h"

namespace loom::cpu {

void soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale, const Tensor& losses,
                      const Tensor& grad) {
  const auto [N, V] = checks::check_soft_target_loss(logits, teacher, temperature, losses, grad);
  const float* s = logits.data<float>();
  const float* t = teacher.data<float>();
  float* l = losses.data<float>();
  float* g = grad.data<float>();
  const double T = temperature;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* si = s + i * V;
    const float* ti = t + i * V;
    double ms = -INFINITY, mt = -INFINITY;
    for (int64_t v = 0; v < V; ++v) ms = std::fmax(ms, si[v] / T), mt = std::fmax(mt, ti[v] / T);
    double zs = 0.0, zt = 0.0;
    for (int64_t v = 0; v < V; ++v) zs += std::exp(si[v] / T - ms), zt += std::exp(ti[v] / T - mt);
    const double lse_s = ms + std::log(zs), lse_t = mt + std::log(zt);
    double kl = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      const double log_ps = si[v] / T - lse_s, log_pt = ti[v] / T - lse_t, pt = std::exp(log_pt);
      kl += pt * (log_pt - log_ps);
      g[i * V + v] = static_cast<float>(grad_scale * T * (std::exp(log_ps) - pt));
    }
    l[i] = static_cast<float>(T * T * kl);
  }
}

}  // namespace loom::cpu
