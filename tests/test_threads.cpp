// The short-region team of core/threads.h: every index of a region runs once, split as OpenMP's
// schedule(static) splits, on the team's threads (reused, not started per call), through sleeps
// longer than the spin window, beside a second caller and inside an OpenMP region.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "loom/core/threads.h"

namespace loom {
namespace {

struct Parts {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::set<std::thread::id> threads;
};

// Runs one region over `count` and checks that its parts tile [0, count) as schedule(static) does.
Parts run_and_check(int64_t count, int threads) {
  Parts p;
  std::mutex mutex;
  std::vector<std::atomic<int>> hits(static_cast<size_t>(count));
  short_region(count, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
    std::lock_guard<std::mutex> lock(mutex);
    p.ranges.emplace_back(begin, end);
    p.threads.insert(std::this_thread::get_id());
  });
  for (int64_t i = 0; i < count; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "index " << i << " of " << count;
  std::sort(p.ranges.begin(), p.ranges.end());
  EXPECT_EQ(p.ranges.size(), static_cast<size_t>(std::min<int64_t>(count, threads)));
  int64_t next = 0;
  for (const auto& [begin, end] : p.ranges) {
    EXPECT_EQ(begin, next);
    const int64_t len = end - begin, q = count / threads;
    EXPECT_TRUE(len == q || len == q + 1) << "part [" << begin << ", " << end << ") of " << count;
    next = end;
  }
  EXPECT_EQ(next, count);
  return p;
}

class ShortRegion : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = omp_get_max_threads(); }
  void TearDown() override { omp_set_num_threads(saved_); }
  int saved_ = 1;
};

TEST_F(ShortRegion, EveryIndexRunsOnceInStaticParts) {
  omp_set_num_threads(2);
  for (const int64_t count : {1, 2, 3, 7, 1000, 14336}) run_and_check(count, 2);
  short_region(0, [](int64_t, int64_t) { ADD_FAILURE() << "an empty region ran"; });
}

TEST_F(ShortRegion, RunsOnTheTeamsThreadsWhichAreReused) {
  omp_set_num_threads(2);
  run_and_check(64, 2);
  const int64_t started = short_region_threads_started();
  std::set<std::thread::id> seen;
  for (int i = 0; i < 2000; ++i) {
    const Parts p = run_and_check(64, 2);
    seen.insert(p.threads.begin(), p.threads.end());
    if (i % 500 == 499) std::this_thread::sleep_for(std::chrono::microseconds(3 * kDefaultSpinMicros));  // workers asleep
  }
  EXPECT_EQ(short_region_threads_started(), started) << "a region started threads";
  if (omp_wait_policy() == "PASSIVE") {
    EXPECT_GE(started, 1) << "under passive OpenMP waits the team runs the regions";
  }
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(std::this_thread::get_id())) << "the caller runs the first part";
}

TEST_F(ShortRegion, FollowsTheThreadCount) {
  omp_set_num_threads(3);
  EXPECT_EQ(run_and_check(100, 3).threads.size(), 3u);
  omp_set_num_threads(1);
  const Parts one = run_and_check(100, 1);
  EXPECT_EQ(one.threads, std::set<std::thread::id>{std::this_thread::get_id()});
  omp_set_num_threads(2);
  EXPECT_EQ(run_and_check(100, 2).threads.size(), 2u);
}

TEST_F(ShortRegion, TwoCallersAtOnceAndInsideAParallelRegion) {
  omp_set_num_threads(2);
  std::atomic<int> failures{0};
  const auto caller = [&] {
    for (int i = 0; i < 500; ++i) {
      std::vector<int> out(257, 0);
      short_region(257, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) out[static_cast<size_t>(k)] = static_cast<int>(k) * 3;
      });
      for (int k = 0; k < 257; ++k) failures += out[static_cast<size_t>(k)] != k * 3;
    }
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0);
  std::vector<int> ran_on(2, -1);
#pragma omp parallel num_threads(2)
  {
    const int t = omp_get_thread_num();
    int calls = 0;
    short_region(10, [&](int64_t begin, int64_t end) { calls += (begin == 0 && end == 10); });
    ran_on[static_cast<size_t>(t)] = calls;
  }
  EXPECT_EQ(ran_on, (std::vector<int>{1, 1})) << "inside a parallel region the caller runs the whole range";
}

TEST(RunnableThreads, ReadsLoadavgsFourthField) {
  EXPECT_EQ(runnable_threads("0.52 0.58 0.59 3/250 12345\n"), 3);
  EXPECT_EQ(runnable_threads("1.68 1.91 1.81 17/110 4627"), 17);
  EXPECT_EQ(runnable_threads("0.00 0.00 0.00 0/1 1"), 0);
  for (const char* bad : {"", "0.52 0.58 0.59", "0.52 0.58 0.59 x/250 1", "0.52 0.58 0.59 3", "0.52 0.58 0.59 -3/250 1",
                          "0.52 0.58 0.59 99999999999/250 1"}) {
    EXPECT_EQ(runnable_threads(bad), -1) << "'" << bad << "'";
  }
}

}  // namespace
}  // namespace loom
