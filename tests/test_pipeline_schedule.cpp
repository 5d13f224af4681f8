// Pipeline schedules as data and their simulation: every schedule runs each (model stage,
// micro-batch, op) once on the rank that owns the stage, and with unit costs the simulator
// reproduces the published bubbles (GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (1/v)(p-1)/m of
// the ideal time, Narayanan et al. 2021; ZB-H1: (p-1)(T_F+T_B-T_W), Qi et al. 2024) and the peak
// counts of live micro-batch activations.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "loom/core/error.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/pipeline_schedule.h"
#include "test_util.h"

namespace loom {
using test::error_of;
namespace {

struct PipeShape {
  int p, m, v;
};

// Every (p, m, v) the structural tests run, per kind; m < p included where the kind allows it.
std::vector<PipeShape> shapes_of(const std::string& kind) {
  if (kind == "interleaved") return {{1, 2, 2}, {2, 2, 2}, {2, 4, 3}, {4, 4, 2}, {4, 8, 2}, {3, 9, 2}, {4, 12, 4}};
  return {{1, 1, 1}, {1, 4, 1}, {2, 1, 1}, {3, 2, 1}, {4, 3, 1}, {4, 4, 1}, {4, 8, 1}, {5, 7, 1}, {8, 16, 1}};
}

TEST(PipeSchedule, EveryActionOnceOnTheRankOwningItsStage) {
  for (const std::string& kind : pipe_schedule_kinds()) {
    for (const PipeShape& sh : shapes_of(kind)) {
      SCOPED_TRACE(kind + " p=" + std::to_string(sh.p) + " m=" + std::to_string(sh.m) + " v=" + std::to_string(sh.v));
      const PipeSchedule s = make_pipe_schedule(kind, sh.p, sh.m, sh.v);
      ASSERT_EQ(static_cast<int>(s.per_rank.size()), sh.p);
      EXPECT_EQ(s.split_backward, kind == "zb-h1");
      std::map<std::tuple<int, int, int>, int> count;  // (model stage, micro, op) -> times run
      for (int r = 0; r < sh.p; ++r) {
        for (const PipeAction& a : s.per_rank[static_cast<size_t>(r)]) {
          ASSERT_TRUE(a.chunk >= 0 && a.chunk < sh.v && a.micro >= 0 && a.micro < sh.m);
          const int stage = s.stage_of(r, a.chunk);
          EXPECT_EQ(s.rank_of(stage), r);
          EXPECT_EQ(s.chunk_of(stage), a.chunk);
          ++count[{stage, a.micro, a.op}];
        }
      }
      const int ops = s.split_backward ? 3 : 2;
      EXPECT_EQ(static_cast<int>(count.size()), sh.p * sh.v * sh.m * ops);
      for (int stage = 0; stage < sh.p * sh.v; ++stage) {
        for (int i = 0; i < sh.m; ++i) {
          for (int op = 0; op < ops; ++op) EXPECT_EQ((count[{stage, i, op}]), 1);
        }
      }
      EXPECT_NO_THROW(validate_pipe_schedule(s));
      const PipeSimulation sim = simulate(s, PipeCosts{1, 1, s.split_backward ? 1.0 : 0.0, 0});
      EXPECT_GT(sim.makespan, 0);
    }
  }
}

TEST(PipeSchedule, DescribesEachRankInOrder) {
  EXPECT_EQ(describe_schedule(make_pipe_schedule("gpipe", 2, 2)), "rank 0: F0 F1 B0 B1\nrank 1: F0 F1 B0 B1\n");
  EXPECT_EQ(describe_schedule(make_pipe_schedule("1f1b", 2, 3)), "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2\n");
  EXPECT_EQ(describe_schedule(make_pipe_schedule("interleaved", 2, 2, 2)),
            "rank 0: F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0\n"
            "rank 1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0\n");
  // ZB-H1: rank r runs W(i) right after B(i+r), the rest at the end.
  EXPECT_EQ(describe_schedule(make_pipe_schedule("zb-h1", 2, 3)),
            "rank 0: F0 F1 B0 W0 F2 B1 W1 B2 W2\n"
            "rank 1: F0 B0 F1 B1 W0 F2 B2 W1 W2\n");
}

TEST(PipeSchedule, LinksFollowTheModelStages) {
  const PipeSchedule s = make_pipe_schedule("interleaved", 2, 2, 2);  // stages 0,1,2,3 on ranks 0,1,0,1
  EXPECT_EQ(pipe_links(s, 0, {0, 0, PIPE_F}).recv_from, -1);
  EXPECT_EQ(pipe_links(s, 0, {0, 0, PIPE_F}).send_to, 1);
  EXPECT_EQ(pipe_links(s, 1, {0, 0, PIPE_F}).send_to, 0);  // stage 1 -> stage 2 (rank 0, chunk 1)
  EXPECT_EQ(pipe_links(s, 1, {1, 0, PIPE_F}).recv_from, 0);
  EXPECT_EQ(pipe_links(s, 1, {1, 0, PIPE_F}).send_to, -1);  // the last stage feeds the loss
  EXPECT_EQ(pipe_links(s, 1, {1, 0, PIPE_B}).recv_from, -1);
  EXPECT_EQ(pipe_links(s, 1, {1, 0, PIPE_B}).send_to, 0);
  EXPECT_EQ(pipe_links(s, 0, {0, 0, PIPE_B}).recv_from, 1);
  EXPECT_EQ(pipe_links(s, 0, {0, 0, PIPE_B}).send_to, -1);
  const PipeSchedule zb = make_pipe_schedule("zb-h1", 1, 1);
  EXPECT_EQ(pipe_links(zb, 0, {0, 0, PIPE_W}).recv_from, -1);
  EXPECT_EQ(pipe_links(zb, 0, {0, 0, PIPE_W}).send_to, -1);
}

// Unit costs: makespan (m+p-1)(f+b), so the bubble is (p-1)/(m+p-1) of the time, m < p included.
TEST(PipeSchedule, GPipeAnd1F1BBubbleIsPMinusOneOverMPlusPMinusOne) {
  for (const std::string kind : {"gpipe", "1f1b"}) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int m : {1, 2, 3, 4, 8, 16}) {
        SCOPED_TRACE(kind + std::string(" p=") + std::to_string(p) + " m=" + std::to_string(m));
        const PipeSimulation sim = simulate(make_pipe_schedule(kind, p, m), PipeCosts{1, 1, 0, 0});
        EXPECT_DOUBLE_EQ(sim.makespan, 2.0 * (m + p - 1));
        EXPECT_NEAR(sim.bubble_fraction, static_cast<double>(p - 1) / (m + p - 1), 1e-12);
        for (int r = 0; r < p; ++r) EXPECT_DOUBLE_EQ(sim.idle[static_cast<size_t>(r)], 2.0 * (p - 1));
      }
    }
  }
}

