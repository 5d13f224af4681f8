// Layer plans: each block's attention and MLP kinds resolved once from the model config and the
// run's choices; the block reports the plan it runs, and impossible plans are refused by name.
#include <gtest/gtest.h>

#include "loom/backend/backend.h"
#include "loom/model/transformer.h"
#include "loom/nn/plan.h"
#include "test_util.h"

namespace loom {
using test::error_of;
namespace {

TEST(LayerPlanTest, KindsFollowTheConfigAndTheChoices) {
  ModelConfig c = model_preset("llama-tiny");
  EXPECT_EQ(resolve_layer_plan(c, 0, {}).attention, AttentionKind::mha);
  PlanChoices flash;
  flash.flash = true;
  EXPECT_EQ(resolve_layer_plan(c, 0, flash).attention, AttentionKind::flash);
  PlanChoices ring, ulysses;
  ring.context = PlanChoices::RING, ulysses.context = PlanChoices::ULYSSES;
  EXPECT_EQ(resolve_layer_plan(c, 0, ring).attention, AttentionKind::ring);
  EXPECT_EQ(resolve_layer_plan(c, 0, ulysses).attention, AttentionKind::ulysses);
  c.attn_window = 5;
  EXPECT_EQ(resolve_layer_plan(c, 1, flash).window, 5);  // a window is a mask of mha / flash
  const std::string msg = error_of([&] { resolve_layer_plan(c, 0, ring); });
  EXPECT_NE(msg.find("model.attn_window"), std::string::npos) << msg;

  ModelConfig moe = model_preset("moe-tiny");
  moe.moe_dense_layers = 1;
  EXPECT_EQ(resolve_layer_plan(moe, 0, {}).mlp, MlpKind::dense);
  EXPECT_EQ(resolve_layer_plan(moe, 1, {}).mlp, MlpKind::moe);

  ModelConfig mla = model_preset("mla-tiny");
  EXPECT_EQ(resolve_layer_plan(mla, 0, {}).attention, AttentionKind::mla);
  EXPECT_NE(error_of([&] { resolve_layer_plan(mla, 0, flash); }).find("train.flash_attention"), std::string::npos);
}

TEST(LayerPlanTest, TheModelsBlocksRunTheirPlans) {
  auto backend = make_cpu_backend();
  ModelConfig c = model_preset("llama-tiny");
  Transformer model(*backend, c);
  EXPECT_EQ(describe_plans(model.layer_plans()), str_cat(c.n_layer, " x attention mha + mlp dense"));
  model.set_flash_attention(true);
  std::vector<RecomputePolicy> policies(static_cast<size_t>(c.n_layer), RECOMPUTE_NONE);
  policies[0] = RECOMPUTE_SELECTIVE;
  model.set_recompute(policies);
  for (const LayerPlan& p : model.layer_plans()) EXPECT_EQ(p.attention, AttentionKind::flash);
  EXPECT_EQ(model.layer_plans()[0].recompute, RECOMPUTE_SELECTIVE);
  EXPECT_EQ(describe_plans(model.layer_plans()),
            str_cat("1 x attention flash + mlp dense, recompute selective, ", c.n_layer - 1, " x attention flash + mlp dense"));
}

// The precision recipe is part of each layer's plan: the policy's recipes of its four linears.
TEST(LayerPlanTest, ThePlanCarriesTheLinearsPrecisionRecipes) {
  auto backend = make_cpu_backend();
  ModelConfig c = model_preset("gpt2-tiny");
  Transformer model(*backend, c);
  PrecisionConfig pc;
  pc.compute = "bf16";
  model.set_precision(resolve_policy(pc));
  EXPECT_EQ(model.layer_plans()[0].linears[LINEAR_MLP_IN], RECIPE_BF16);
  EXPECT_EQ(describe_plans(model.layer_plans()), str_cat(c.n_layer, " x attention mha + mlp dense, linears bf16"));
  pc.compute = "f32", pc.attn_qkv = "fp8-current", pc.qat = "mxfp4";
  model.set_precision(resolve_policy(pc));
  EXPECT_EQ(describe_plans(model.layer_plans()),
            str_cat(c.n_layer, " x attention mha + mlp dense, linears attn_qkv fp8-current, attn_out f32, mlp_in f32, "
                               "mlp_out f32, qat mxfp4"));
  PlanChoices low;
  low.linears[LINEAR_ATTN_QKV] = RECIPE_BF16;
  const std::string msg = error_of([&] { resolve_layer_plan(model_preset("mla-tiny"), 0, low); });
  EXPECT_NE(msg.find("set precision.attn_qkv = f32 (got bf16)"), std::string::npos) << msg;
}

}  // namespace
}  // namespace loom
