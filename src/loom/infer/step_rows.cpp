#include "loom/infer/step_rows.h"

#include <algorithm>

#include "loom/backend/attend_rows.h"
#include "loom/core/error.h"

namespace loom {

void StepRows::clear() {
  seqs.clear(), chunk.clear(), chunk_len.clear(), prompt.clear(), gathered.clear();
  chunks_.clear(), keep_.clear();
}

bool StepRows::in_backend_memory() const {
  return cache_.in_backend_memory() && std::none_of(gathered.begin(), gathered.end(), [](bool g) { return g; });
}

void StepRows::attend_all(Backend& backend, int64_t model_layer, const Tensor& qkv, const Tensor& out) {
  const int64_t layer = kv_layer(model_layer), window = model_.layer_window(model_layer);
  const int64_t n = qkv.dim(0), H = model_.n_head, hd = model_.head_dim(), KW = model_.n_kv_head * hd;
  cache_.write_rows(layer, seqs, qkv, 0, H * hd, H * hd + KW);
  if (!q_.defined() || q_.dim(0) != n) q_ = Tensor::empty(backend.allocator(), {n, H * hd}, DTYPE_F32, MEM_WORKSPACE);
  BlockCopy q_block;  // kv_attention takes contiguous query rows
  q_block.rows = n, q_block.cols = H * hd, q_block.src_stride = qkv.dim(1), q_block.dst_stride = H * hd;
  backend.copy_block(qkv, q_, q_block);
  cache_.attend_rows(layer, seqs, q_, out, H, model_.n_kv_head, hd, window, sink_logits);
}

void StepRows::attend(int64_t model_layer, int64_t row, const float* q, const float* k, const float* v, float* out) {
  const int64_t layer = kv_layer(model_layer), window = model_.layer_window(model_layer);
  const int64_t seq = seqs[static_cast<size_t>(row)];
  if (gathered[static_cast<size_t>(row)]) {
    attend_chunk(seq, q, append(layer, row, k, v), window, out, scores_, sums_);
    return;
  }
  cache_.write(seq, layer, k, v);
  cache_.attend(seq, layer, q, out, model_.n_head, model_.n_kv_head, model_.head_dim(), window, layer_sinks());
}

void StepRows::attend_host_rows(int64_t model_layer, int64_t n, const float* qkv, int64_t width, int64_t k_col,
                                int64_t v_col, float* out, int64_t out_width) {
  const int64_t layer = kv_layer(model_layer), window = model_.layer_window(model_layer);
  std::vector<int64_t> counts(static_cast<size_t>(n), 0);
  const auto of_prompt_chunk = [&](size_t i) { return gathered[i] && chunk_len[i] > 1 && prompt[i]; };
  for (int64_t r = 0; r < n; ++r) {
    const auto i = static_cast<size_t>(r);
    if (gathered[i]) counts[i] = append(layer, r, qkv + r * width + k_col, qkv + r * width + v_col, !of_prompt_chunk(i));
  }
  // A prompt's chunk (its rows consecutive, from its row 0): two GEMMs per kv head and key tile,
  // reading the cache's rows a tile at a time (chunk_attention.h); speculation's drafts keep the decoding kernel below, so
  // a verified row computes bitwise what decoding it alone would.
  for (int64_t r = 0; r < n; ++r) {
    const auto i = static_cast<size_t>(r);
    if (!of_prompt_chunk(i) || chunk[i] != 0) continue;
    const Chunk& ch = chunks_.at(seqs[i]);
    const int64_t m = chunk_len[i], kw = cache_.config().k_width;
    const std::vector<float>&own_k = ch.new_k[static_cast<size_t>(layer)], &own_v = ch.new_v[static_cast<size_t>(layer)];
    // Positions [first, prefix) from the cache, then the chunk's own rows, a tile at a time.
    const auto read = [&](int64_t begin, int64_t end, float* k, float* v) {
      const int64_t cached = std::min(end, ch.prefix - ch.first);
      if (begin < cached) cache_.read(seqs[i], layer, ch.first + begin, ch.first + cached, k, v);
      for (int64_t t = std::max(begin, cached); t < end; ++t) {
        const int64_t j = t - (ch.prefix - ch.first);
        std::copy(own_k.begin() + j * kw, own_k.begin() + (j + 1) * kw, k + (t - begin) * kw);
        std::copy(own_v.begin() + j * kw, own_v.begin() + (j + 1) * kw, v + (t - begin) * kw);
      }
    };
    prompt_attention_.run(ch.prefix, m, ch.first, window, prompt_attention_.interleaved(read), qkv + r * width, width,
                          out + r * out_width, out_width, layer_sinks());
    for (int64_t j = 0; j < m; ++j) counts[static_cast<size_t>(r + j)] = 0;  // attended
  }
  if (!chunks_.empty()) {
#pragma omp parallel
    {
      std::vector<float> scores, sums;
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < n; ++r) {
        if (counts[static_cast<size_t>(r)] == 0) continue;
        attend_chunk(seqs[static_cast<size_t>(r)], qkv + r * width, counts[static_cast<size_t>(r)], window,
                     out + r * out_width, scores, sums);
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    if (gathered[static_cast<size_t>(r)]) continue;
    const float* row = qkv + r * width;
    attend(model_layer, r, row, row + k_col, row + v_col, out + r * out_width);
  }
}

float* StepRows::linear_state(int64_t layer, int64_t row) {
  LOOM_CHECK(states_ != nullptr, "layer ", layer, " is a linear-attention block: these rows keep no recurrent state");
  // Speculation's drafts would advance the state past rows the cache may not keep.
  LOOM_CHECK(prompt[static_cast<size_t>(row)] || chunk_len[static_cast<size_t>(row)] == 1,
             "speculative decoding with linear-attention blocks is not supported (their state has no rollback)");
  return states_->state(seqs[static_cast<size_t>(row)], layer);
}

const float* StepRows::latent(int64_t model_layer, int64_t row, const float* latent, int64_t* count) {
  const int64_t layer = kv_layer(model_layer);
  const int64_t seq = seqs[static_cast<size_t>(row)];
  if (gathered[static_cast<size_t>(row)]) {
    *count = append(layer, row, latent, nullptr);
    return chunks_.at(seq).k.data();
  }
  cache_.write(seq, layer, latent, nullptr);
  *count = cache_.length(seq) + 1;  // with the row just written
  buffer_.resize(static_cast<size_t>(*count * cache_.config().k_width));
  cache_.read(seq, layer, 0, *count, buffer_.data(), nullptr);
  return buffer_.data();
}

void StepRows::commit() {
  const KvCacheConfig& c = cache_.config();
  for (auto& [seq, chunk_rows] : chunks_) {
    const auto kept = keep_.find(seq);
    const int64_t rows = kept == keep_.end() ? chunk_rows.rows : std::min(chunk_rows.rows, kept->second);
    for (int64_t j = 0; j < rows; ++j) {
      for (int64_t l = 0; l < c.n_layer; ++l) {
        const auto at = static_cast<size_t>(j);
        cache_.write(seq, l, chunk_rows.new_k[static_cast<size_t>(l)].data() + at * static_cast<size_t>(c.k_width),
                     c.v_width > 0 ? chunk_rows.new_v[static_cast<size_t>(l)].data() + at * static_cast<size_t>(c.v_width) : nullptr);
      }
      cache_.advance(seq);
    }
  }
  chunks_.clear();
}

int64_t StepRows::append(int64_t layer, int64_t row, const float* k, const float* v, bool gather) {
  const int64_t seq = seqs[static_cast<size_t>(row)];
  const KvCacheConfig& c = cache_.config();
  Chunk& ch = chunks_[seq];
  if (ch.new_k.empty()) {
    ch.prefix = cache_.length(seq);
    // Row 0 of the chunk attends to [prefix + 1 - W, prefix] under a window W on every layer, the
    // others to later rows. (MLA's latent rows are handed out from position 0: all of them; with
    // global layers among windowed ones (model.window_pattern) every layer gathers from 0.)
    ch.first = model_.windowed_everywhere() && c.v_width > 0 ? std::max<int64_t>(0, ch.prefix + 1 - model_.attn_window) : 0;
    ch.new_k.resize(static_cast<size_t>(c.n_layer)), ch.new_v.resize(static_cast<size_t>(c.n_layer));
  }
  if (gather && chunk[static_cast<size_t>(row)] == 0) {
    const int64_t cached = ch.prefix - ch.first;
    ch.k.resize(static_cast<size_t>(cached * c.k_width)), ch.v.resize(static_cast<size_t>(cached * c.v_width));
    if (cached > 0) cache_.read(seq, layer, ch.first, ch.prefix, ch.k.data(), c.v_width > 0 ? ch.v.data() : nullptr);
  }
  if (gather) ch.k.insert(ch.k.end(), k, k + c.k_width);
  ch.new_k[static_cast<size_t>(layer)].insert(ch.new_k[static_cast<size_t>(layer)].end(), k, k + c.k_width);
  if (c.v_width > 0) {
    if (gather) ch.v.insert(ch.v.end(), v, v + c.v_width);
    ch.new_v[static_cast<size_t>(layer)].insert(ch.new_v[static_cast<size_t>(layer)].end(), v, v + c.v_width);
  }
  ch.rows = std::max(ch.rows, chunk[static_cast<size_t>(row)] + 1);
  return ch.prefix + chunk[static_cast<size_t>(row)] + 1;
}

void StepRows::attend_chunk(int64_t seq, const float* q, int64_t count, int64_t window, float* out,
                            std::vector<float>& scores, std::vector<float>& sums) const {
  const Chunk& c = chunks_.at(seq);
  const int64_t G = model_.n_kv_head, hd = model_.head_dim();
  const int64_t first = window > 0 ? std::max<int64_t>(0, count - window) : 0;
  const auto rows = [&](const float* base) {  // base holds positions c.first, c.first + 1, ...
    return [=, from = c.first](auto&& fn) {
      for (int64_t t = first; t < count; ++t) fn(t, base + (t - from) * G * hd);
    };
  };
  LOOM_CHECK(first >= c.first, "engine: a chunk row attends to position ", first, " before the gathered ", c.first);
  attend_rows(q, out, model_.n_head, G, hd, first, count, rows(c.k.data()), rows(c.v.data()), scores, sums,
              layer_sinks());
}

}  // namespace loom
