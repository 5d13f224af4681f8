// Model configs: parameter counts, FLOPs per token, layout, validation, and the model-level
// gradient check (f32 model gradients against central differences of the f32 loss in double).
#include <gtest/gtest.h>

#include <string>

#include "loom/core/error.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/model/transformer.h"
#include "loom/nn/plan.h"
#include "test_util.h"

namespace loom {
namespace {

TEST(ModelConfigTest, Gpt2_124mHasTheKnownParameterCount) {
  EXPECT_EQ(param_count(model_preset("gpt2-124m")), 124439808);  // Hugging Face's gpt2
}

TEST(ModelConfigTest, LlamaParameterCountFollowsTheArchitecture) {
  const ModelConfig c = model_preset("llama-tiny");
  const int64_t C = 48, V = 101, F = 80, hd = 8, L = 2;
  const int64_t per_layer = C + (6 + 2 * 2) * hd * C + C * 6 * hd + C + 2 * F * C + C * F;
  EXPECT_EQ(param_count(c), V * C + L * per_layer + C + V * C);
}

TEST(ModelConfigTest, TrainFlopsPerTokenIsSixNPlusAttention) {
  const ModelConfig c = model_preset("gpt2-124m");
  const double n = 124439808.0 - 1024 * 768 - 12 * 4 * 768 - 2 * 768 - 12 * (3 * 768 + 768 + 3072 + 768);
  // Matmul weights only: no position table, norms or biases.
  EXPECT_EQ(matmul_param_count(c), static_cast<int64_t>(n));
  EXPECT_DOUBLE_EQ(train_flops_per_token(c, 1024), 6.0 * n + 12.0 * 12 * 768 * 1024);
}

TEST(ModelConfigTest, ValidationNamesTheKey) {
  ModelConfig c = model_preset("llama-tiny");
  c.n_kv_head = 4;  // 6 heads are not a multiple of 4
  try {
    c.validate();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_kv_head"), std::string::npos) << e.what();
  }
}

TEST(ParamLayoutTest, ParametersTileTheFlatBufferInOrder) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ParamLayout layout = build_param_layout(model_preset(preset));
    int64_t offset = 0;
    for (const ParamSpec& p : layout.params) {
      EXPECT_EQ(p.offset, offset) << p.name;
      int64_t rows = 0;
      for (const ParamSegment& s : p.segments) rows += s.rows;
      EXPECT_EQ(rows, p.shape.size() == 2 ? p.shape[0] : 1) << p.name;  // segments tile the rows
      EXPECT_EQ(p.role == ROLE_VECTOR, p.shape.size() == 1) << p.name;
      offset += p.numel;
    }
    EXPECT_EQ(offset, layout.total);
  }
}

// Model gradient vs central differences of the model's own loss, on a few elements of every
// parameter. The loss is f32, so the difference step is 1e-2 on weights of size 0.3 and the
// tolerance is 2e-3 relative (fp32 rounding of a ~4.6 loss is ~5e-7; divided by 2h = 2e-2).
// With train.flash_attention too (the blocks keep lse instead of the probabilities).
// Forward and backward of two sequences of 9 tokens, every parameter gradient against finite
// differences of the loss (large weights so that every path matters).
void expect_fd_gradients(ModelConfig config, bool flash, const std::string& label) {
  auto backend = make_cpu_backend();
  config.init_std = 0.3f;
  Transformer model(*backend, config);
  model.set_flash_attention(flash);
  model.init_weights(5);
  ActivationStore store = model.allocate_store(2, 9);
  Tensor tok = test::random_tokens(backend->allocator(), {2, 10}, static_cast<int32_t>(config.vocab_size), 7);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t t = 0; t < 9; ++t) {
      store.tokens.data<int32_t>()[b * 9 + t] = tok.data<int32_t>()[b * 10 + t];
      store.targets.data<int32_t>()[b * 9 + t] = tok.data<int32_t>()[b * 10 + t + 1];
    }
  }
  model.zero_grads();
  model.forward(store);
  model.backward(store, 1.0f);
  test::expect_model_gradients_match_fd(model, store, label);
}

TEST(TransformerTest, GradientsMatchFiniteDifferencesOfTheLoss) {
  for (const bool flash : {false, true}) {
    for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
      expect_fd_gradients(model_preset(preset), flash, std::string(preset) + (flash ? " flash" : ""));
    }
  }
}

