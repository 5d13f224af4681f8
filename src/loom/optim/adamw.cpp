#include "loom/optim/adamw.h"

#include <algorithm>
#include <cmath>

namespace loom {

std::vector<ParamRange> param_ranges(const ParamLayout& layout) {
  std::vector<ParamRange> ranges;
  for (const ParamSpec& p : layout.params) {
    if (!ranges.empty() && ranges.back().weight_decay == p.weight_decay &&
        ranges.back().offset + ranges.back().count == p.offset) {
      ranges.back().count += p.numel;
    } else {
      ranges.push_back({p.offset, p.numel, p.weight_decay});
    }
  }
  return ranges;
}

AdamW::AdamW(Backend& backend, const Tensor& params, const Tensor& grads, std::vector<ParamRange> ranges,
             AdamWConfig config)
    : backend_(backend), params_(params), grads_(grads), ranges_(std::move(ranges)), config_(config) {
  m_ = Tensor::zeros(backend_.allocator(), {params.numel()}, DTYPE_F32, MEM_OPTIMIZER_STATE);
  v_ = Tensor::zeros(backend_.allocator(), {params.numel()}, DTYPE_F32, MEM_OPTIMIZER_STATE);
}

void AdamW::step(float lr, float grad_scale) {
  ++step_;
  for (const ParamRange& r : ranges_) {
    AdamWHyper h;
    h.lr = lr;
    h.beta1 = config_.beta1;
    h.beta2 = config_.beta2;
    h.eps = config_.eps;
    h.weight_decay = r.weight_decay ? config_.weight_decay : 0.0f;
    h.grad_scale = grad_scale;
    h.step = step_;
    backend_.adamw_step(params_.view(r.offset, {r.count}), grads_.view(r.offset, {r.count}),
                        m_.view(r.offset, {r.count}), v_.view(r.offset, {r.count}), h);
  }
}

double grad_norm(Backend& backend, const Tensor& grads) { return std::sqrt(backend.sum_squares(grads)); }

float clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  return static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6)));
}

}  // namespace loom
