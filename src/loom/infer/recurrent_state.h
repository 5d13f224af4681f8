// The recurrent state of a hybrid model's linear-attention blocks (nn/linear_attention.h; Qwen3-
// Next's gated DeltaNet), per decoded sequence: for each such block, the causal conv's last K-1
// inputs and the delta rule's H_v d_k d_v state (ModelConfig::linear_state_floats), in host memory,
// zeros at a sequence's start. It is the linear blocks' whole memory of the past: a fixed size
// whatever the sequence's length, where the attention blocks' KV cache grows by a row per position.
// The generation engine keeps one per sequence beside its KV cache (StepRows::linear_state hands it
// to the blocks), copies it on fork and drops it on release.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "loom/arch/config.h"

namespace loom {

class RecurrentStates {
 public:
  explicit RecurrentStates(const ModelConfig& config);
  bool empty() const { return slots_ == 0; }  // no linear-attention blocks
  // Block `layer`'s state of sequence seq (a linear-attention block), created as zeros on first use.
  float* state(int64_t seq, int64_t layer);
  void fork(int64_t from, int64_t to);  // to's state becomes a copy of from's
  void release(int64_t seq);
  int64_t sequences() const { return static_cast<int64_t>(states_.size()); }
  int64_t bytes() const { return sequences() * sequence_bytes(); }  // held now
  int64_t sequence_bytes() const { return slots_ * floats_ * static_cast<int64_t>(sizeof(float)); }

 private:
  std::vector<int64_t> slot_;  // [layer] index among the linear-attention blocks, -1 for the others
  int64_t slots_ = 0, floats_ = 0;
  std::map<int64_t, std::vector<float>> states_;
};

// Bytes of one sequence's recurrent state: 4 x linear blocks x linear_state_floats (0 without them).
inline int64_t recurrent_state_bytes(const ModelConfig& c) {
  return c.linear_interval > 0 ? 4 * c.linear_layer_count() * c.linear_state_floats() : 0;
}

}  // namespace loom