// Each chunk op costs 1/v of a full stage's: idle per rank (p-1)(f+b)/v with full-stage f = b = 1,
// i.e. bubble/ideal = (1/v)(p-1)/m, 1/v of 1F1B's (Narayanan et al. 2021, section 2.2).
TEST(PipeSchedule, InterleavedBubbleIsOneOverVOf1F1B) {
  for (const PipeShape& sh : shapes_of("interleaved")) {
    SCOPED_TRACE("p=" + std::to_string(sh.p) + " m=" + std::to_string(sh.m) + " v=" + std::to_string(sh.v));
    const double chunk = 1.0 / sh.v;
    const PipeSimulation sim = simulate(make_pipe_schedule("interleaved", sh.p, sh.m, sh.v), PipeCosts{chunk, chunk, 0, 0});
    const double ideal = sh.m * 2.0;  // m micro-batches of f + b = 2 per rank
    for (int r = 0; r < sh.p; ++r) {
      EXPECT_NEAR(sim.busy[static_cast<size_t>(r)], ideal, 1e-12);
      EXPECT_NEAR(sim.idle[static_cast<size_t>(r)], (sh.p - 1) * 2.0 / sh.v, 1e-12);
      EXPECT_NEAR(sim.idle[static_cast<size_t>(r)] / ideal, (sh.p - 1) / (static_cast<double>(sh.v) * sh.m), 1e-12);
    }
  }
}

// f = b = w = 1: ZB-H1 idles (p-1)(f+b-w) = p-1 per rank, a third of 1F1B's (p-1)(f+b+w).
TEST(PipeSchedule, ZeroBubbleH1IdlesAThirdOf1F1BWithEqualCosts) {
  const PipeCosts unit{1, 1, 1, 0};
  for (int p : {1, 2, 3, 4, 5, 8}) {
    for (int m : {p, p + 1, 2 * p, 3 * p + 2}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const PipeSimulation zb = simulate(make_pipe_schedule("zb-h1", p, m), unit);
      const PipeSimulation base = simulate(make_pipe_schedule("1f1b", p, m), unit);  // B costs b + w = 2
      EXPECT_DOUBLE_EQ(zb.makespan - 3.0 * m, p - 1.0);
      EXPECT_DOUBLE_EQ(base.makespan - 3.0 * m, 3.0 * (p - 1));
      for (int r = 0; r < p; ++r) {
        EXPECT_DOUBLE_EQ(zb.idle[static_cast<size_t>(r)], (p - 1) * (1.0 + 1.0 - 1.0));
        EXPECT_DOUBLE_EQ(base.idle[static_cast<size_t>(r)], (p - 1) * (1.0 + 1.0 + 1.0));
        EXPECT_DOUBLE_EQ(3.0 * zb.idle[static_cast<size_t>(r)], base.idle[static_cast<size_t>(r)]);
      }
    }
  }
}

