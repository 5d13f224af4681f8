#include "loom/model/moe_stats.h"

#include <algorithm>

#include "loom/nn/moe.h"

namespace loom {

void MoeStepStats::end_step(Backend& backend, const ModelConfig& config, std::vector<Block>& blocks,
                            Communicator* group, std::vector<float>& bias_host) {
  if (config.moe_experts == 0) {
    stats_.clear();
    return;
  }
  // Per MoE layer: E loads, then tokens, dropped, micro-batches, aux, seq_aux, z, entropy, dispatched.
  const int64_t E = config.moe_experts, per = E + 8;
  if (!sums_.defined()) {
    for (int64_t l = 0; l < config.n_layer; ++l) {
      if (blocks[l].is_moe()) layers_.push_back(l);
    }
    sums_ = Tensor::empty(backend.allocator(), {static_cast<int64_t>(layers_.size()) * per}, DTYPE_F64, MEM_WORKSPACE);
  }
  const std::vector<int64_t>& layers = layers_;
  sums_host_.resize(static_cast<size_t>(sums_.numel()));  // sized once: the first step's
  double* v = sums_host_.data();
  for (size_t i = 0; i < layers.size(); ++i) {
    Block::MoeStats& m = blocks[layers[i]].moe_stats();
    double* o = v + static_cast<int64_t>(i) * per;
    for (int64_t e = 0; e < E; ++e) o[e] = m.load.empty() ? 0.0 : m.load[e];
    o[E] = static_cast<double>(m.tokens), o[E + 1] = static_cast<double>(m.dropped);
    o[E + 2] = static_cast<double>(m.micro_batches), o[E + 3] = m.aux, o[E + 4] = m.seq_aux, o[E + 5] = m.z;
    o[E + 6] = m.entropy, o[E + 7] = static_cast<double>(m.dispatched);
    m.reset();
  }
  if (group != nullptr && group->size() > 1) {  // every rank's tokens
    backend.write(sums_, v);
    group->all_reduce(sums_);
    backend.read(sums_, v);
  }
  size_t kept = 0;  // the entries of the layers with tokens, reused from the last step (their load's capacity)
  for (size_t i = 0; i < layers.size(); ++i) {
    const double* o = v + static_cast<int64_t>(i) * per;
    if (static_cast<int64_t>(o[E]) <= 0) continue;
    MoeLayerStats& st = kept < stats_.size() ? stats_[kept] : stats_.emplace_back();
    ++kept;
    st.layer = layers[i];
    st.load.assign(o, o + E);
    st.tokens = static_cast<int64_t>(o[E]), st.dropped = static_cast<int64_t>(o[E + 1]);
    const double micro = std::max(1.0, o[E + 2]);
    st.aux = o[E + 3] / micro, st.seq_aux = o[E + 4] / micro, st.z = o[E + 5] / micro, st.entropy = o[E + 6] / micro;
    st.max_violation = moe_max_violation(st.load);
    st.dispatched = static_cast<int64_t>(o[E + 7]);
    if (config.moe_bias_gamma > 0.0f) {  // auxiliary-loss-free balancing
      moe_update_bias(backend, blocks[layers[i]].moe_bias(), st.load, config.moe_bias_gamma, bias_host);
    }
  }
  stats_.resize(kept);
}

}  // namespace loom
