#include "loom/infer/score.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/infer/chunk_attention.h"
#include "loom/core/error.h"

namespace loom {

namespace {

// One sequence's keys and values, every layer, in fp32 at their positions, each kv head's rows
// contiguous; the rows of a forward_rows call are positions first .. first + n - 1 of it,
// attended by ChunkAttention (two GEMMs per kv head and key tile on the host's CPU backend, whichever backend
// runs the model: forward_rows stages the rows through the host).
class SequenceCache final : public DecodeCache {
 public:
  SequenceCache(const ModelConfig& c, int64_t capacity)
      : c_(c), hd_(c.head_dim()), capacity_(capacity), attention_(c) {
    Allocator& a = attention_.backend().allocator();
    k_ = Tensor::empty(a, {c.n_layer, c.n_kv_head, capacity, hd_}, DTYPE_F32, MEM_KV_CACHE);
    v_ = Tensor::empty(a, {c.n_layer, c.n_kv_head, capacity, hd_}, DTYPE_F32, MEM_KV_CACHE);
  }
  void set_first(int64_t first) { first_ = first; }

  void attend(int64_t layer, int64_t row, const float* q, const float* k, const float* v, float* out) override {
    store(layer, row, k, v);
    attend_chunk(layer, first_ + row, 1, q, 0, out, 0);
  }
  // One sequence: a linear-attention block's state carried from chunk to chunk (zeros at first).
  float* linear_state(int64_t layer, int64_t) override {
    if (linear_.empty()) linear_.resize(static_cast<size_t>(c_.n_layer));
    std::vector<float>& s = linear_[static_cast<size_t>(layer)];
    if (s.empty()) s.assign(static_cast<size_t>(c_.linear_state_floats()), 0.0f);
    return s.data();
  }
  const float* latent(int64_t, int64_t, const float*, int64_t*) override {
    throw Error("scoring in chunks: MLA blocks are not supported (their latent cache is the generation engine's)");
  }
  void attend_host_rows(int64_t layer, int64_t n, const float* qkv, int64_t width, int64_t k_col, int64_t v_col,
                        float* out, int64_t out_width) override {
    for (int64_t r = 0; r < n; ++r) store(layer, r, qkv + r * width + k_col, qkv + r * width + v_col);
    attend_chunk(layer, first_, n, qkv, width, out, out_width);
  }

 private:
  std::vector<std::vector<float>> linear_;  // [layer] a linear-attention block's recurrent state
  void store(int64_t layer, int64_t row, const float* k, const float* v) {
    const int64_t p = first_ + row;
    LOOM_CHECK(p < capacity_, "scoring in chunks: position ", p, " beyond the cache's ", capacity_);
    for (int64_t g = 0; g < c_.n_kv_head; ++g) {
      const int64_t at = ((layer * c_.n_kv_head + g) * capacity_ + p) * hd_;
      std::copy(k + g * hd_, k + (g + 1) * hd_, k_.data<float>() + at);
      std::copy(v + g * hd_, v + (g + 1) * hd_, v_.data<float>() + at);
    }
  }
  void attend_chunk(int64_t layer, int64_t first, int64_t n, const float* q, int64_t q_stride, float* out,
                    int64_t out_stride) {
    const int64_t W = c_.layer_window(layer), lo = W > 0 ? std::max<int64_t>(0, first + 1 - W) : 0;
    const auto tile = [&, lo](int64_t g, int64_t begin, int64_t end) {
      const int64_t at = ((layer * c_.n_kv_head + g) * capacity_ + lo + begin) * hd_;
      return std::pair{k_.view(at, {end - begin, hd_}), v_.view(at, {end - begin, hd_})};
    };
    attention_.run(first, n, lo, W, tile, q, q_stride, out, out_stride, layer_sinks());
  }

