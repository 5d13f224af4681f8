// Sampling: greedy picks the argmax; top-k and top-p restrict the support; draws follow the
// distribution and are reproducible from the seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "loom/core/error.h"
#include "loom/backend/scalar_math.h"
#include "loom/backend/sampling.h"
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

// A draft model's proposal and its verification (Sampler::propose, verify with q; Leviathan et
// al. 2023, Algorithm 1): propose() draws from and writes the distribution sample() draws from
// (here with top-3); a draft drawn from a proposal q unlike p, verified against q, comes out
// distributed as p (the softmax), for two different q and also with top-2 on the target's side
// (a q putting mass outside p's support), and is kept with probability sum min(p, q), more than
// the one-hot rule's sum p q (which keeps the distribution too, at a lower acceptance). The
// broken variant, keeping with min(1, p / q) but redrawing a rejection from p instead of the
// residual max(0, p - q), is measurably skewed toward q.
TEST(SamplerTest, VerifyingADraftModelsProposalKeepsTheDistribution) {
  Sampler drafter({1.0f, 3, 1.0f, 21});
  std::vector<float> q(4, -1.0f);
  std::map<int32_t, int> proposed;
  for (int i = 0; i < 20000; ++i) ++proposed[drafter.propose(kLogits.data(), 4, q.data())];
  const double top3[] = {0.0, 0.2 / 0.9, 0.4 / 0.9, 0.3 / 0.9};
  for (int v = 0; v < 4; ++v) EXPECT_NEAR(q[v], top3[v], 1e-6) << v;
  EXPECT_EQ(proposed.count(0), 0u);
  EXPECT_NEAR(proposed[2] / 20000.0, 0.4 / 0.9, 0.015);
  const double softmax[] = {0.1, 0.2, 0.4, 0.3};
  const std::vector<std::vector<float>> proposals = {{0.7f, 0.1f, 0.1f, 0.1f}, {0.0f, 0.05f, 0.9f, 0.05f}};
  enum Rule { kResidual, kOneHot, kBroken };
  const int draws = 40000;
  const auto run = [&](const std::vector<float>& qd, SamplingConfig target, Rule rule, std::vector<double>& freq) {
    Sampler sampler(target);
    std::vector<double> cumulative(4);
    std::partial_sum(qd.begin(), qd.end(), cumulative.begin());
    freq.assign(4, 0.0);
    double kept = 0.0;
    for (int i = 0; i < draws; ++i) {
      const auto uniform = [&](uint32_t stream) {
        return philox_uniform(philox4x32_10({static_cast<uint32_t>(i), 0, stream, 0}, {3, 4})[0]);
      };
      const double u = uniform(9) * cumulative.back();
      const auto draft = static_cast<int32_t>(std::upper_bound(cumulative.begin(), cumulative.end(), u) - cumulative.begin());
      int32_t token = 0;
      if (rule == kResidual) token = sampler.verify(kLogits.data(), 4, draft, qd.data());
      if (rule == kOneHot) token = sampler.verify(kLogits.data(), 4, draft);
      if (rule == kBroken) token = uniform(10) * qd[draft] < softmax[draft] ? draft : sampler.sample(kLogits.data(), 4);
      freq[static_cast<size_t>(token)] += 1.0 / draws;
      kept += token == draft ? 1.0 / draws : 0.0;
    }
    return kept;
  };
  std::vector<double> freq;
  for (const auto& qd : proposals) {
    double overlap = 0.0, product = 0.0;
    for (int v = 0; v < 4; ++v) overlap += std::min<double>(softmax[v], qd[v]), product += softmax[v] * qd[v];
    const double kept = run(qd, {1.0f, 0, 1.0f, 13}, kResidual, freq);
    for (int v = 0; v < 4; ++v) EXPECT_NEAR(freq[v], softmax[v], 0.01) << "q[0] " << qd[0] << ", token " << v;  // > 4 sigma
    EXPECT_NEAR(kept, overlap, 0.01) << "q[0] " << qd[0];
    EXPECT_NEAR(run(qd, {1.0f, 0, 1.0f, 13}, kOneHot, freq), product, 0.01) << "q[0] " << qd[0];
    for (int v = 0; v < 4; ++v) EXPECT_NEAR(freq[v], softmax[v], 0.01) << "one-hot, token " << v;
    run(qd, {1.0f, 0, 1.0f, 13}, kBroken, freq);
    double off = 0.0;
    for (int v = 0; v < 4; ++v) off = std::max(off, std::fabs(freq[v] - softmax[v]));
    EXPECT_GT(off, 0.05) << "q[0] " << qd[0];
    run(qd, {1.0f, 2, 1.0f, 17}, kResidual, freq);  // the target keeps tokens 2 and 3
    EXPECT_EQ(freq[0] + freq[1], 0.0);
    EXPECT_NEAR(freq[2], 0.4 / 0.7, 0.012) << "q[0] " << qd[0];
  }
  Sampler greedy({0.0f, 0, 1.0f, 1});
  EXPECT_EQ(greedy.propose(kLogits.data(), 4, q.data()), 2);
  EXPECT_EQ(greedy.verify(kLogits.data(), 4, 3, proposals[0].data()), 2);
}

