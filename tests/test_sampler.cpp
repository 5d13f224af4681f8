// Sampling: greedy picks the argmax; top-k and top-p restrict the support; draws follow the
// distribution and are reproducible from the seed.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "loom/core/error.h"
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

TEST(SamplerTest, SameSeedSameDraws) {
  EXPECT_EQ(histogram({0.8f, 3, 0.9f, 11}, 100), histogram({0.8f, 3, 0.9f, 11}, 100));
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
