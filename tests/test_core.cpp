// Core: dtypes (bf16 round-to-nearest-even), Philox known answers, memory accounting, tensor views.
#include <gtest/gtest.h>

#include <bit>
#include <cstdlib>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "loom/core/dtype.h"
#include "loom/core/env.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/core/philox.h"
#include "loom/core/tensor.h"

namespace loom {
namespace {

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

TEST(BF16, ExactValuesRoundTrip) {
  for (float v : {0.0f, -0.0f, 1.0f, -2.5f, 65536.0f, 1.0f / 1024.0f}) EXPECT_EQ(bf16_to_f32(f32_to_bf16(v)), v);
}

TEST(BF16, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F808000u)).bits, 0x3F80u);
  // 1.0078125 + 2^-8 is halfway between 0x3F81 (odd) and 0x3F82 (even): rounds up to even.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F818000u)).bits, 0x3F82u);
  // Just above halfway rounds up; just below rounds down.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F808001u)).bits, 0x3F81u);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F807FFFu)).bits, 0x3F80u);
}

TEST(BF16, OverflowInfinityAndNaN) {
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()).bits, 0x7F80u);  // rounds up to +inf
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()).bits, 0x7F80u);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()).bits, 0xFF80u);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(from_bits(0x7F800001u)))));  // signalling NaN stays NaN
}

// Known-answer vectors of Random123's Philox4x32-10 (Salmon et al. 2011, SC'11).
// One strict parser for integer settings: unset or empty gives the fallback; a unit, a fraction,
// a sign below the range, a value out of the range or past int64 is one line naming the
// variable, its text and the range.
TEST(EnvInteger, ParsesWholeNumbersInRangeAndRefusesTheRest) {
  const char* name = "LOOM_TEST_ENV_INTEGER";
  unsetenv(name);
  EXPECT_EQ(env_integer(name, 7, 0, 100), 7);
  setenv(name, "", 1);
  EXPECT_EQ(env_integer(name, 7, 0, 100), 7);
  for (const auto& [text, value] : {std::pair{"0", 0}, {"100", 100}, {"42", 42}}) {
    setenv(name, text, 1);
    EXPECT_EQ(env_integer(name, 7, 0, 100), value) << text;
  }
  setenv(name, "-5", 1);
  EXPECT_EQ(env_integer(name, 0, -10, 10), -5);
  for (const char* text : {"1ms", "1.5", "-1", "101", "x", "99999999999999999999", "12 "}) {
    setenv(name, text, 1);
    try {
      (void)env_integer(name, 7, 0, 100);
      ADD_FAILURE() << "accepted '" << text << "'";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), std::string("environment variable LOOM_TEST_ENV_INTEGER='") + text +
                                           "': expected a whole number from 0 to 100");
    }
  }
  unsetenv(name);
}

TEST(Philox, KnownAnswerVectors) {
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Philox, ShardedFillEqualsFullFill) {
  std::vector<float> full(103), part(40);
  philox_fill_normal(full.data(), 103, 42, 7, 0, 0.0f, 1.0f);
  philox_fill_normal(part.data(), 40, 42, 7, 33, 0.0f, 1.0f);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(part[i], full[33 + i]);
}

TEST(Philox, NormalFillHasRequestedMoments) {
  const int n = 200000;
  std::vector<float> x(n);
  philox_fill_normal(x.data(), n, 1, 0, 0, 0.5f, 2.0f);
  double mean = 0, var = 0;
  for (float v : x) mean += v;
  mean /= n;
  for (float v : x) var += (v - mean) * (v - mean);
  var /= n;
  EXPECT_NEAR(mean, 0.5, 0.02);          // 4.5 standard errors (2/sqrt(n) = 0.0045)
  EXPECT_NEAR(std::sqrt(var), 2.0, 0.02);
}

TEST(Memory, TracksCurrentAndPeakPerCategory) {
  CpuAllocator alloc;
  {
    Tensor a = Tensor::empty(alloc, {100}, DTYPE_F32, MEM_PARAMETERS);
    Tensor b = Tensor::empty(alloc, {10, 10}, DTYPE_BF16, MEM_ACTIVATIONS);
    EXPECT_EQ(alloc.tracker().current(MEM_PARAMETERS), 400u);
    EXPECT_EQ(alloc.tracker().current(MEM_ACTIVATIONS), 200u);
    EXPECT_EQ(alloc.tracker().current_total(), 600u);
    Tensor view = a.view(10, {5, 5});  // views allocate nothing
    EXPECT_EQ(alloc.tracker().current_total(), 600u);
  }
  EXPECT_EQ(alloc.tracker().current_total(), 0u);
  EXPECT_EQ(alloc.tracker().peak(MEM_PARAMETERS), 400u);
  EXPECT_EQ(alloc.tracker().peak_total(), 600u);
  alloc.tracker().reset_peaks();
  EXPECT_EQ(alloc.tracker().peak_total(), 0u);
}

TEST(TensorTest, ViewsShareStorageAndCheckBounds) {
  CpuAllocator alloc;
  Tensor t = Tensor::zeros(alloc, {4, 3}, DTYPE_F32, MEM_WORKSPACE);
  Tensor row = t.slice0(2, 3);
  row.data<float>()[1] = 5.0f;
  EXPECT_EQ(t.data<float>()[7], 5.0f);
  EXPECT_EQ(t.view(6, {2, 3}).data<float>()[1], 5.0f);
  EXPECT_THROW(t.view(10, {3}), Error);
  EXPECT_THROW(t.slice0(3, 5), Error);
  EXPECT_THROW(t.data<double>(), Error);  // no implicit dtype reinterpretation
}

}  // namespace
}  // namespace loom