  const ModelConfig& c_;
  int64_t hd_, capacity_, first_ = 0;
  ChunkAttention attention_;
  Tensor k_, v_;  // (layers, n_kv_head, capacity, head_dim)
};

}  // namespace

bool can_score_in_chunks(const ModelConfig& config) { return !config.mla(); }

SequenceLoss score_tokens(Transformer& model, std::span<const int32_t> tokens, int64_t chunk) {
  const ModelConfig& c = model.config();
  const int64_t T = static_cast<int64_t>(tokens.size()), V = c.vocab_size;
  LOOM_CHECK(can_score_in_chunks(c), "scoring in chunks: MLA blocks are not supported");
  LOOM_CHECK(chunk >= 1, "scoring in chunks: the chunk must be >= 1 positions, got ", chunk);
  LOOM_CHECK(T >= 2 && T - 1 <= c.max_seq_len, "scoring in chunks: ", T, " tokens, expected 2 .. model.max_seq_len + 1 = ",
             c.max_seq_len + 1);
  // LongRoPE rotates a forward reaching past the original context with its long factors at every
  // position; rows fed in chunks would rotate the earlier ones with the short factors.
  LOOM_CHECK(!crosses_longrope_context(c, T - 1), "scoring in chunks: model.rope_scaling = longrope over ", T - 1,
             " positions, past rope_original_context = ", c.rope_original_context, ": score the window whole");
  const int64_t rows = std::min(chunk, T - 1);
  SequenceCache cache(c, T - 1);
  ActivationStore store = model.allocate_rows(rows);
  std::vector<float> logits(static_cast<size_t>(rows * V));
  SequenceLoss loss;
  for (int64_t first = 0; first < T - 1; first += rows) {  // positions first .. first + n - 1 score tokens first + 1 ..
    const int64_t n = std::min(rows, T - 1 - first);
    if (n < rows) store = model.allocate_rows(n);  // the last, shorter chunk
    std::vector<int32_t> ids(tokens.begin() + first, tokens.begin() + first + n);
    std::vector<int64_t> positions(static_cast<size_t>(n));
    for (int64_t r = 0; r < n; ++r) positions[static_cast<size_t>(r)] = first + r;
    cache.set_first(first);
    model.forward_rows(store, ids, positions, cache);
    model.backend().read(store.logits, logits.data());
    for (int64_t r = 0; r < n; ++r) {  // -log softmax at the next token, in double
      const float* row = logits.data() + r * V;
      const double m = *std::max_element(row, row + V);
      double z = 0.0;
      for (int64_t i = 0; i < V; ++i) z += std::exp(static_cast<double>(row[i]) - m);
      const int32_t target = tokens[static_cast<size_t>(first + r + 1)];
      LOOM_CHECK(target >= 0 && target < V, "scoring in chunks: token ", target, " outside the vocabulary of ", V);
      loss.sum += m + std::log(z) - static_cast<double>(row[target]);
    }
    loss.count += n;
  }
  return loss;
}

WindowsLoss score_windows(Transformer& model, const std::vector<int32_t>& ids, int64_t T, int64_t B, int64_t chunk,
                          const std::string& what) {
  WindowsLoss r;
  r.tokens = static_cast<int64_t>(ids.size());
  r.window = T;
  r.windows = r.tokens / T;
  LOOM_CHECK(r.windows >= 1, what, ": ", r.tokens, " tokens make no window of --seq-len ", T);
  r.chunked = T - 1 > chunk && can_score_in_chunks(model.config()) && !crosses_longrope_context(model.config(), T - 1);
  double sum = 0.0;
  for (int64_t first = 0; first < r.windows; first += r.chunked ? 1 : B) {
    if (r.chunked) {
      const SequenceLoss l = score_tokens(model, std::span<const int32_t>(ids.data() + first * T, static_cast<size_t>(T)), chunk);
      sum += l.sum / static_cast<double>(l.count);
      continue;
    }
    const int64_t n = std::min(B, r.windows - first);
    ActivationStore store = model.allocate_store(n, T - 1);
    std::vector<int32_t> tokens(static_cast<size_t>(n * (T - 1))), targets(tokens.size());  // staged on the host
    for (int64_t w = 0; w < n; ++w) {
      const int32_t* window = ids.data() + (first + w) * T;
      for (int64_t t = 0; t + 1 < T; ++t) {
        tokens[static_cast<size_t>(w * (T - 1) + t)] = window[t];
        targets[static_cast<size_t>(w * (T - 1) + t)] = window[t + 1];
      }
    }
    model.backend().write(store.tokens, tokens.data());
    model.backend().write(store.targets, targets.data());
    sum += model.forward(store) * static_cast<double>(n);  // forward: the mean over its n (T - 1) positions
  }
  r.loss = sum / static_cast<double>(r.windows);
  return r;
}

ScoreBytes score_bytes(const ModelConfig& c, int64_t tokens, int64_t chunk) {
  const int64_t positions = std::max<int64_t>(1, tokens - 1), rows = std::min(chunk, positions);
  ScoreBytes b;
  b.kv = 2 * c.n_layer * positions * c.n_kv_head * c.head_dim() * 4;
  b.logits = rows * c.vocab_size * 4;             // the host copy (the store holds its own)
  b.scores = ChunkAttention::workspace_bytes(c, rows);  // a tile's scores, the chunk's queries and outputs
  return b;
}

}  // namespace loom