TEST(SamplerTest, SameSeedSameDraws) {
  EXPECT_EQ(histogram({0.8f, 3, 0.9f, 11}, 100), histogram({0.8f, 3, 0.9f, 11}, 100));
}

// The sampler's draws are the rule's (backend/sampling_rule.h), computed here from its definition
// with other code: the tokens ordered by std::stable_sort on p (ties by token id), integer weights
// floor(p 2^32) summed in order, the nucleus the first prefix reaching top_p x the kept sum, the
// token the first prefix above u x the kept sum. On logits with many ties (multiples of 0.25) and
// a few -inf, 3 temperatures x 2 top_k x 2 top_p x 40 draws. The backend's draw (sample_row from
// Sampler::row(), counted by took()) is the same token, so a backend may draw in the sampler's place.
TEST(SamplerTest, DrawsFollowTheRulesDefinitionWithTies) {
  const int64_t V = 3000;
  std::vector<float> logits(V);
  philox_fill_normal(logits.data(), V, 17, 0, 0, 0.0f, 2.0f);
  for (float& l : logits) l = std::round(l * 4.0f) / 4.0f;
  for (int64_t v = 3; v < V; v += 301) logits[v] = -INFINITY;
  int64_t checked = 0;
  for (const float temperature : {0.5f, 1.0f, 2.0f}) {
    for (const int64_t top_k : {int64_t{0}, int64_t{30}}) {
      for (const float top_p : {1.0f, 0.9f}) {
        const uint64_t seed = 99;
        Sampler sampler({temperature, top_k, top_p, seed});
        Sampler twin({temperature, top_k, top_p, seed});
        const float max_logit = *std::max_element(logits.begin(), logits.end());
        std::vector<float> p(V);
        for (int64_t v = 0; v < V; ++v) p[v] = math::fast_exp((logits[v] - max_logit) / temperature);
        std::vector<int32_t> order(V);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
        const auto w = [&](size_t i) { return static_cast<uint64_t>(std::ldexp(static_cast<double>(p[order[i]]), 32)); };
        size_t kept = top_k > 0 ? static_cast<size_t>(top_k) : order.size();
        uint64_t all = 0;
        for (size_t i = 0; i < kept; ++i) all += w(i);
        if (top_p < 1.0f) {
          uint64_t mass = 0;
          size_t i = 0;
          while (static_cast<double>(mass) < static_cast<double>(top_p) * static_cast<double>(all)) mass += w(i++);
          kept = i, all = mass;
        }
        for (uint64_t draw = 0; draw < 40; ++draw) {
          const PhiloxCounter bits = philox4x32_10({static_cast<uint32_t>(draw), 0, 1, 0}, {static_cast<uint32_t>(seed), 0});
          const double target = static_cast<double>(philox_uniform(bits[0])) * static_cast<double>(all);
          uint64_t running = 0;
          int32_t want = -1;
          for (size_t i = 0; i < kept && want < 0; ++i) {
            running += w(i);
            if (static_cast<double>(running) > target) want = order[i];
          }
          ASSERT_EQ(sampler.sample(logits.data(), V), want) << temperature << " " << top_k << " " << top_p << " draw " << draw;
          SampleCandidates scratch;
          ASSERT_EQ(twin.took(sample_row(logits.data(), V, twin.row(), scratch)), want) << "draw " << draw;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 2 * 2 * 40);
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
