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

  void step(float lr);  // one update with the current grads; advances the step counter
  int64_t steps_taken() const { return step_; }
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

// Scales grads so their global L2 norm is at most max_norm (coef = max_norm / (norm + 1e-6),
// as torch.nn.utils.clip_grad_norm_). Returns the norm before clipping. max_norm <= 0: no clip.
double clip_grad_norm(Backend& backend, const Tensor& grads, double max_norm);

}  // namespace loom