// The formula holds for unequal costs too while T_W <= T_F: f = 1, b = 1.5, w = 0.5 -> 2(p-1).
TEST(PipeSchedule, ZeroBubbleH1BubbleWithUnequalCosts) {
  for (int p : {2, 4, 6}) {
    const PipeSimulation zb = simulate(make_pipe_schedule("zb-h1", p, 2 * p), PipeCosts{1, 1.5, 0.5, 0});
    for (double idle : zb.idle) EXPECT_DOUBLE_EQ(idle, (p - 1) * (1 + 1.5 - 0.5));
  }
}

// Fewer micro-batches than ranks: no formula, but never slower than 1F1B.
TEST(PipeSchedule, ZeroBubbleH1NeverSlowerThan1F1B) {
  for (int p : {2, 4, 8}) {
    for (int m : {1, 2, 3, p, 2 * p}) {
      const PipeCosts unit{1, 1, 1, 0};
      EXPECT_LE(simulate(make_pipe_schedule("zb-h1", p, m), unit).makespan,
                simulate(make_pipe_schedule("1f1b", p, m), unit).makespan);
    }
  }
}

TEST(PipeSchedule, PeakLiveActivations) {
  for (int p : {1, 2, 4, 8}) {
    for (int m : {1, 2, 3, 4, 8, 16}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const PipeCosts costs{1, 1, 1, 0};
      const PipeSimulation gpipe = simulate(make_pipe_schedule("gpipe", p, m), costs);
      const PipeSimulation one = simulate(make_pipe_schedule("1f1b", p, m), costs);
      const PipeSimulation zb = simulate(make_pipe_schedule("zb-h1", p, m), costs);
      for (int r = 0; r < p; ++r) {
        const size_t i = static_cast<size_t>(r);
        EXPECT_EQ(gpipe.peak_live[i], m);
        EXPECT_EQ(gpipe.peak_held[i], m);
        EXPECT_EQ(one.peak_live[i], std::min(p - r, m));
        EXPECT_EQ(one.peak_held[i], std::min(p - r, m));
        // ZB-H1 keeps 1F1B's F/B order: the same live activations (F to B) on every rank ...
        EXPECT_EQ(zb.peak_live[i], one.peak_live[i]);
        // ... and, counting until W, never more than 1F1B's peak (rank 0's) on any rank.
        EXPECT_EQ(zb.peak_held[i], std::min(p, m));
      }
    }
  }
}

// Interleaved: rank r holds its 2(p-r-1) + (v-1)p warm-up forwards plus one, in chunk-micro
// pairs (each 1/v of a stage's activations), at most all m*v of them.
TEST(PipeSchedule, InterleavedPeakLiveIsWarmupPlusOne) {
  for (const PipeShape& sh : shapes_of("interleaved")) {
    const PipeSimulation sim = simulate(make_pipe_schedule("interleaved", sh.p, sh.m, sh.v), PipeCosts{});
    for (int r = 0; r < sh.p; ++r) {
      EXPECT_EQ(sim.peak_live[static_cast<size_t>(r)], std::min(2 * (sh.p - r - 1) + (sh.v - 1) * sh.p + 1, sh.m * sh.v));
    }
  }
  const PipeSimulation p4 = simulate(make_pipe_schedule("interleaved", 4, 8, 2), PipeCosts{});
  EXPECT_EQ(p4.peak_live, (std::vector<int>{11, 9, 7, 5}));
}

// A dependency that crosses ranks waits p2p: GPipe on 2 ranks, 1 micro-batch: F, p2p, F, B, p2p, B.
TEST(PipeSchedule, PointToPointDelaysCrossRankDependencies) {
  EXPECT_DOUBLE_EQ(simulate(make_pipe_schedule("gpipe", 2, 1), PipeCosts{1, 1, 0, 0.5}).makespan, 5.0);
  EXPECT_DOUBLE_EQ(simulate(make_pipe_schedule("1f1b", 1, 3), PipeCosts{1, 1, 0, 0.5}).makespan, 6.0);
}

