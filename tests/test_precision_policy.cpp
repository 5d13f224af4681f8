// TransformerEngine delayed scaling (the exact amax-history ring and its scales) and the precision
// policy's resolution and validation errors (precision/policy.h). The quantizers themselves are
// tested in test_quantize.cpp.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/precision/formats.h"
#include "loom/precision/policy.h"
#include "loom/precision/quantize.h"

namespace loom {
namespace {

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }

// Bit-identical, or both NaN (NaN payloads are not part of the contract).
bool same_bits(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }
// -------------------------------------------------------------------------- DelayedScaling

// History equality with NaN == NaN.
void expect_history(const DelayedScaling& d, const std::vector<float>& want, const char* when) {
  const std::vector<float>& h = d.history();
  ASSERT_EQ(h.size(), want.size()) << when;
  for (size_t i = 0; i < h.size(); ++i) EXPECT_TRUE(same_bits(h[i], want[i])) << when << " slot " << i << ": " << h[i] << " vs " << want[i];
}

// fmax / amax / 2^margin. Computed in double and rounded once: for a quotient of floats that
// is the correctly rounded fp32 quotient too (double has more than 2 * 24 + 2 bits), so it
// does not matter whether scale() divides in fp32 or fp64.
float te_scale(double fmax, float amax, int margin = 0) {
  return static_cast<float>(fmax / static_cast<double>(amax) / std::ldexp(1.0, margin));
}

TEST(DelayedScalingTest, StartsAtOneAndUsesTheHistoryMax) {
  DelayedScaling d(1024);
  EXPECT_EQ(d.scale(FMT_E4M3), 1.0f);
  EXPECT_EQ(d.scale(FMT_E5M2), 1.0f);
  EXPECT_EQ(d.amax_used(), 0.0f);
  EXPECT_EQ(d.history().size(), 1024u);
  d.record(3.0f);
  EXPECT_EQ(d.scale(FMT_E4M3), 1.0f);  // record() alone does not change this step's scale
  d.advance();
  EXPECT_EQ(d.amax_used(), 3.0f);
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 3.0f));
  EXPECT_EQ(d.scale(FMT_E5M2), te_scale(57344.0, 3.0f));
  d.record(0.7f);
  d.advance();
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 3.0f));  // 3 is still in the history
  d.record(11.25f);
  d.advance();
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 11.25f));
  EXPECT_EQ(d.scale(FMT_E5M2), te_scale(57344.0, 11.25f));
}

TEST(DelayedScalingTest, WindowOfThreeRollsLikeTransformerEngine) {
  DelayedScaling d(3);
  // Each step: record, advance; then history = roll(h, -1) with slot 0 zeroed.
  d.record(8.0f);
  expect_history(d, {8.0f, 0.0f, 0.0f}, "record 8");
  d.advance();
  expect_history(d, {0.0f, 0.0f, 8.0f}, "step 1");
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 8.0f));
  d.record(2.0f);
  d.advance();
  expect_history(d, {0.0f, 8.0f, 2.0f}, "step 2");
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 8.0f));
  d.record(1.0f);
  d.advance();
  expect_history(d, {0.0f, 2.0f, 1.0f}, "step 3");
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 8.0f));  // steps 1..3 in the window
  d.record(0.5f);
  d.advance();
  expect_history(d, {0.0f, 1.0f, 0.5f}, "step 4");
  EXPECT_EQ(d.amax_used(), 2.0f);  // step 1's 8 left the window
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 2.0f));
  EXPECT_EQ(d.scale(FMT_E5M2), te_scale(57344.0, 2.0f));
  d.advance();  // no record this step (amax 0)
  expect_history(d, {0.0f, 0.5f, 0.0f}, "step 5");
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 1.0f));
  d.advance();
  expect_history(d, {0.0f, 0.0f, 0.0f}, "step 6");
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 0.5f));
  d.advance();  // an all-zero window keeps the previous scale
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 0.5f));
  EXPECT_EQ(d.amax_used(), 0.5f);
}

