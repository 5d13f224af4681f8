// sampler_bench: one draw of the host sampler (infer/sampler.h: the sampling rule of
// backend/sampling_rule.h, candidates ordered by a radix sort) over a Llama-3-sized vocabulary,
// against the same rule computed with std::stable_sort in the same run, and the tokens of both
// compared. Prints milliseconds per draw (best of the rounds) and the ratio, for greedy,
// temperature 0.7, top-p 0.9 and top-k 40.
//
// Usage: sampler_bench [--vocab V] [--draws N] [--rounds R]   (default 128256, 20, 5)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "loom/backend/sampling.h"
#include "loom/core/philox.h"
#include "loom/infer/sampler.h"

using namespace loom;

namespace {

// The rule by its definition with a comparison sort: the reference of the radix-sorted sampler.
int32_t sort_reference(const std::vector<float>& logits, const SamplingConfig& c, uint64_t draw) {
  const int64_t V = static_cast<int64_t>(logits.size());
  if (c.temperature == 0.0f) return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const float m = *std::max_element(logits.begin(), logits.end());
  std::vector<float> p(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) p[v] = sampling::probability(logits[v], m, c.temperature);
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  size_t keep = c.top_k > 0 && c.top_k < V ? static_cast<size_t>(c.top_k) : order.size();
  uint64_t total = 0;
  for (size_t i = 0; i < keep; ++i) total += sampling::weight(p[order[i]]);
  if (c.top_p < 1.0f) {
    uint64_t mass = 0;
    size_t n = 0;
    while (n < keep && static_cast<double>(mass) < static_cast<double>(c.top_p) * static_cast<double>(total)) {
      mass += sampling::weight(p[order[n++]]);
    }
    keep = std::max<size_t>(n, 1), total = n == 0 ? sampling::weight(p[order[0]]) : mass;
  }
  const double x = sample_uniform(c.seed, draw) * static_cast<double>(total);
  uint64_t prefix = 0;
  for (size_t i = 0; i < keep; ++i) {
    prefix += sampling::weight(p[order[i]]);
    if (static_cast<double>(prefix) > x) return order[i];
  }
  return order[0];
}

template <typename F>
double best_ms(int rounds, int draws, F&& f) {
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int d = 0; d < draws; ++d) f(d);
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / draws);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t V = 128256;
  int draws = 20, rounds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--vocab") V = std::stoll(argv[i + 1]);
    else if (a == "--draws") draws = std::stoi(argv[i + 1]);
    else if (a == "--rounds") rounds = std::stoi(argv[i + 1]);
    else return std::fprintf(stderr, "usage: sampler_bench [--vocab V] [--draws N] [--rounds R]\n"), 2;
  }
  std::vector<float> logits(static_cast<size_t>(V));
  philox_fill_normal(logits.data(), V, 7, 0, 0, 0.0f, 3.0f);
  std::printf("sampler_bench: one draw over %lld logits (normal, sd 3), best of %d rounds of %d draws\n",
              static_cast<long long>(V), rounds, draws);
  std::printf("%-22s %12s %14s %8s %s\n", "setting", "sampler ms", "stable_sort ms", "ratio", "same tokens");
  struct Case {
    const char* name;
    SamplingConfig c;
  };
  for (const Case& k : {Case{"greedy", {0.0f, 0, 1.0f, 1}}, Case{"temperature 0.7", {0.7f, 0, 1.0f, 1}},
                        Case{"0.7, top_p 0.9", {0.7f, 0, 0.9f, 1}}, Case{"0.7, top_k 40", {0.7f, 40, 1.0f, 1}}}) {
    Sampler sampler(k.c);
    std::vector<int32_t> got, want;
    const double ms = best_ms(rounds, draws, [&](int) { got.push_back(sampler.sample(logits.data(), V)); });
    const double ref = best_ms(rounds, draws, [&](int d) { want.push_back(sort_reference(logits, k.c, static_cast<uint64_t>(d) % draws)); });
    // The sampler drew rounds x draws times (draw index i); the reference repeats draws 0 .. draws-1.
    bool same = true;
    for (int d = 0; d < draws; ++d) same = same && got[static_cast<size_t>(d)] == want[static_cast<size_t>(d)];
    std::printf("%-22s %12.3f %14.3f %7.2fx %s\n", k.name, ms, ref, ref / ms, same ? "yes" : "NO");
  }
  return 0;
}
