// Sampling: greedy picks the argmax; top-k and top-p restrict the support; draws follow the
// distribution and are reproducible from the seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "loom/infer/sampler.h"

namespace loom {
namespace {

const std::vector<float> kLogits = {std::log(0.1f), std::log(0.2f), std::log(0.4f), std::log(0.3f)};

std::map<int32_t, int> histogram(SamplingConfig config, int draws) {
  Sampler sampler(config);
  std::map<int32_t, int> counts;
  for (int i = 0; i < draws; ++i) ++counts[sampler.sample(kLogits.data(), 4)];
  return counts;
}

TEST(SamplerTest, GreedyTakesTheArgmax) {
  Sampler sampler({0.0f, 0, 1.0f, 1});
  EXPECT_EQ(sampler.sample(kLogits.data(), 4), 2);
}

TEST(SamplerTest, TemperatureOneFollowsTheSoftmax) {
  const auto counts = histogram({1.0f, 0, 1.0f, 7}, 40000);
  const double expected[] = {0.1, 0.2, 0.4, 0.3};
  for (int v = 0; v < 4; ++v) EXPECT_NEAR(counts.at(v) / 40000.0, expected[v], 0.01) << v;  // > 4 sigma
}

TEST(SamplerTest, TopKAndTopPRestrictTheSupport) {
  const auto top2 = histogram({1.0f, 2, 1.0f, 7}, 5000);
  EXPECT_EQ(top2.count(0) + top2.count(1), 0u);
  EXPECT_NEAR(top2.at(2) / 5000.0, 0.4 / 0.7, 0.03);
  const auto nucleus = histogram({1.0f, 0, 0.65f, 7}, 5000);  // 0.4 + 0.3 >= 0.65
  EXPECT_EQ(nucleus.count(0) + nucleus.count(1), 0u);
}

// Speculative verification of a one-hot draft (Sampler::verify, Leviathan et al. 2023): whatever
// the draft, the token returned is distributed as sample()'s: the softmax; with top-2, a draft
// outside the support is never kept and the result follows the top-2 distribution; the draft
// comes back exactly when kept (p(draft) of the draws). Greedy: the argmax. A rule that kept
// every draft, or drew the rejection from the full distribution, fails the bounds.
TEST(SamplerTest, VerifyingADraftKeepsTheDistribution) {
  const double softmax[] = {0.1, 0.2, 0.4, 0.3};
  for (int32_t draft = 0; draft < 4; ++draft) {
    Sampler sampler({1.0f, 0, 1.0f, 11 + static_cast<uint64_t>(draft)});
    std::map<int32_t, int> counts;
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) ++counts[sampler.verify(kLogits.data(), 4, draft)];
    for (int v = 0; v < 4; ++v) EXPECT_NEAR(counts[v] / double(draws), softmax[v], 0.01) << "draft " << draft << ", token " << v;
  }
  Sampler top2({1.0f, 2, 1.0f, 5});
  std::map<int32_t, int> counts;
  for (int i = 0; i < 10000; ++i) ++counts[top2.verify(kLogits.data(), 4, 1)];  // token 1 is outside the top 2
  EXPECT_EQ(counts[0] + counts[1], 0);
  EXPECT_NEAR(counts[2] / 10000.0, 0.4 / 0.7, 0.02);
  Sampler greedy({0.0f, 0, 1.0f, 1});
  EXPECT_EQ(greedy.verify(kLogits.data(), 4, 2), 2);
  EXPECT_EQ(greedy.verify(kLogits.data(), 4, 3), 2);
}

TEST(SamplerTest, SameSeedSameDraws) {
  EXPECT_EQ(histogram({0.8f, 3, 0.9f, 11}, 100), histogram({0.8f, 3, 0.9f, 11}, 100));
}

// The sampler's full sort of the candidates is a radix sort: its draws equal those of the
// definition (tokens ordered by probability, ties by token id, the nucleus and the draw's
// target accumulated in double in that order), computed here with std::stable_sort over token
// ids, on logits with many ties (multiples of 0.25), 3 temperatures x 2 top_p x 40 draws.
TEST(SamplerTest, DrawsFollowTheDefinitionOrderWithTies) {
  const int64_t V = 3000;
  std::vector<float> logits(V);
  philox_fill_normal(logits.data(), V, 17, 0, 0, 0.0f, 2.0f);
  for (float& l : logits) l = std::round(l * 4.0f) / 4.0f;
  int64_t checked = 0;
  for (const float temperature : {0.5f, 1.0f, 2.0f}) {
    for (const float top_p : {1.0f, 0.9f}) {
      const uint64_t seed = 99;
      Sampler sampler({temperature, 0, top_p, seed});
      const float max_logit = *std::max_element(logits.begin(), logits.end());
      std::vector<float> p(V);
      for (int64_t v = 0; v < V; ++v) p[v] = std::exp((logits[v] - max_logit) / temperature);
      std::vector<int32_t> order(V);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
      double all = 0.0;
      for (const int32_t t : order) all += p[t];
      size_t kept = order.size();
      if (top_p < 1.0f) {
        double mass = 0.0;
        for (kept = 0; kept < order.size() && mass < top_p * all;) mass += p[order[kept++]];
        all = mass;
      }
      for (uint64_t draw = 0; draw < 40; ++draw) {
        const PhiloxCounter bits = philox4x32_10({static_cast<uint32_t>(draw), 0, 1, 0}, {static_cast<uint32_t>(seed), 0});
        const double target = static_cast<double>(philox_uniform(bits[0])) * all;
        double running = 0.0;
        int32_t want = order[kept - 1];
        for (size_t i = 0; i < kept; ++i) {
          running += p[order[i]];
          if (target < running) {
            want = order[i];
            break;
          }
        }
        ASSERT_EQ(sampler.sample(logits.data(), V), want) << temperature << " " << top_p << " draw " << draw;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 3 * 2 * 40);
}

TEST(SamplerTest, InvalidSettingsNameTheKey) {
  try {
    Sampler sampler({1.0f, 0, 1.5f, 1});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sample.top_p"), std::string::npos);
  }
}

}  // namespace
}  // namespace loom