TEST(DelayedScalingTest, MarginDividesTheScaleByAPowerOfTwo) {
  for (int m : {1, 2, 5}) {
    DelayedScaling base(16, 0), d(16, m);
    for (DelayedScaling* s : {&base, &d}) {
      s->record(3.3f);
      s->advance();
    }
    EXPECT_EQ(d.scale(FMT_E4M3), base.scale(FMT_E4M3) / static_cast<float>(1 << m)) << m;
    EXPECT_EQ(d.scale(FMT_E5M2), base.scale(FMT_E5M2) / static_cast<float>(1 << m)) << m;
    EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 3.3f, m));
  }
}

TEST(DelayedScalingTest, MostRecentUsesOnlyTheLatestStep) {
  DelayedScaling recent(4, 0, true), max(4, 0, false);
  for (DelayedScaling* d : {&recent, &max}) {
    d->record(8.0f);
    d->advance();
    d->record(2.0f);
    d->advance();
  }
  EXPECT_EQ(recent.scale(FMT_E4M3), te_scale(448.0, 2.0f));
  EXPECT_EQ(max.scale(FMT_E4M3), te_scale(448.0, 8.0f));
  expect_history(recent, {0.0f, 0.0f, 8.0f, 2.0f}, "most_recent keeps the same ring");
  recent.advance();  // a step with amax 0 keeps the previous scale
  EXPECT_EQ(recent.scale(FMT_E4M3), te_scale(448.0, 2.0f));
  recent.record(0.0f);
  recent.advance();
  EXPECT_EQ(recent.scale(FMT_E4M3), te_scale(448.0, 2.0f));
  EXPECT_EQ(recent.amax_used(), 2.0f);
  recent.record(INFINITY);
  recent.advance();
  EXPECT_EQ(recent.scale(FMT_E4M3), te_scale(448.0, 2.0f));
}

TEST(DelayedScalingTest, ZeroAndNonFiniteAmaxKeepThePreviousScale) {
  DelayedScaling one(1);
  one.record(4.0f);
  one.advance();
  EXPECT_EQ(one.scale(FMT_E4M3), 112.0f);
  one.record(0.0f);
  one.advance();
  EXPECT_EQ(one.scale(FMT_E4M3), 112.0f);

  DelayedScaling d(2);
  d.record(4.0f);
  d.advance();
  expect_history(d, {0.0f, 4.0f}, "step 1");
  EXPECT_EQ(d.scale(FMT_E4M3), 112.0f);
  d.record(NAN);
  d.record(1.0f);  // NaN is sticky within a step
  expect_history(d, {NAN, 4.0f}, "NaN recorded");
  d.advance();
  expect_history(d, {0.0f, NAN}, "step 2");
  EXPECT_EQ(d.scale(FMT_E4M3), 112.0f);
  EXPECT_EQ(d.amax_used(), 4.0f);
  d.record(2.0f);
  d.advance();  // the NaN is still in the window: keep
  expect_history(d, {0.0f, 2.0f}, "step 3");
  EXPECT_EQ(d.scale(FMT_E4M3), 112.0f);
  d.record(1.0f);
  d.advance();
  expect_history(d, {0.0f, 1.0f}, "step 4");
  EXPECT_EQ(d.scale(FMT_E4M3), 224.0f);
  d.record(INFINITY);
  d.advance();
  EXPECT_EQ(d.scale(FMT_E4M3), 224.0f);
}

TEST(DelayedScalingTest, RecordKeepsTheMaxOfAStep) {
  DelayedScaling d(8);
  d.record(1.0f);
  d.record(5.0f);
  d.record(3.0f);
  d.record(-0.0f);
  EXPECT_EQ(d.history()[0], 5.0f);
  d.advance();
  EXPECT_EQ(d.scale(FMT_E4M3), te_scale(448.0, 5.0f));
  EXPECT_EQ(d.history()[7], 5.0f);
  EXPECT_THROW(d.restore(std::vector<float>(7, 0.0f), 1.0f), Error);
  d.restore({0, 0, 0, 0, 0, 0, 0, 9.0f}, 9.0f);
  EXPECT_EQ(d.scale(FMT_E5M2), te_scale(57344.0, 9.0f));
}

// ------------------------------------------------------------------------ PrecisionPolicy