// Qwen2's q/k/v biases and a head tied to the embedding (Llama 3.2, Qwen2 0.5B): the bias and
// the embedding's two gradients (as input and as head) against finite differences.
TEST(TransformerTest, QkvBiasAndTiedLlamaHeadGradientsMatchFiniteDifferences) {
  ModelConfig config = model_preset("llama-tiny");
  config.qkv_bias = config.tie_embeddings = true;
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  EXPECT_NO_THROW(model.param("model.layers.0.self_attn.qkv_proj.bias"));
  EXPECT_THROW(model.param("lm_head.weight"), Error);  // tied: the head is model.embed_tokens.weight
  expect_fd_gradients(config, false, "llama qkv_bias tied");
}

// Qwen3's per-head q/k RMSNorm and Llama 3.1's rescaled RoPE: the norms' weights and every
// other gradient through them against finite differences, with and without flash attention.
TEST(TransformerTest, QkNormAndLlama3RopeGradientsMatchFiniteDifferences) {
  ModelConfig config = model_preset("llama-tiny");
  config.qk_norm = true;
  config.rope_scaling = ROPE_SCALING_LLAMA3;
  config.rope_factor = 8.0f;
  config.rope_original_context = 16;
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  EXPECT_EQ(model.param("model.layers.0.self_attn.q_norm.weight").numel(), config.head_dim());
  EXPECT_EQ(model.param("model.layers.0.self_attn.k_norm.weight").numel(), config.head_dim());
  for (const bool flash : {false, true}) expect_fd_gradients(config, flash, flash ? "qk_norm flash" : "qk_norm");
}

// OLMo 2's blocks: the attention's and the MLP's outputs normed before the residual add (no
// input norms), q/k norms over all heads at once (weights of H hd and KV hd): every gradient
// against finite differences, with and without flash attention; the plan refuses what it does not
// run yet (tensor parallelism, recompute) by the key.
TEST(TransformerTest, PostNormsAndWholeQkNormsGradientsMatchFiniteDifferences) {
  ModelConfig config = model_preset("llama-tiny");
  config.post_norm = config.qk_norm = config.qk_norm_whole = true;
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  EXPECT_EQ(model.param("model.layers.0.self_attn.q_norm.weight").numel(), config.n_head * config.head_dim());
  EXPECT_EQ(model.param("model.layers.0.self_attn.k_norm.weight").numel(), config.n_kv_head * config.head_dim());
  EXPECT_NO_THROW(model.param("model.layers.0.post_feedforward_layernorm.weight"));
  EXPECT_THROW(model.param("model.layers.0.input_layernorm.weight"), Error);
  for (const bool flash : {false, true}) expect_fd_gradients(config, flash, flash ? "olmo2 flash" : "olmo2");
  ModelConfig moe = model_preset("moe-tiny");
  moe.post_norm = true;
  EXPECT_THROW(moe.validate(), Error);
  PlanChoices tp;
  tp.tensor_parallel = true;
  EXPECT_NE(test::error_of([&] { resolve_layer_plan(config, 0, tp); }).find("model.post_norm"), std::string::npos);
}

// Gemma 3's blocks (the gemma-tiny preset): pre and post norms around attention and MLP, per-head
// q/k norms, GeGLU, the embedding times sqrt(d), a windowed layer with its own RoPE base and a
// global one with linear scaling, a tied head: every gradient against finite differences, with
// and without flash attention. Each feature matters: dropping one changes the loss.
TEST(TransformerTest, Gemma3BlocksGradientsMatchFiniteDifferences) {
  const ModelConfig config = model_preset("gemma-tiny");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  for (const char* name : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"}) {
    EXPECT_EQ(model.param(str_cat("model.layers.1.", name, ".weight")).numel(), config.d_model) << name;
  }
  for (const bool flash : {false, true}) expect_fd_gradients(config, flash, flash ? "gemma3 flash" : "gemma3");
  const auto loss_of = [&](const ModelConfig& c) {
    Transformer m(*backend, c);
    m.init_weights(4);
    Tensor tok = test::random_tokens(backend->allocator(), {1, 9}, static_cast<int32_t>(c.vocab_size), 3);
    ActivationStore store = test::next_token_store(m, std::vector<int32_t>(tok.data<int32_t>(), tok.data<int32_t>() + 9));
    return m.forward(store);
  };
  const double gemma = loss_of(config);
  for (int variant = 0; variant < 5; ++variant) {
    ModelConfig other = config;
    if (variant == 0) other.gate_activation = GateActivation::silu;
    if (variant == 1) other.embed_scale = 0.0f;
    if (variant == 2) other.rope_local_theta = 0.0f;
    if (variant == 3) other.window_pattern = 0, other.rope_local_theta = 0.0f;
    if (variant == 4) other.attn_window = 0, other.window_pattern = 0, other.rope_local_theta = 0.0f;
    EXPECT_GT(std::abs(loss_of(other) - gemma), 1e-6) << "variant " << variant;
  }
  PlanChoices tp;
  tp.tensor_parallel = true;
  EXPECT_NE(test::error_of([&] { resolve_layer_plan(config, 0, tp); }).find("model.sandwich_norm"), std::string::npos);
}

