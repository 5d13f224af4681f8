// Multi-head Latent Attention (model.mla_*; DeepSeek-V2 §2.1; nn/mla.h): the KV cache width, the
// parameter and FLOP counts, what is refused, gradients against finite differences, the
// zero-bubble split backward, and decoding (forward_rows through a DecodeCache) against the full
// forward. PyTorch parity: tests/test_parity.cpp (llama_tiny_mla*).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/model/transformer.h"
#include "loom/train/config.h"
#include "test_util.h"

namespace loom {
namespace {

using test::error_of;

// "1.23e-07": an error figure for RecordProperty (--gtest_output=json shows it).
std::string scientific(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2e", x);
  return buf;
}

// mla-tiny (d_c 16, d_r 4, d_n 8, d_v 8), with compressed queries (d_q 12) and other head widths
// when q_rank > 0.
ModelConfig mla_tiny(int64_t q_rank = 0, int64_t window = 0) {
  ModelConfig c = model_preset("mla-tiny");
  c.attn_window = window;
  if (q_rank > 0) c.mla_q_rank = q_rank, c.mla_nope_dim = 6, c.mla_v_dim = 10;
  return c;
}

TEST(MlaTest, KvCacheWidthIsTwoKvHeadsOrTheLatentAndRopeKey) {
  ModelConfig mha = model_preset("gpt2-124m");  // 12 heads of 64
  EXPECT_EQ(kv_cache_width(mha), 2 * 12 * 64);
  ModelConfig gqa = model_preset("llama-tiny");  // 2 KV heads of 8
  EXPECT_EQ(kv_cache_width(gqa), 2 * 2 * 8);
  ModelConfig mqa = gqa;
  mqa.n_kv_head = 1;
  EXPECT_EQ(kv_cache_width(mqa), 2 * 8);
  EXPECT_EQ(kv_cache_width(mla_tiny()), 16 + 4);
  // DeepSeek-V3: 576 floats per layer against 32768 for MHA of 128 heads of 128 (57x).
  ModelConfig v3 = gqa;
  v3.n_head = v3.n_kv_head = 128, v3.d_model = 7168, v3.head_size = 128;
  EXPECT_EQ(kv_cache_width(v3), 32768);
  v3.mla_kv_rank = 512, v3.mla_rope_dim = 64, v3.mla_nope_dim = 128, v3.mla_v_dim = 128, v3.mla_q_rank = 1536;
  EXPECT_EQ(kv_cache_width(v3), 576);
}

TEST(MlaTest, ParameterAndFlopCountsFollowTheProjections) {
  for (int64_t dq : {0, 12}) {
    const ModelConfig c = mla_tiny(dq);
    const int64_t C = 48, V = 101, F = 80, L = 2, H = 6, dc = 16, dr = 4, dn = c.mla_nope(), dv = c.mla_v();
    const int64_t queries = dq > 0 ? dq * C + dq + H * (dn + dr) * dq : H * (dn + dr) * C;
    const int64_t attention = queries + (dc + dr) * C + dc + H * (dn + dv) * dc + C * H * dv;
    EXPECT_EQ(param_count(c), V * C + L * (C + attention + C + 2 * F * C + C * F) + C + V * C) << dq;
    const int64_t matmul = attention - dc - (dq > 0 ? dq : 0);  // the norms do not multiply
    EXPECT_EQ(matmul_param_count(c), V * C + L * (matmul + 3 * F * C)) << dq;
    EXPECT_DOUBLE_EQ(train_flops_per_token(c, 10),
                     6.0 * static_cast<double>(matmul_param_count(c)) + 6.0 * L * 10 * H * (dn + dr + dv)) << dq;
  }
}

TEST(MlaTest, LayoutUsesDeepSeekV2NamesAndTilesTheBuffer) {
  const ParamLayout layout = build_param_layout(mla_tiny(12));
  for (const char* name : {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                           "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}) {
    const ParamSpec& p = layout.find(std::string("model.layers.1.self_attn.") + name);
    EXPECT_EQ(p.role == ROLE_VECTOR, p.shape.size() == 1) << name;
  }
  EXPECT_EQ(layout.find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").shape, (Shape{20, 48}));
  EXPECT_EQ(layout.find("model.layers.0.self_attn.kv_b_proj.weight").shape, (Shape{6 * 16, 16}));
  EXPECT_EQ(layout.find("model.layers.0.self_attn.o_proj.weight").shape, (Shape{48, 60}));
  int64_t offset = 0;
  for (const ParamSpec& p : layout.params) {
    EXPECT_EQ(p.offset, offset) << p.name;
    int64_t rows = 0;
    for (const ParamSegment& s : p.segments) rows += s.rows;
    EXPECT_EQ(rows, p.shape.size() == 2 ? p.shape[0] : 1) << p.name;
    offset += p.numel;
  }
  EXPECT_EQ(offset, layout.total);
}

TEST(MlaTest, UnsupportedCombinationsAreRefusedNamingTheKey) {
  ModelConfig gpt2 = model_preset("gpt2-tiny");
  gpt2.mla_kv_rank = 8, gpt2.mla_rope_dim = 4;
  EXPECT_NE(error_of([&] { gpt2.validate(); }).find("model.mla_kv_rank"), std::string::npos);
  ModelConfig odd = mla_tiny();
  odd.mla_rope_dim = 3;
  EXPECT_NE(error_of([&] { odd.validate(); }).find("model.mla_rope_dim"), std::string::npos);
  ModelConfig stray = model_preset("llama-tiny");
  stray.mla_q_rank = 8;
  EXPECT_NE(error_of([&] { stray.validate(); }).find("model.mla_kv_rank"), std::string::npos);
  const auto refused = [](const char* overrides, const char* key) {
    LoomConfig c;
    c.model = mla_tiny();
    c.train.seq_len = 8;
    c.sample.max_new_tokens = 0;
    apply_overrides(c, overrides);
    const std::string msg = error_of([&] { c.validate(); });
    EXPECT_NE(msg.find("model.mla_kv_rank"), std::string::npos) << overrides << ": " << msg;
    EXPECT_NE(msg.find(key), std::string::npos) << overrides << ": " << msg;
  };
  refused("parallel.tp=2", "parallel.tp");
  refused("parallel.cp=2", "parallel.cp");
  refused("parallel.sequence_parallel=true", "parallel.sequence_parallel");
  refused("train.recompute=selective", "train.recompute");
  auto backend = make_cpu_backend();
  Transformer model(*backend, mla_tiny());
  PrecisionConfig pc;
  pc.attn_qkv = "bf16";
  const std::string msg = error_of([&] { model.set_precision(resolve_policy(pc)); });
  EXPECT_NE(msg.find("precision.attn_qkv"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { model.set_recompute({RECOMPUTE_FULL, RECOMPUTE_NONE}); }).find("train.recompute"),
            std::string::npos);
}

// Fills a (B, T) store with tokens and next-token targets drawn from one seed.
void fill_batch(Backend& backend, ActivationStore& store, int64_t vocab, uint64_t seed) {
  const int64_t B = store.batch, T = store.seq_len;
  Tensor tok = test::random_tokens(backend.allocator(), {B, T + 1}, static_cast<int32_t>(vocab), seed);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      store.tokens.data<int32_t>()[b * T + t] = tok.data<int32_t>()[b * (T + 1) + t];
      store.targets.data<int32_t>()[b * T + t] = tok.data<int32_t>()[b * (T + 1) + t + 1];
    }
  }
}

// Model gradients (the MLA blocks' every weight among them) against central differences of the
// model's own f32 loss, as tests/test_model.cpp does: step 1e-2 on weights of size 0.3, 2e-3
// relative. Cases: direct and compressed queries, a sliding window, and MLA in an MoE model
// (all 4 experts selected, so that no routing decision flips inside a difference step).
TEST(MlaTest, GradientsMatchFiniteDifferencesOfTheLoss) {
  ModelConfig moe = mla_tiny();
  moe.moe_experts = 4, moe.moe_top_k = 4, moe.moe_d_ff = 32, moe.moe_shared = 1, moe.moe_dense_layers = 1;
  for (const ModelConfig& base : {mla_tiny(), mla_tiny(12), mla_tiny(12, 3), moe}) {
    auto backend = make_cpu_backend();
    ModelConfig config = base;
    config.init_std = 0.3f;
    Transformer model(*backend, config);
    model.init_weights(5);
    ActivationStore store = model.allocate_store(2, 9);
    fill_batch(*backend, store, config.vocab_size, 7);
    model.zero_grads();
    model.forward(store);
    model.backward(store, 1.0f);
    const double worst = test::expect_model_gradients_match_fd(
        model, store, str_cat("q_rank ", config.mla_q_rank, " window ", config.attn_window));
    RecordProperty("fd_max_error_q" + std::to_string(config.mla_q_rank) + "_w" + std::to_string(config.attn_window) +
                       (config.moe_experts > 0 ? "_moe" : ""),
                   scientific(worst));
  }
}

// A zero-bubble pipeline's split backward (input pass, then weight pass) gives the gradients of
// the whole backward: an MLA block's projections take theirs in the input pass.
TEST(MlaTest, SplitBackwardGivesTheWholeBackwardsGradients) {
  auto backend = make_cpu_backend();
  const ModelConfig config = mla_tiny(12);
  Transformer model(*backend, config);
  model.init_weights(2);
  ActivationStore store = model.allocate_stage_store(2, 7, 0, config.n_layer, true);
  fill_batch(*backend, store, config.vocab_size, 3);
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

// The full forward's logits (B, T, V) of tokens (B, T).
std::vector<float> full_logits(Transformer& model, const Tensor& tokens) {
  ActivationStore full = model.allocate_store(tokens.dim(0), tokens.dim(1));
  model.backend().copy(tokens, full.tokens);
  model.forward(full, false);
  return std::vector<float>(full.logits.data<float>(), full.logits.data<float>() + full.logits.numel());
}

// A DecodeCache that keeps every sequence's latents in a std::vector per (sequence, layer) and
// returns all of them (the block applies model.attn_window).
class VectorLatentCache final : public DecodeCache {
 public:
  VectorLatentCache(const ModelConfig& config, int64_t sequences)
      : width_(kv_cache_width(config)),
        latents_(static_cast<size_t>(sequences), std::vector<std::vector<float>>(static_cast<size_t>(config.n_layer))) {}
  std::vector<int64_t> seqs;  // [row] -> sequence
  void attend(int64_t, int64_t, const float*, const float*, const float*, float*) override {
    throw Error("VectorLatentCache holds MLA latents only");
  }
  const float* latent(int64_t layer, int64_t row, const float* latent, int64_t* count) override {
    std::vector<float>& l = latents_[static_cast<size_t>(seqs[static_cast<size_t>(row)])][static_cast<size_t>(layer)];
    l.insert(l.end(), latent, latent + width_);
    const int64_t n = static_cast<int64_t>(l.size()) / width_;
    *count = n;
    return l.data();
  }

 private:
  int64_t width_;
  std::vector<std::vector<std::vector<float>>> latents_;  // [sequence][layer] (positions x width)
};

// Transformer::forward_rows decodes two sequences side by side, the second two positions behind
// (rows at different positions in one step), and gives the full forward's logits.
TEST(MlaTest, ForwardRowsThroughALatentCacheMatchesFullForward) {
  for (const ModelConfig& config : {mla_tiny(), mla_tiny(12, 3)}) {
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(3);
    const int64_t T = 11, V = config.vocab_size;
    Tensor tok = test::random_tokens(backend->allocator(), {2, T}, static_cast<int32_t>(V), 6);
    const std::vector<float> expected = full_logits(model, tok);
    VectorLatentCache cache(config, 2);
    ActivationStore one = model.allocate_rows(1), two = model.allocate_rows(2);
    for (int64_t t = 0; t < T + 2; ++t) {
      std::vector<int32_t> toks;
      std::vector<int64_t> pos;
      cache.seqs.clear();
      for (int64_t s = 0; s < 2; ++s) {
        const int64_t p = t - 2 * s;
        if (p < 0 || p >= T) continue;
        toks.push_back(tok.data<int32_t>()[s * T + p]), pos.push_back(p), cache.seqs.push_back(s);
      }
      ActivationStore& step = toks.size() == 2 ? two : one;
      model.forward_rows(step, toks, pos, cache);
      for (size_t r = 0; r < toks.size(); ++r) {
        const int64_t s = cache.seqs[r];
        for (int64_t v = 0; v < V; ++v) {
          ASSERT_NEAR(step.logits.data<float>()[static_cast<int64_t>(r) * V + v], expected[(s * T + pos[r]) * V + v], 1e-5)
              << "q_rank " << config.mla_q_rank << " sequence " << s << " position " << pos[r];
        }
      }
    }
  }
}

}  // namespace
}  // namespace loom
