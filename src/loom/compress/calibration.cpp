#include "loom/compress/calibration.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"

namespace loom {

constexpr int64_t kBatch = 4;  // calibration sequences per forward

std::vector<float> read_host(Backend& backend, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  backend.read(t, v.data());
  return v;
}

std::vector<Transformer::LinearWeight> layer_linear_weights(Transformer& model, int64_t layer) {
  std::vector<Transformer::LinearWeight> all = model.linear_weights();
  if (layer == model.config().n_layer) return {all.back()};
  return {all.begin() + layer * 4, all.begin() + layer * 4 + 4};
}

SequentialCalibration::SequentialCalibration(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                             bool hessian)
    : model_(model), sequences_(sequences), hessian_(hessian) {
  LOOM_CHECK(!sequences.empty(), "calibration: no sequences");
  seq_len_ = static_cast<int64_t>(sequences[0].size());
  for (const std::vector<int32_t>& s : sequences) {
    LOOM_CHECK(static_cast<int64_t>(s.size()) == seq_len_, "calibration: sequences of unequal length");
  }
  batches_ = (static_cast<int64_t>(sequences.size()) + kBatch - 1) / kBatch;
  hidden_.resize(static_cast<size_t>(batches_));
}

int64_t SequentialCalibration::hidden_bytes() const {
  return 2 * static_cast<int64_t>(sequences_.size()) * seq_len_ * model_.config().d_model * static_cast<int64_t>(sizeof(float));
}

ActivationStore& SequentialCalibration::run(int64_t layer, int64_t b) {
  Backend& backend = model_.backend();
  const int64_t T = seq_len_, first = b * kBatch;
  const int64_t n = std::min<int64_t>(kBatch, static_cast<int64_t>(sequences_.size()) - first);
  if (store_layer_ != layer || store_.batch != n) {  // per layer, and again for a shorter last batch
    store_ = ActivationStore{};
    store_ = model_.allocate_block_store(n, T, layer);
    store_layer_ = layer;
  }
  std::vector<int32_t> tokens(static_cast<size_t>(n * T));
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int32_t>& s = sequences_[static_cast<size_t>(first + i)];
    std::copy(s.begin(), s.end(), tokens.begin() + i * T);
  }
  backend.write(store_.tokens, tokens.data());
  backend.write(store_.targets, tokens.data());  // unused (no loss), but valid ids
  if (layer > 0) backend.write(store_.blocks[static_cast<size_t>(layer)].input, hidden_[static_cast<size_t>(b)].data());
  model_.forward_stage(store_, layer, layer + 1, false);
  return store_;
}

void SequentialCalibration::accumulate(std::map<std::string, InputStats>& stats,
                                       const std::vector<Transformer::LinearWeight>& weights,
                                       const std::vector<Tensor>& inputs, int64_t rows, int64_t batches) {
  Backend& backend = model_.backend();
  const int64_t per_batch_sample = std::max<int64_t>(1, InputStats::kSampleRows / batches);
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t K = weights[i].weight.dim(1);
    const Tensor x = inputs[i].view(0, {rows, K});
    InputStats& st = stats[weights[i].name];
    if (st.abs_sum.empty()) {
      st.abs_sum.assign(static_cast<size_t>(K), 0.0);
      st.abs_max.assign(static_cast<size_t>(K), 0.0);
      st.sq_sum.assign(static_cast<size_t>(K), 0.0);
      if (hessian_) st.hessian.assign(static_cast<size_t>(K * K), 0.0);
    }
    if (hessian_) {  // this batch's x^T x by the f32 GEMM, summed over batches in double
      Tensor h = Tensor::empty(backend.allocator(), {K, K}, DTYPE_F32, MEM_WORKSPACE);
      GemmSpec spec;
      spec.trans_a = true;
      backend.gemm(x, x, h, spec);
      const std::vector<float> part = read_host(backend, h);
      for (size_t e = 0; e < part.size(); ++e) st.hessian[e] += part[e];
    }
    const std::vector<float> host = read_host(backend, x);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = host.data() + r * K;
      for (int64_t j = 0; j < K; ++j) {
        const double v = row[j];
        st.abs_sum[static_cast<size_t>(j)] += std::fabs(v);
        st.abs_max[static_cast<size_t>(j)] = std::max(st.abs_max[static_cast<size_t>(j)], std::fabs(v));
        st.sq_sum[static_cast<size_t>(j)] += v * v;
      }
    }
    const int64_t take = std::min(per_batch_sample, rows), stride = rows / take;
    for (int64_t k = 0; k < take && static_cast<int64_t>(st.sample.size()) < InputStats::kSampleRows * K; ++k) {
      st.sample.insert(st.sample.end(), host.begin() + k * stride * K, host.begin() + (k * stride + 1) * K);
    }
    st.rows += rows;
  }
}

std::map<std::string, InputStats> SequentialCalibration::stats(int64_t layer) {
  const int64_t L = model_.config().n_layer;
  LOOM_CHECK(layer == next_, "calibration: block ", layer, " asked for, but the hidden states are block ", next_, "'s");
  if (layer == L) return std::move(head_);
  const std::vector<Transformer::LinearWeight> weights = layer_linear_weights(model_, layer);
  std::map<std::string, InputStats> stats;
  for (int64_t b = 0; b < batches_; ++b) {
    ActivationStore& s = run(layer, b);
    const BlockSaved& saved = s.blocks[static_cast<size_t>(layer)];
    const std::array<Tensor, 4> inputs = block_linear_inputs(model_.config(), saved);
    accumulate(stats, weights, {inputs.begin(), inputs.end()}, s.batch * seq_len_, batches_);
  }
  return stats;
}

void SequentialCalibration::advance(int64_t layer) {
  const int64_t L = model_.config().n_layer;
  LOOM_CHECK(layer == next_ && layer < L, "calibration: advance of block ", layer, " after block ", next_, "'s statistics");
  std::vector<std::vector<float>> next(static_cast<size_t>(batches_));
  for (int64_t b = 0; b < batches_; ++b) {
    ActivationStore& s = run(layer, b);
    if (layer + 1 < L) {
      next[static_cast<size_t>(b)] = read_host(model_.backend(), s.blocks[static_cast<size_t>(layer + 1)].input);
    } else {
      accumulate(head_, layer_linear_weights(model_, L), {s.final_norm}, s.batch * seq_len_, batches_);
    }
  }
  hidden_ = std::move(next);
  store_ = ActivationStore{};
  store_layer_ = -1;
  next_ = layer + 1;
}

}  // namespace loom
