// Shared by the KV-cache tests (test_kv_cache.cpp, test_kv_cache_window.cpp): deterministic K/V
// rows, a float64 attention reference and small cache configurations; and by the decoding tests
// (test_engine.cpp, test_lora.cpp): CacheRows, forward_rows' DecodeCache over a KvCache.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "loom/arch/config.h"
#include "loom/core/philox.h"
#include "loom/infer/kv_cache.h"
#include "loom/nn/layer.h"

namespace loom::kvtest {

// Transformer::forward_rows' cache for MHA / GQA models: row r of a call writes and attends to
// sequence seqs[r] of `cache`.
struct CacheRows : DecodeCache {
  KvCache* cache = nullptr;
  const ModelConfig* config = nullptr;
  std::vector<int64_t> seqs;
  void attend(int64_t layer, int64_t row, const float* q, const float* k, const float* v, float* out) override {
    const int64_t seq = seqs[static_cast<size_t>(row)];
    cache->write(seq, layer, k, v);
    cache->attend(seq, layer, q, out, config->n_head, config->n_kv_head, config->head_dim(), config->layer_window(layer));
  }
  const float* latent(int64_t, int64_t, const float*, int64_t*) override { return nullptr; }
};

// Deterministic rows: K and V of (tag, layer, position) are normal(0, 1), independent across
// all four. `tags[p]` says which tag position p of a sequence was written with.
struct Rows {
  int64_t kw, vw;

  std::vector<float> k(uint64_t tag, int64_t layer, int64_t pos) const { return draw(tag, 2 * layer, pos, kw); }
  std::vector<float> v(uint64_t tag, int64_t layer, int64_t pos) const { return draw(tag, 2 * layer + 1, pos, vw); }

  // (positions, width) rows of a layer for positions written with tags[p].
  std::vector<float> stack(const std::vector<uint64_t>& tags, int64_t layer, bool values) const {
    const int64_t w = values ? vw : kw;
    std::vector<float> out;
    for (size_t p = 0; p < tags.size(); ++p) {
      const std::vector<float> row = values ? v(tags[p], layer, static_cast<int64_t>(p)) : k(tags[p], layer, static_cast<int64_t>(p));
      out.insert(out.end(), row.begin(), row.begin() + w);
    }
    return out;
  }

 private:
  static std::vector<float> draw(uint64_t tag, int64_t stream, int64_t pos, int64_t width) {
    std::vector<float> x(static_cast<size_t>(std::max<int64_t>(width, 1)));
    philox_fill_normal(x.data(), width, 1000 + tag, static_cast<uint32_t>(stream), pos * width, 0.0f, 1.0f);
    return x;
  }
};

// Writes positions [length, end) of every layer with rows of `tag`.
inline void fill(KvCache& cache, int64_t seq, const Rows& rows, uint64_t tag, int64_t end) {
  for (int64_t p = cache.length(seq); p < end; ++p) {
    for (int64_t l = 0; l < cache.config().n_layer; ++l) cache.write(seq, l, rows.k(tag, l, p).data(), rows.v(tag, l, p).data());
    cache.advance(seq);
  }
}

// Two-pass softmax attention in float64 over rows [first, n) of K (n, kw) and V (n, vw).
inline std::vector<double> reference_attention(const std::vector<float>& K, const std::vector<float>& V, const float* q,
                                        int64_t n_head, int64_t n_kv_head, int64_t hd, int64_t first, int64_t n) {
  const int64_t kw = n_kv_head * hd, group = n_head / n_kv_head;
  std::vector<double> out(static_cast<size_t>(n_head * hd), 0.0);
  for (int64_t h = 0; h < n_head; ++h) {
    const int64_t g = h / group;
    std::vector<double> s;
    for (int64_t t = first; t < n; ++t) {
      double dot = 0.0;
      for (int64_t d = 0; d < hd; ++d) dot += static_cast<double>(q[h * hd + d]) * K[t * kw + g * hd + d];
      s.push_back(dot / std::sqrt(static_cast<double>(hd)));
    }
    const double m = *std::max_element(s.begin(), s.end());
    double sum = 0.0;
    for (double& x : s) sum += (x = std::exp(x - m));
    for (int64_t t = first; t < n; ++t) {
      for (int64_t d = 0; d < hd; ++d) out[h * hd + d] += s[t - first] / sum * V[t * kw + g * hd + d];
    }
  }
  return out;
}

// max |a - b| / max |b|
inline double relative_max_error(const std::vector<float>& a, const std::vector<double>& b) {
  double err = 0.0, scale = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return err / scale;
}

inline std::vector<float> query(int64_t n, uint64_t seed, float stddev = 1.0f) {
  std::vector<float> q(static_cast<size_t>(n));
  philox_fill_normal(q.data(), n, seed, 7, 0, 0.0f, stddev);
  return q;
}

// GQA: 4 query heads over 2 kv heads of 8.
constexpr int64_t kHeads = 4, kKvHeads = 2, kHeadDim = 8, kWidth = kKvHeads * kHeadDim;

inline KvCacheConfig small_config() {
  KvCacheConfig c;
  c.n_layer = 2;
  c.k_width = c.v_width = kWidth;
  c.block_size = 16;
  c.num_blocks = 16;
  c.max_len = 64;
  return c;
}

inline KvCacheConfig kivi(KvCacheConfig c, KvFormat format, int64_t group, int64_t residual) {
  c.k_format = c.v_format = format;
  c.k_axis = KV_PER_CHANNEL;
  c.v_axis = KV_PER_TOKEN;
  c.group = group;
  c.residual = residual;
  return c;
}

inline std::vector<float> attend(KvCache& cache, int64_t seq, int64_t layer, const std::vector<float>& q, int64_t window,
                          int64_t n_head = kHeads, int64_t n_kv_head = kKvHeads, int64_t hd = kHeadDim) {
  std::vector<float> out(static_cast<size_t>(n_head * hd));
  cache.attend(seq, layer, q.data(), out.data(), n_head, n_kv_head, hd, window);
  return out;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace loom::kvtest