// A zero-bubble pipeline's split backward (input pass, then weight pass) of OLMo 2's blocks gives
// the whole backward's gradients: the weight pass reads the blocks' inputs where the pre-norm
// blocks read their norms' outputs.
TEST(TransformerTest, PostNormSplitBackwardGivesTheWholeBackwardsGradients) {
  auto backend = make_cpu_backend();
  ModelConfig config = model_preset("llama-tiny");
  config.post_norm = config.qk_norm = config.qk_norm_whole = true;
  Transformer model(*backend, config);
  model.init_weights(2);
  ActivationStore store = model.allocate_stage_store(2, 7, 0, config.n_layer, true);
  Tensor tok = test::random_tokens(backend->allocator(), {2, 8}, static_cast<int32_t>(config.vocab_size), 3);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t t = 0; t < 7; ++t) {
      store.tokens.data<int32_t>()[b * 7 + t] = tok.data<int32_t>()[b * 8 + t];
      store.targets.data<int32_t>()[b * 7 + t] = tok.data<int32_t>()[b * 8 + t + 1];
    }
  }
  model.zero_grads();
  model.forward_stage(store, 0, config.n_layer);
  model.backward_stage(store, 0, config.n_layer, 1.0f, BACKWARD_ALL);
  const std::vector<double> whole = test::values(model.grads());
  model.zero_grads();
  model.forward_stage(store, 0, config.n_layer);
  model.backward_stage(store, 0, config.n_layer, 1.0f, BACKWARD_INPUT);
  model.backward_stage(store, 0, config.n_layer, 1.0f, BACKWARD_WEIGHT);
  EXPECT_LT(test::max_rel_error(test::values(model.grads()), whole), 1e-6);
}

// SmolLM3's NoPE layers (model.nope_interval = 2: layer 1 of llama-tiny without RoPE): every
// gradient against finite differences, and the layer's output truly unrotated: the same model
// with RoPE everywhere gives other logits.
TEST(TransformerTest, NopeLayersGradientsMatchFiniteDifferencesAndSkipRope) {
  ModelConfig config = model_preset("llama-tiny");
  config.nope_interval = 2;
  ASSERT_TRUE(config.rope_layer(0));
  ASSERT_FALSE(config.rope_layer(1));
  for (const bool flash : {false, true}) expect_fd_gradients(config, flash, flash ? "nope flash" : "nope");
  config.init_std = 0.3;  // scores far from uniform, so that positions matter
  auto backend = make_cpu_backend();
  Transformer nope(*backend, config);
  nope.init_weights(5);
  ModelConfig all = config;
  all.nope_interval = 0;
  Transformer rotated(*backend, all);
  rotated.init_weights(5);
  const std::vector<int32_t> tokens = {3, 1, 4, 1, 5, 9, 2, 6};
  ActivationStore a = test::next_token_store(nope, tokens), b = test::next_token_store(rotated, tokens);
  nope.forward(a);
  rotated.forward(b);
  const std::vector<double> la = test::values(*backend, a.logits), lb = test::values(*backend, b.logits);
  const int64_t V = config.vocab_size;
  double first = 0.0, later = 0.0, scale = 0.0;  // position 0 rotates by angle 0 in both: equal there
  for (size_t i = 0; i < la.size(); ++i) {
    (static_cast<int64_t>(i) < V ? first : later) = std::max(static_cast<int64_t>(i) < V ? first : later, std::abs(la[i] - lb[i]));
    scale = std::max(scale, std::abs(la[i]));
  }
  EXPECT_LT(first, 1e-6 * scale);
  EXPECT_GT(later, 1e-2 * scale) << later << " of " << scale;
  EXPECT_THROW(
      {
        ModelConfig gpt = model_preset("gpt2-tiny");
        gpt.nope_interval = 2;
        gpt.validate();
      },
      Error);
}

}  // namespace
}  // namespace loom
