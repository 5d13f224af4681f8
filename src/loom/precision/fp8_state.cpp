#include "loom/precision/fp8_state.h"

#include <algorithm>

namespace loom {

const Tensor& Fp8ScalingState::pack(Backend& backend, const std::vector<DelayedScaling*>& scalings, int64_t history) {
  if (scalings.empty()) return state_;
  const int64_t per = history + 1;
  if (!state_.defined()) {
    state_ = Tensor::empty(backend.allocator(), {static_cast<int64_t>(scalings.size()) * per}, DTYPE_F32,
                           MEM_OPTIMIZER_STATE);
  }
  std::vector<float> host(static_cast<size_t>(state_.numel()));
  float* p = host.data();
  for (const DelayedScaling* s : scalings) {
    std::copy(s->history().begin(), s->history().end(), p);
    p[per - 1] = s->amax_used();
    p += per;
  }
  backend.write(state_, host.data());
  return state_;
}

void Fp8ScalingState::unpack(Backend& backend, const std::vector<DelayedScaling*>& scalings, int64_t history) const {
  if (!state_.defined()) return;
  const int64_t per = history + 1;
  std::vector<float> host(static_cast<size_t>(state_.numel()));
  backend.read(state_, host.data());
  const float* p = host.data();
  for (DelayedScaling* s : scalings) {
    s->restore(std::vector<float>(p, p + per - 1), p[per - 1]);
    p += per;
  }
}

}  // namespace loom