// The message of the loom::Error `f` throws ("" when it throws nothing).
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(PrecisionPolicyTest, DefaultsResolveToF32) {
  const PrecisionConfig c;
  EXPECT_NO_THROW(c.validate());
  const PrecisionPolicy p = resolve_policy(c);
  for (int k = 0; k < LINEAR_KIND_COUNT; ++k) EXPECT_EQ(p.recipe[static_cast<size_t>(k)], RECIPE_F32) << k;
  EXPECT_FALSE(p.param_bf16);
  EXPECT_FALSE(p.reduce_bf16);
  EXPECT_FALSE(p.master_bf16);
  EXPECT_FALSE(p.stochastic_rounding);
  EXPECT_EQ(p.qat, QAT_NONE);
  EXPECT_FALSE(p.any_fp8());
  EXPECT_EQ(p.fp8_margin, 0);
  EXPECT_EQ(p.fp8_history, 1024);
  EXPECT_FALSE(p.fp8_most_recent);
  EXPECT_EQ(p.describe(), "attn_qkv=f32 attn_out=f32 mlp_in=f32 mlp_out=f32 head=f32 param=f32 reduce=f32 master=f32");
}

TEST(PrecisionPolicyTest, Bf16ComputeAlsoReadsBf16Params) {
  PrecisionConfig c;
  c.compute = "bf16";
  PrecisionPolicy p = resolve_policy(c);
  for (int k = 0; k < LINEAR_KIND_COUNT; ++k) EXPECT_EQ(p.recipe[static_cast<size_t>(k)], RECIPE_BF16) << k;
  EXPECT_TRUE(p.param_bf16);
  c.param = "f32";
  EXPECT_FALSE(resolve_policy(c).param_bf16);
  c.compute = "f32";
  c.param = "bf16";
  EXPECT_TRUE(resolve_policy(c).param_bf16);
}

TEST(PrecisionPolicyTest, Fp8RecipesKeepTheHeadInBf16) {
  PrecisionConfig c;
  c.compute = "fp8-block";
  PrecisionPolicy p = resolve_policy(c);
  for (int k = 0; k < LINEAR_HEAD; ++k) EXPECT_EQ(p.recipe[static_cast<size_t>(k)], RECIPE_FP8_BLOCK) << k;
  EXPECT_EQ(p.recipe[LINEAR_HEAD], RECIPE_BF16);
  EXPECT_EQ(p.fp8_backward_block, FMT_E4M3);
  EXPECT_FALSE(p.param_bf16);
  EXPECT_TRUE(p.any_fp8());
  c.head = "fp8-block";
  EXPECT_EQ(resolve_policy(c).recipe[LINEAR_HEAD], RECIPE_FP8_BLOCK);
  c.head = "f32";
  EXPECT_EQ(resolve_policy(c).recipe[LINEAR_HEAD], RECIPE_F32);

  PrecisionConfig d;
  d.compute = "fp8-delayed";
  p = resolve_policy(d);
  EXPECT_EQ(p.recipe[LINEAR_ATTN_QKV], RECIPE_FP8_DELAYED);
  EXPECT_EQ(p.recipe[LINEAR_HEAD], RECIPE_BF16);
  EXPECT_EQ(p.fp8_backward_delayed, FMT_E5M2);
  d.fp8.backward = "e4m3";
  d.fp8.margin = 3;
  d.fp8.amax_history = 16;
  d.fp8.amax_compute = "most_recent";
  p = resolve_policy(d);
  EXPECT_EQ(p.fp8_backward_delayed, FMT_E4M3);
  EXPECT_EQ(p.fp8_backward_block, FMT_E4M3);
  EXPECT_EQ(p.fp8_margin, 3);
  EXPECT_EQ(p.fp8_history, 16);
  EXPECT_TRUE(p.fp8_most_recent);
  d.compute = "fp8-current";
  EXPECT_EQ(resolve_policy(d).recipe[LINEAR_HEAD], RECIPE_BF16);
  c.fp8.backward = "e5m2";  // the block recipe's E4M3 backward can be overridden too
  p = resolve_policy(c);
  EXPECT_EQ(p.fp8_backward_block, FMT_E5M2);
  EXPECT_EQ(p.fp8_backward_delayed, FMT_E5M2);
}

