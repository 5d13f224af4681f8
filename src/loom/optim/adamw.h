// AdamW over flat parameter ranges (Loshchilov & Hutter 2019, decoupled weight decay).
// Parameter groups are contiguous ranges of the flat buffer with their own weight decay, so a
// ZeRO shard or a pipeline stage can hand the optimizer any sub-range later.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/model/param_layout.h"

namespace loom {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // applied to matrices only (ParamSpec::weight_decay)
};

struct ParamRange {
  int64_t offset = 0;  // elements into the flat buffer
  int64_t count = 0;
  bool weight_decay = false;
};

// Adjacent parameters with the same decay flag merged into ranges, in buffer order.
std::vector<ParamRange> param_ranges(const ParamLayout& layout);

class AdamW {
 public:
  AdamW(Backend& backend, const Tensor& params, const Tensor& grads, std::vector<ParamRange> ranges,
        AdamWConfig config);

  // One update with grads * grad_scale (the clipping coefficient); advances the step counter.
  void step(float lr, float grad_scale = 1.0f);
  int64_t steps_taken() const { return step_; }
  void restore_steps_taken(int64_t steps) { step_ = steps; }  // with m, v restored from a checkpoint
  const Tensor& first_moment() const { return m_; }   // (P) MEM_OPTIMIZER_STATE
  const Tensor& second_moment() const { return v_; }  // (P) MEM_OPTIMIZER_STATE
  static constexpr int64_t kStateBytesPerParam = 8;    // m and v in fp32

 private:
  Backend& backend_;
  Tensor params_, grads_, m_, v_;
  std::vector<ParamRange> ranges_;
  AdamWConfig config_;
  int64_t step_ = 0;
};

// Global L2 norm of the gradients, summed in a fixed order (bitwise reproducible).
double grad_norm(Backend& backend, const Tensor& grads);
// The factor that brings the norm to at most max_norm: min(1, max_norm / (norm + 1e-6)), as
// torch.nn.utils.clip_grad_norm_. max_norm <= 0 disables clipping (factor 1). The optimizer
// applies it while it reads the gradients, saving a pass over them.
float clip_coefficient(double norm, double max_norm);

}  // namespace loom
