// The decoding attention of one position over a sequence's cached rows, written once for the
// KV cache (KvCache::attend, rows walked tile by tile) and the generation engine's prompt chunks
// (rows gathered in one array): for query head h (kv head h / (n_head / n_kv_head)) over the
// visible positions [first, n),
//     s_t = (q_h . k_t) / sqrt(head_dim),  p_t = exp(s_t - max s) / sum_t exp(s_t - max s),
//     out_h = sum_t p_t v_t,
// and with attention sinks (GPT-OSS: one learned logit s_h per query head, a position whose value
// is zero) the normalizer takes exp(s_h - m) more, m the max over the scores and s_h:
//     p_t = exp(s_t - m) / (exp(s_h - m) + sum_t exp(s_t - m)),
// two passes in fp32 over positions in increasing order, so the same rows give bitwise the same
// output whichever caller hands them out.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace loom {

// q . k over n floats, eight partial sums (so the loop vectorizes) combined in a fixed order.
inline float attend_dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  }
  float acc = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// q: (n_head, head_dim), out: (n_head, head_dim). each_k(fn) and each_v(fn) call fn(t, row) for
// t = first .. n - 1 in order, row the position's (n_kv_head, head_dim) keys or values.
// scores and sums are scratch, reused across calls. sinks: (n_head) sink logits, or null (none).
template <typename EachK, typename EachV>
void attend_rows(const float* q, float* out, int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t first,
                 int64_t n, EachK&& each_k, EachV&& each_v, std::vector<float>& scores_buffer,
                 std::vector<float>& sums, const float* sinks = nullptr) {
  const int64_t positions = n - first, group = n_head / n_kv_head;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (scores_buffer.size() < static_cast<size_t>(n_head * positions)) scores_buffer.resize(static_cast<size_t>(n_head * positions));
  float* scores = scores_buffer.data();  // (n_head, positions)
  each_k([&](int64_t t, const float* k) {
    for (int64_t h = 0; h < n_head; ++h) {
      scores[h * positions + t - first] = attend_dot(q + h * head_dim, k + h / group * head_dim, head_dim) * scale;
    }
  });
  sums.resize(static_cast<size_t>(n_head));
  for (int64_t h = 0; h < n_head; ++h) {
    float* row = scores + h * positions;
    float m = row[0];
    for (int64_t i = 1; i < positions; ++i) m = std::max(m, row[i]);
    if (sinks != nullptr) m = std::max(m, sinks[h]);
    float sum = 0.0f;
    for (int64_t i = 0; i < positions; ++i) {
      row[i] = std::exp(row[i] - m);
      sum += row[i];
    }
    if (sinks != nullptr) sum += std::exp(sinks[h] - m);
    sums[static_cast<size_t>(h)] = sum;
  }
  std::fill(out, out + n_head * head_dim, 0.0f);
  each_v([&](int64_t t, const float* v) {
    for (int64_t h = 0; h < n_head; ++h) {
      const float w = scores[h * positions + t - first];
      const float* vh = v + h / group * head_dim;
      float* o = out + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += w * vh[d];
    }
  });
  for (int64_t h = 0; h < n_head; ++h) {
    for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] /= sums[static_cast<size_t>(h)];
  }
}

}  // namespace loom
