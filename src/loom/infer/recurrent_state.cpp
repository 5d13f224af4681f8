#include "loom/infer/recurrent_state.h"

#include "loom/core/error.h"

namespace loom {

RecurrentStates::RecurrentStates(const ModelConfig& c) : floats_(c.linear_state_floats()) {
  for (int64_t l = 0; l < c.n_layer; ++l) slot_.push_back(c.linear_layer(l) ? slots_++ : -1);
}

float* RecurrentStates::state(int64_t seq, int64_t layer) {
  LOOM_CHECK(layer >= 0 && layer < static_cast<int64_t>(slot_.size()) && slot_[static_cast<size_t>(layer)] >= 0,
             "layer ", layer, " keeps no recurrent state (not a linear-attention block)");
  std::vector<float>& s = states_[seq];
  if (s.empty()) s.assign(static_cast<size_t>(slots_ * floats_), 0.0f);
  return s.data() + slot_[static_cast<size_t>(layer)] * floats_;
}

void RecurrentStates::fork(int64_t from, int64_t to) {
  if (empty()) return;
  const auto it = states_.find(from);
  if (it == states_.end()) {
    states_.erase(to);  // from has no state yet: neither has to
    return;
  }
  states_[to] = it->second;
}

void RecurrentStates::release(int64_t seq) { states_.erase(seq); }

}  // namespace loom