TEST(PrecisionPolicyTest, PerKindOverrideAppliesToThatKindOnly) {
  PrecisionConfig c;
  c.compute = "bf16";
  c.mlp_in = "f32";
  const PrecisionPolicy p = resolve_policy(c);
  EXPECT_EQ(p.recipe[LINEAR_MLP_IN], RECIPE_F32);
  for (LinearKind k : {LINEAR_ATTN_QKV, LINEAR_ATTN_OUT, LINEAR_MLP_OUT, LINEAR_HEAD}) EXPECT_EQ(p.recipe[k], RECIPE_BF16) << k;
  c.compute = "f32";
  c.mlp_in = "";
  c.attn_out = "fp16";
  const PrecisionPolicy q = resolve_policy(c);
  EXPECT_EQ(q.recipe[LINEAR_ATTN_OUT], RECIPE_FP16);
  for (LinearKind k : {LINEAR_ATTN_QKV, LINEAR_MLP_IN, LINEAR_MLP_OUT, LINEAR_HEAD}) EXPECT_EQ(q.recipe[k], RECIPE_F32) << k;
  EXPECT_FALSE(q.param_bf16);
  c.master = "bf16";
  c.stochastic_rounding = true;
  c.reduce = "bf16";
  c.qat = "nvfp4";
  const PrecisionPolicy r = resolve_policy(c);
  EXPECT_TRUE(r.master_bf16 && r.stochastic_rounding && r.reduce_bf16);
  EXPECT_EQ(r.qat, QAT_NVFP4);
  c.qat = "mxfp4";
  EXPECT_EQ(resolve_policy(c).qat, QAT_MXFP4);
}

TEST(PrecisionPolicyTest, InvalidValuesThrowNamingTheKey) {
  struct Case {
    const char* key;
    void (*set)(PrecisionConfig&);
  };
  const Case cases[] = {
      {"precision.compute", [](PrecisionConfig& c) { c.compute = "fp9"; }},
      {"precision.compute", [](PrecisionConfig& c) { c.compute = ""; }},
      {"precision.attn_out", [](PrecisionConfig& c) { c.attn_out = "BF16"; }},
      {"precision.mlp_out", [](PrecisionConfig& c) { c.mlp_out = "int8"; }},
      {"precision.head", [](PrecisionConfig& c) { c.head = "fp8"; }},
      {"precision.param", [](PrecisionConfig& c) { c.param = "fp16"; }},
      {"precision.reduce", [](PrecisionConfig& c) { c.reduce = "fp8"; }},
      {"precision.master", [](PrecisionConfig& c) { c.master = "f16"; }},
      {"precision.qat", [](PrecisionConfig& c) { c.qat = "int4"; }},
      {"precision.fp8_amax_compute", [](PrecisionConfig& c) { c.fp8.amax_compute = "mean"; }},
      {"precision.fp8_backward", [](PrecisionConfig& c) { c.fp8.backward = "e3m4"; }},
      {"precision.fp8_margin", [](PrecisionConfig& c) { c.fp8.margin = -1; }},
      {"precision.fp8_margin", [](PrecisionConfig& c) { c.fp8.margin = 65; }},
      {"precision.fp8_amax_history", [](PrecisionConfig& c) { c.fp8.amax_history = 0; }},
      {"precision.stochastic_rounding", [](PrecisionConfig& c) { c.stochastic_rounding = true; }},  // master f32
  };
  for (const Case& k : cases) {
    PrecisionConfig c;
    k.set(c);
    const std::string v = error_of([&] { c.validate(); });
    EXPECT_NE(v.find(k.key), std::string::npos) << k.key << ": '" << v << "'";
    const std::string r = error_of([&] { resolve_policy(c); });
    EXPECT_NE(r.find(k.key), std::string::npos) << k.key << ": '" << r << "'";
  }
  EXPECT_NE(error_of([] { parse_recipe("fp4", "some.key"); }).find("some.key"), std::string::npos);
  EXPECT_EQ(parse_recipe("fp8-current", "k"), RECIPE_FP8_CURRENT);
  PrecisionConfig ok;
  ok.fp8.margin = 64;
  ok.fp8.amax_history = 1 << 20;
  ok.master = "bf16";
  ok.stochastic_rounding = true;
  EXPECT_NO_THROW(ok.validate());  // the bounds themselves are allowed
}

}  // namespace
}  // namespace loom