TEST(PipeSchedule, DeadlockNamesTheScheduleAndRank) {
  PipeSchedule s = make_pipe_schedule("1f1b", 2, 1);
  s.per_rank[0] = {{0, 0, PIPE_B}, {0, 0, PIPE_F}};  // rank 0 waits for a backward that needs its forward
  const std::string message = error_of([&] { simulate(s, PipeCosts{}); });
  EXPECT_NE(message.find("pipeline schedule '1f1b'"), std::string::npos) << message;
  EXPECT_NE(message.find("deadlocks: rank 0 waits at step 0 (B0) for B0 on rank 1"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos);
}

TEST(PipeSchedule, RejectsMissingAndRepeatedActions) {
  PipeSchedule s = make_pipe_schedule("zb-h1", 2, 2);
  s.per_rank[1].pop_back();
  EXPECT_NE(error_of([&] { validate_pipe_schedule(s); }).find("rank 1 never runs W1"), std::string::npos);
  s.per_rank[1].push_back({0, 0, PIPE_W});
  EXPECT_NE(error_of([&] { simulate(s, PipeCosts{}); }).find("rank 1 runs W0 twice"), std::string::npos);
  PipeSchedule unsplit = make_pipe_schedule("1f1b", 2, 2);
  unsplit.per_rank[0].push_back({0, 0, PIPE_W});
  EXPECT_NE(error_of([&] { validate_pipe_schedule(unsplit); }).find("is a W"), std::string::npos);
  EXPECT_NE(error_of([&] { simulate(make_pipe_schedule("gpipe", 2, 2), PipeCosts{-1, 1, 0, 0}); }).find("non-negative"),
            std::string::npos);
}

TEST(PipeSchedule, OneLineErrorsNameTheKey) {
  const auto expect_error = [](const std::function<void()>& f, const std::string& key) {
    const std::string message = error_of(f);
    EXPECT_NE(message.find(key), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  };
  expect_error([] { make_pipe_schedule("pipedream", 4, 8); }, "parallel.schedule = 'pipedream'");
  expect_error([] { make_pipe_schedule("1f1b", 0, 8); }, "parallel.pp = 0");
  expect_error([] { make_pipe_schedule("1f1b", 4, 0); }, "parallel.micro_batches = 0");
  expect_error([] { make_pipe_schedule("interleaved", 4, 6, 2); }, "parallel.micro_batches = 6");
  expect_error([] { make_pipe_schedule("interleaved", 4, 8, 1); }, "parallel.virtual_stages = 1");
  expect_error([] { make_pipe_schedule("1f1b", 4, 8, 2); }, "parallel.virtual_stages = 2");
  expect_error([] { make_pipe_schedule("gpipe", 4, 8, 0); }, "parallel.virtual_stages = 0");
  expect_error([] { make_pipe_schedule("1f1b", 1 << 13, 1 << 12); }, "parallel.pp x parallel.micro_batches");
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// The cost-balanced split: the smallest possible largest stage cost (against every contiguous
// split, enumerated), even without end costs, and a large head (GPT-2's 50257-token vocabulary)
// moves layers off the last stage.
TEST(PipeSchedule, StageSplitMinimisesTheLargestStageCost) {
  const auto largest = [](const std::vector<std::pair<int64_t, int64_t>>& split, double first, double last) {
    double worst = 0.0;
    for (size_t s = 0; s < split.size(); ++s) {
      worst = std::max(worst, static_cast<double>(split[s].second - split[s].first) + (s == 0 ? first : 0.0) +
                                  (s + 1 == split.size() ? last : 0.0));
    }
    return worst;
  };
  EXPECT_EQ(pipeline_layer_split(5, 2), (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 5}}));
  EXPECT_EQ(pipeline_layer_split(8, 4), (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  for (const double last : {0.0, 1.5, 3.0, 7.0}) {
    const auto split = pipeline_layer_split(10, 3, 1.0, 0.5, last);
    ASSERT_EQ(split.front().first, 0);
    ASSERT_EQ(split.back().second, 10);
    double best = 1e300;  // every split of 10 layers into 3 non-empty stages: cuts a < b
    for (int64_t a = 1; a < 10; ++a) {
      for (int64_t b = a + 1; b < 10; ++b) best = std::min(best, largest({{0, a}, {a, b}, {b, 10}}, 0.5, last));
    }
    EXPECT_DOUBLE_EQ(largest(split, 0.5, last), best) << "last stage cost " << last;
  }
  ModelConfig gpt2 = model_preset("gpt2-124m");  // 12 layers; the head is ~5 layers' forward FLOPs
  const auto split = pipeline_stage_split(gpt2, 4, 1024);
  EXPECT_LT(split.back().second - split.back().first, 3);
  EXPECT_THROW(pipeline_layer_split(2, 3), Error);
}

}  // namespace
}  // namespace loom
