// Layer plans: each block's attention and MLP kinds resolved once from the model config and the
// run's choices; the block reports the plan it runs, and impossible plans are refused by name.
#include <gtest/gtest.h>

#include "loom/backend/backend.h"
#include "loom/model/transformer.h"
#include "loom/nn/block.h"
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

// Each sub-layer's record holds its own kind's fields only, and what a record allocates is what
// block_saved_bytes counts (loom memory's estimate) for every plan and record shape.
TEST(LayerPlanTest, EachSubLayerRecordHoldsItsKindsFieldsAndTheCountIsTheAllocation) {
  struct Case {
    const char* preset;
    PlanChoices choices;
    int64_t layer;
  };
  PlanChoices flash, ring, ulysses, tp_sp;
  flash.flash = true;
  ring.context = PlanChoices::RING, ulysses.context = PlanChoices::ULYSSES;
  tp_sp.tensor_parallel = tp_sp.sequence_parallel = true;
  int checked = 0;
  for (const Case& k : {Case{"gpt2-tiny", {}, 0}, Case{"gpt2-tiny", flash, 0}, Case{"llama-tiny", ring, 0},
                        Case{"llama-tiny", ulysses, 0}, Case{"llama-tiny", tp_sp, 0}, Case{"moe-tiny", {}, 1},
                        Case{"mla-tiny", {}, 0}}) {
    const ModelConfig c = model_preset(k.preset);
    const LayerPlan plan = resolve_layer_plan(c, k.layer, k.choices);
    for (const RecomputePolicy keep : {RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL}) {
      for (const bool split : {false, true}) {
        const bool model_parallel = split || plan.sequence_parallel || plan.mlp == MlpKind::moe ||
                                    plan.attention == AttentionKind::ring || plan.attention == AttentionKind::ulysses;
        SavedShape shape{.batch = 2, .seq_len = 8, .seq_shards = plan.sequence_parallel ? 2 : 1,
                         .split_backward = split, .keep = keep};
        auto backend = make_cpu_backend();
        if (keep != RECOMPUTE_NONE && model_parallel) {  // refused by name
          const std::string msg = error_of([&] { allocate_block_saved(backend->allocator(), c, plan, shape); });
          EXPECT_NE(msg.find("train.recompute"), std::string::npos) << msg;
          continue;
        }
        const BlockSaved s = allocate_block_saved(backend->allocator(), c, plan, shape);
        EXPECT_EQ(static_cast<int64_t>(backend->allocator().tracker().current(MEM_ACTIVATIONS)),
                  block_saved_bytes(c, plan, shape)) << k.preset << " keep " << keep << " split " << split;
        ++checked;
        if (keep == RECOMPUTE_FULL) {  // the input only
          EXPECT_TRUE(s.input.defined() && !s.mid.defined() && !s.attention.attn.defined() && !s.mlp.fc.defined());
          continue;
        }
        const AttentionSaved& a = s.attention;
        const bool is_mla = plan.attention == AttentionKind::mla;
        EXPECT_EQ(a.qkv.defined(), !is_mla) << k.preset;
        EXPECT_EQ(a.mla_c.defined(), is_mla && keep == RECOMPUTE_NONE) << k.preset;
        if (keep == RECOMPUTE_NONE) {
          EXPECT_EQ(a.probs.defined(), plan.attention == AttentionKind::mha || is_mla) << k.preset;
          EXPECT_EQ(a.lse.defined(), !a.probs.defined()) << k.preset;
          EXPECT_EQ(a.dy_proj.defined(), split) << k.preset;
          EXPECT_EQ(s.mlp.dy_fc2.defined(), split && plan.mlp == MlpKind::dense) << k.preset;
          EXPECT_TRUE(s.mlp.norm.rstd.defined() && s.attention.norm.rstd.defined());
          EXPECT_EQ(s.attention.norm.mean.defined(), !c.rmsnorm()) << k.preset;
          // The residual stream and norms on this rank's sequence shard (sequence parallel).
          EXPECT_EQ(s.mid.dim(1), 8 / shape.seq_shards) << k.preset;
          EXPECT_EQ(a.qkv.defined() ? a.qkv.dim(1) : 8, 8) << k.preset;
        }
        // A dense MLP keeps fc (and act) where an MoE keeps its routing record instead.
        EXPECT_EQ(s.mlp.fc.defined(), plan.mlp == MlpKind::dense) << k.preset;
        EXPECT_EQ(s.mlp.moe.logits.defined(), plan.mlp == MlpKind::moe) << k.preset;
      }
    }
  }
  EXPECT_EQ(checked, 20);
}

}  // namespace
}  // namespace loom
