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
  EXPECT_EQ(describe_plans(model.layer_plans()), str_cat(c.n_layer, " x attention mha + mlp dense, linears bf16, inputs saved in bf16"));
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

// precision.activations = bf16: the inputs of bf16 linear layers are saved in bf16 where nothing
// else reads them in fp32; each exception of LayerPlan::saved_bf16's rule, and the bytes: each
// such field is exactly half its fp32 size, the rest unchanged.
TEST(LayerPlanTest, TheInputsOfBf16LinearsAreSavedInBf16WhereTheRecipeAllows) {
  using Saved = std::array<bool, 4>;
  PrecisionConfig pc;
  pc.compute = "bf16";
  PlanChoices bf16;
  choose_precision(bf16, resolve_policy(pc));
  const ModelConfig gpt2 = model_preset("gpt2-tiny"), llama = model_preset("llama-tiny");
  EXPECT_EQ(resolve_layer_plan(gpt2, 0, bf16).saved_bf16, (Saved{true, true, true, true}));
  EXPECT_EQ(resolve_layer_plan(gpt2, 0, {}).saved_bf16, (Saved{false, false, false, false}));  // f32 linears
  PlanChoices off = bf16;
  off.activations_bf16 = false;  // precision.activations = f32
  EXPECT_EQ(resolve_layer_plan(gpt2, 0, off).saved_bf16, (Saved{false, false, false, false}));
  PlanChoices mixed = bf16;  // only bf16 layers' inputs
  mixed.linears[LINEAR_MLP_OUT] = RECIPE_FP8_CURRENT;
  EXPECT_EQ(resolve_layer_plan(gpt2, 0, mixed).saved_bf16, (Saved{true, true, true, false}));
  PlanChoices flash = bf16;  // flash attention's backward reads O in fp32
  flash.flash = true;
  EXPECT_EQ(resolve_layer_plan(llama, 0, flash).saved_bf16, (Saved{true, false, true, true}));
  PlanChoices flash16 = flash;  // the bf16 flash kernels write O in bf16 and read it so (not with sinks)
  flash16.attention_bf16 = true;
  EXPECT_EQ(resolve_layer_plan(llama, 0, flash16).saved_bf16, (Saved{true, true, true, true}));
  ModelConfig sinks = llama;
  sinks.attn_sinks = true;
  EXPECT_EQ(resolve_layer_plan(sinks, 0, flash16).saved_bf16, (Saved{true, false, true, true}));
  PlanChoices ring = bf16;
  ring.context = PlanChoices::RING;
  EXPECT_EQ(resolve_layer_plan(llama, 0, ring).saved_bf16, (Saved{true, false, true, true}));
  PlanChoices sp = bf16;  // the norms' outputs are gathered in fp32
  sp.tensor_parallel = sp.sequence_parallel = true;
  EXPECT_EQ(resolve_layer_plan(llama, 0, sp).saved_bf16, (Saved{false, true, false, true}));
  ModelConfig lora = llama;  // adapters on q and v read norm1's output in fp32
  lora.peft_method = PeftMethod::lora, lora.lora_targets = "q,v,down";
  EXPECT_EQ(resolve_layer_plan(lora, 0, bf16).saved_bf16, (Saved{false, true, true, false}));
  ModelConfig moe = model_preset("moe-tiny");
  moe.moe_dense_layers = 1;
  EXPECT_EQ(resolve_layer_plan(moe, 0, bf16).saved_bf16, (Saved{true, true, true, true}));
  EXPECT_EQ(resolve_layer_plan(moe, 1, bf16).saved_bf16, (Saved{true, true, false, false}));
  PlanChoices attn16 = bf16;  // precision.attention = bf16: the plain and the flash attention without a window
  attn16.attention_bf16 = true;
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, attn16).attention_bf16);
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, bf16).attention_bf16);
  attn16.flash = true;  // flash_attention_*_bf16 (tensor cores on the CUDA backend)
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, attn16).attention_bf16);
  ModelConfig windowed = llama;
  windowed.attn_window = 4;
  EXPECT_FALSE(resolve_layer_plan(windowed, 0, attn16).attention_bf16);
  attn16.flash = false;
  EXPECT_FALSE(resolve_layer_plan(windowed, 0, attn16).attention_bf16);
  // fc's output gradient in bf16: its recipe bf16, a dense MLP, no adapter on it.
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, bf16).mlp_in_dy_bf16);
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, off).mlp_in_dy_bf16);
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, {}).mlp_in_dy_bf16);
  EXPECT_TRUE(resolve_layer_plan(lora, 0, bf16).mlp_in_dy_bf16);  // adapters on q, v, down only
  ModelConfig lora_up = llama;
  lora_up.peft_method = PeftMethod::lora, lora_up.lora_targets = "up";
  EXPECT_FALSE(resolve_layer_plan(lora_up, 0, bf16).mlp_in_dy_bf16);
  EXPECT_FALSE(resolve_layer_plan(moe, 1, bf16).mlp_in_dy_bf16);
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, mixed).mlp_in_dy_bf16);  // mlp_out's recipe does not matter
  // qkv's output gradient in bf16: flash attention in bf16 with nothing between it and qkv (GPT-2).
  PlanChoices gflash16 = bf16;
  gflash16.flash = gflash16.attention_bf16 = true;
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, gflash16).qkv_dy_bf16);
  EXPECT_FALSE(resolve_layer_plan(llama, 0, gflash16).qkv_dy_bf16);  // RoPE's backward rewrites d(qkv)
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, bf16).qkv_dy_bf16);       // the plain attention
  PlanChoices gflash32 = gflash16;
  gflash32.attention_bf16 = false;
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, gflash32).qkv_dy_bf16);
  gflash16.activations_bf16 = false;
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, gflash16).qkv_dy_bf16);
  PlanChoices fc8 = bf16;
  fc8.linears[LINEAR_MLP_IN] = RECIPE_FP8_CURRENT;
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, fc8).mlp_in_dy_bf16);
  // precision.outputs = bf16: fc's output in bf16, by the same rule as its gradient, its own choice.
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, bf16).fc_bf16);
  EXPECT_TRUE(resolve_layer_plan(llama, 0, off).fc_bf16);
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, fc8).fc_bf16);
  EXPECT_TRUE(resolve_layer_plan(lora, 0, bf16).fc_bf16);  // an adapter on down_proj only: fc's output is plain
  ModelConfig lora_fc = llama;
  lora_fc.peft_method = PeftMethod::lora, lora_fc.lora_targets = "gate,up";
  EXPECT_FALSE(resolve_layer_plan(lora_fc, 0, bf16).fc_bf16);
  EXPECT_FALSE(resolve_layer_plan(moe, 1, bf16).fc_bf16);
  PlanChoices outputs32 = bf16;
  outputs32.outputs_bf16 = false;
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, outputs32).fc_bf16);
  // The GELU in fc's and fc2's GEMMs (Backend::gemm_gelu / gemm_dgelu): GPT-2 with fc's output, the
  // activation and its gradient in bf16; not Llama's SwiGLU, not without those bf16 fields, not fc2
  // with an adapter; the forward's not under selective recompute (it takes the activation again).
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, bf16).fc_gelu && resolve_layer_plan(gpt2, 0, bf16).fc2_dgelu);
  EXPECT_FALSE(resolve_layer_plan(llama, 0, bf16).fc_gelu || resolve_layer_plan(llama, 0, bf16).fc2_dgelu);
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, outputs32).fc_gelu || resolve_layer_plan(gpt2, 0, outputs32).fc2_dgelu);
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, off).fc2_dgelu);
  ModelConfig gpt2_down = gpt2;  // an adapter on fc2 reads the activation in fp32 and adds its term to d(act)
  gpt2_down.peft_method = PeftMethod::lora, gpt2_down.lora_targets = "down";
  EXPECT_TRUE(resolve_layer_plan(gpt2_down, 0, bf16).fc_bf16 && resolve_layer_plan(gpt2_down, 0, bf16).mlp_in_dy_bf16);
  EXPECT_FALSE(resolve_layer_plan(gpt2_down, 0, bf16).fc_gelu || resolve_layer_plan(gpt2_down, 0, bf16).fc2_dgelu);
  PlanChoices selective = bf16;
  selective.recompute = RECOMPUTE_SELECTIVE;
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, selective).fc_gelu);
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, selective).fc2_dgelu);
  PlanChoices full = bf16;
  full.recompute = RECOMPUTE_FULL;  // the forward runs again as it ran
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, full).fc_gelu);
  // precision.outputs = bf16 around the bf16 flash attention: qkv's record (written by the GEMM, or
  // staged in fp32 under RoPE, q/k norms or adapters and rounded) and dO (the output projection's
  // d(input)), each its own rule.
  PlanChoices out16 = bf16;
  out16.flash = out16.attention_bf16 = true;
  out16.activations_bf16 = false;  // not what decides them
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, out16).qkv_bf16);
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, out16).attn_dy_bf16);
  EXPECT_TRUE(resolve_layer_plan(llama, 0, out16).qkv_bf16);     // RoPE rotates an fp32 staging
  EXPECT_TRUE(resolve_layer_plan(llama, 0, out16).attn_dy_bf16);  // nothing between proj and the attention
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, bf16).qkv_bf16);       // the plain attention
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, bf16).attn_dy_bf16);
  EXPECT_FALSE(resolve_layer_plan(sinks, 0, out16).attn_dy_bf16);  // the sinks' backward rewrites dO in fp32
  PlanChoices out32 = out16;
  out32.outputs_bf16 = false;
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, out32).qkv_bf16);
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, out32).attn_dy_bf16);
  PlanChoices proj8 = out16;
  proj8.linears[LINEAR_ATTN_OUT] = RECIPE_FP8_CURRENT;
  EXPECT_TRUE(resolve_layer_plan(gpt2, 0, proj8).qkv_bf16);
  EXPECT_FALSE(resolve_layer_plan(gpt2, 0, proj8).attn_dy_bf16);
  ModelConfig gpt2_lora = gpt2;  // adapters add their terms to fp32 tensors
  gpt2_lora.peft_method = PeftMethod::lora, gpt2_lora.lora_targets = "q,v";
  EXPECT_TRUE(resolve_layer_plan(gpt2_lora, 0, out16).qkv_bf16);  // the adapter adds into the staging
  EXPECT_TRUE(resolve_layer_plan(gpt2_lora, 0, out16).attn_dy_bf16);
  gpt2_lora.lora_targets = "o";
  EXPECT_TRUE(resolve_layer_plan(gpt2_lora, 0, out16).qkv_bf16);
  EXPECT_FALSE(resolve_layer_plan(gpt2_lora, 0, out16).attn_dy_bf16);
  PlanChoices mla = bf16;  // MLA projects in fp32 from norm1's output
  mla.linears[LINEAR_ATTN_QKV] = RECIPE_F32;
  EXPECT_EQ(resolve_layer_plan(model_preset("mla-tiny"), 0, mla).saved_bf16, (Saved{false, false, true, true}));
  // proj's and fc2's output gradient (the residual stream's) read in bf16 from the norm backward
  // that finalises it: each layer's recipe bf16, no output norms, sequence parallelism, adapter on
  // it or MoE; not with precision.activations = f32.
  const auto residual16 = [](const ModelConfig& c, int64_t layer, const PlanChoices& ch) {
    const LayerPlan p = resolve_layer_plan(c, layer, ch);
    return std::array<bool, 2>{p.proj_dy_bf16, p.fc2_dy_bf16};
  };
  using Pair = std::array<bool, 2>;
  EXPECT_EQ(residual16(gpt2, 0, bf16), (Pair{true, true}));
  EXPECT_EQ(residual16(llama, 1, flash16), (Pair{true, true}));
  EXPECT_EQ(residual16(llama, 0, ring), (Pair{true, true}));
  EXPECT_EQ(residual16(gpt2, 0, off), (Pair{false, false}));
  EXPECT_EQ(residual16(gpt2, 0, {}), (Pair{false, false}));
  EXPECT_EQ(residual16(gpt2, 0, mixed), (Pair{true, false}));  // fc2 in fp8
  PlanChoices out8 = bf16;
  out8.linears[LINEAR_ATTN_OUT] = RECIPE_FP8_CURRENT;
  EXPECT_EQ(residual16(gpt2, 0, out8), (Pair{false, true}));
  EXPECT_EQ(residual16(gpt2, 0, out16), (Pair{false, false}));  // precision.activations = f32 decides them
  EXPECT_EQ(residual16(llama, 0, sp), (Pair{false, false}));   // gathered in fp32 before the GEMMs
  PlanChoices tp = bf16;                                       // a whole d(residual) on every rank
  tp.tensor_parallel = true;
  EXPECT_EQ(residual16(llama, 0, tp), (Pair{true, true}));
  EXPECT_EQ(residual16(lora, 0, bf16), (Pair{true, false}));  // an adapter on down
  EXPECT_EQ(residual16(gpt2_lora, 0, bf16), (Pair{false, true}));  // on o
  EXPECT_EQ(residual16(moe, 1, bf16), (Pair{false, false}));
  EXPECT_EQ(residual16(moe, 0, bf16), (Pair{true, true}));
  ModelConfig olmo2 = llama;  // output norms: the gradient is the norm's
  olmo2.post_norm = true;
  EXPECT_EQ(residual16(olmo2, 0, bf16), (Pair{false, false}));
  EXPECT_EQ(residual16(model_preset("gemma-tiny"), 0, bf16), (Pair{false, false}));  // sandwich norms

  // Bytes: B T (C + attn_width + C + F) elements at 2 bytes instead of 4, for every policy's
  // fields that are kept (selective keeps the attention output; full nothing of them).
  for (const ModelConfig& c : {gpt2, llama}) {
    const int64_t B = 2, T = 8, C = c.d_model;
    const LayerPlan p16 = resolve_layer_plan(c, 0, bf16), p32 = resolve_layer_plan(c, 0, off);
    for (const RecomputePolicy keep : {RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL}) {
      const SavedShape shape{.batch = B, .seq_len = T, .keep = keep};
      const int64_t halved = keep == RECOMPUTE_NONE ? B * T * (C + c.attn_width() + C + c.d_ff)
                             : keep == RECOMPUTE_SELECTIVE ? B * T * c.attn_width() : 0;
      EXPECT_EQ(block_saved_bytes(c, p32, shape) - block_saved_bytes(c, p16, shape), 2 * halved) << c.arch << " keep " << static_cast<int>(keep);
      auto backend = make_cpu_backend();
      const BlockSaved s = allocate_block_saved(backend->allocator(), c, p16, shape);
      EXPECT_EQ(static_cast<int64_t>(backend->allocator().tracker().current(MEM_ACTIVATIONS)),
                block_saved_bytes(c, p16, shape));
      if (keep == RECOMPUTE_NONE) {
        EXPECT_EQ(s.attention.norm.out.dtype(), DTYPE_BF16);
        EXPECT_EQ(s.attention.attn.dtype(), DTYPE_BF16);
        EXPECT_EQ(s.mlp.norm.out.dtype(), DTYPE_BF16);
        EXPECT_EQ(s.mlp.act.dtype(), DTYPE_BF16);
        EXPECT_EQ(s.mlp.fc.dtype(), DTYPE_BF16);  // precision.outputs = bf16 (LayerPlan::fc_bf16)
        EXPECT_EQ(s.attention.qkv.dtype(), DTYPE_F32);
        EXPECT_EQ(s.attention.probs.dtype(), DTYPE_F32);
        EXPECT_EQ(s.mid.dtype(), DTYPE_F32);
      }
    }
  }
}

}  // namespace
}  // namespace loom
