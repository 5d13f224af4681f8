// LoRA (nn/lora.h, arch/param_layout.h lora_sites, checkpoint/peft.h): the adapters' place in
// the flat layout, a LoRA model at step 0 equal to its base bit for bit, finite differences of
// the adapters' gradients, the frozen base (no gradient written, no optimizer state, its gradient
// pages released), merging (the base untouched, the merged model's logits those of the adapted
// one), PEFT's layout written and read back, and the refusals naming peft.* keys; then the same
// for DoRA (peft.dora, below). PyTorch's reference of the formulas on PEFT-layout adapters:
// tests/test_lora_parity.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/peft.h"
#include "loom/core/error.h"
#include "loom/core/pages.h"
#include "loom/infer/engine.h"
#include "loom/infer/kv_cache.h"
#include "kv_test_util.h"
#include "loom/memory/estimate.h"
#include "loom/model/transformer.h"
#include "loom/nn/lora.h"
#include "loom/precision/policy.h"
#include "loom/train/trainer.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

ModelConfig lora_of(ModelConfig c, const std::string& targets, int64_t rank = 4, float alpha = 8.0f) {
  c.peft_method = PeftMethod::lora;
  c.lora_targets = targets;
  c.lora_rank = rank;
  c.lora_alpha = alpha;
  return c;
}

// Every linear layer of a block (GPT-2 has no gate).
const char* every_target(const ModelConfig& c) { return c.arch == ARCH_GPT2 ? "q,k,v,o,up,down" : "q,k,v,o,gate,up,down"; }

void fill_tokens(ActivationStore& s, int32_t vocab, uint64_t seed) {
  for (int64_t i = 0; i < s.tokens.numel(); ++i) {
    s.tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 37 + seed * 11) % vocab);
    s.targets.data<int32_t>()[i] = static_cast<int32_t>((i * 53 + 7 + seed) % vocab);
  }
}

bool is_magnitude(const ParamSpec& p) { return p.name.find(".lora_magnitude_vector") != std::string::npos; }

// Every adapter's A and B get random values (a trained adapter), so that LoRA changes the
// outputs; DoRA's magnitudes their initial norms perturbed by up to 30%.
void randomize_adapters(Transformer& m, uint64_t seed, bool dora = false) {
  float* p = m.params().data<float>();
  const int64_t begin = lora_begin(m.config(), m.layout());
  for (const ParamSpec& spec : m.layout().params) {
    if (spec.offset < begin) continue;
    for (int64_t i = spec.offset; i < spec.offset + spec.numel; ++i) {
      const float r = std::sin(static_cast<float>(static_cast<double>(i) * 12.9898 + static_cast<double>(seed)));
      if (dora && is_magnitude(spec)) p[i] *= 1.0f + 0.3f * r;
      else p[i] = 0.3f * r;
    }
  }
}

std::vector<float> logits_of(Transformer& m, int64_t B, int64_t T) {
  ActivationStore s = m.allocate_store(B, T);
  fill_tokens(s, static_cast<int32_t>(m.config().vocab_size), 3);
  m.forward(s);
  const float* l = s.logits.data<float>();
  return std::vector<float>(l, l + s.logits.numel());
}

TEST(LoraLayout, AdaptersFollowTheUnchangedBase) {
  const ModelConfig base = model_preset("llama-tiny");
  const ModelConfig c = lora_of(base, "q,k,v,o,gate,up,down", 4);
  const ParamLayout lb = build_param_layout(base), ll = build_param_layout(c);
  ASSERT_EQ(lora_begin(c, ll), lb.total);
  for (size_t i = 0; i < lb.params.size(); ++i) {
    EXPECT_EQ(ll.params[i].name, lb.params[i].name);
    EXPECT_EQ(ll.params[i].offset, lb.params[i].offset);
  }
  const int64_t C = c.d_model, F = c.d_ff, q = c.n_head * c.head_dim(), kv = c.n_kv_head * c.head_dim();
  const int64_t per_layer = 4 * ((C + q) + (C + kv) + (C + kv) + (q + C) + 2 * (C + F) + (F + C));
  EXPECT_EQ(ll.total - lb.total, c.n_layer * per_layer);
  const ParamSpec& a = ll.find("model.layers.1.self_attn.v_proj.lora_A.weight");
  const ParamSpec& b = ll.find("model.layers.1.self_attn.v_proj.lora_B.weight");
  EXPECT_EQ(a.shape, (Shape{4, C}));
  EXPECT_EQ(b.shape, (Shape{kv, 4}));
  EXPECT_EQ(b.init, INIT_ZEROS);
  const std::vector<LoraSite> sites = lora_sites(c, 0);
  ASSERT_EQ(sites.size(), 7u);
  EXPECT_EQ(sites[2].out_begin, q + kv);  // v's rows of the fused qkv
  EXPECT_EQ(sites[5].out_begin, F);       // up's rows of the fused gate_up
  // The units (ZeRO-3, pipeline stages) cover every element exactly once.
  RangeSet all;
  int64_t covered = 0;
  for (const RangeSet& u : layout_units(c, ll)) {
    EXPECT_TRUE(all.intersect(u).empty());
    all = all.unite(u);
    covered += u.size();
  }
  EXPECT_EQ(covered, ll.total);
  EXPECT_EQ(all.size(), ll.total);
  // GPT-2: q, k, v are one adapter on c_attn (Hugging Face's one matrix).
  const ModelConfig g = lora_of(model_preset("gpt2-tiny"), "q,k,v,o,up,down");
  const std::vector<LoraSite> gs = lora_sites(g, 0);
  ASSERT_EQ(gs.size(), 4u);
  EXPECT_EQ(gs[0].module, "h.0.attn.c_attn");
  EXPECT_EQ(gs[0].out_count, 3 * g.d_model);
  EXPECT_EQ(g.lora_scale(), 2.0f);
  ModelConfig rs = g;
  rs.lora_rslora = true;
  EXPECT_EQ(rs.lora_scale(), 4.0f);  // 8 / sqrt(4)
}

// Step 0 is the base bit for bit (LoRA: B = 0; DoRA: also m = the rows' norms, so g = 1).
TEST(LoraModel, StepZeroGivesTheBaseLogitsBitwise) {
  for (const bool dora : {false, true}) {
    for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
      auto backend = make_cpu_backend();
      const ModelConfig base = model_preset(preset);
      Transformer plain(*backend, base);
      plain.init_weights(7);
      ModelConfig c = lora_of(base, every_target(base));
      c.lora_dora = dora;
      Transformer adapted(*backend, c);
      adapted.init_weights(7);
      // Same base weights (same offsets and Philox streams); A random, B zero.
      ASSERT_EQ(std::memcmp(plain.params().data<float>(), adapted.params().data<float>(),
                            static_cast<size_t>(plain.params().numel()) * sizeof(float)), 0) << preset;
      const std::vector<float> want = logits_of(plain, 2, 16), got = logits_of(adapted, 2, 16);
      ASSERT_EQ(want.size(), got.size());
      EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0) << preset << " dora " << dora;
      if (!dora) continue;
      // m = ||W_j|| of the rows each adapter covers (q, k, v of the fused qkv apart for Llama).
      const LoraSite site = lora_sites(c, 1).back();
      const ParamSpec& w = adapted.layout().find(site.weight);
      const ParamSpec& m = adapted.layout().find(site.module + ".lora_magnitude_vector");
      ASSERT_EQ(m.numel, site.out_count);
      const float* p = adapted.params().data<float>();
      for (int64_t j = 0; j < site.out_count; j += 7) {
        double ss = 0.0;
        for (int64_t i = 0; i < site.in; ++i) {
          const double v = p[w.offset + (site.out_begin + j) * site.in + i];
          ss += v * v;
        }
        EXPECT_NEAR(p[m.offset + j], std::sqrt(ss), 1e-6 * std::sqrt(ss)) << preset << " " << m.name;
      }
    }
  }
}

// A preset, "+olmo2": with OLMo 2's post-norms and whole-width q/k norms; "+nope": SmolLM3's
// NoPE layers (every second block unrotated).
ModelConfig family_preset(const std::string& name) {
  ModelConfig c = model_preset(name.substr(0, name.find('+')));
  if (name.find("+olmo2") != std::string::npos) c.post_norm = c.qk_norm = c.qk_norm_whole = true;
  if (name.find("+nope") != std::string::npos) c.nope_interval = 2;
  return c;
}

TEST(LoraModel, AdapterGradientsMatchFiniteDifferencesAndTheBaseGetsNone) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny", "llama-tiny+olmo2", "llama-tiny+nope", "gemma-tiny"}) {
    auto backend = make_cpu_backend();
    const ModelConfig base = family_preset(preset);
    const ModelConfig c = lora_of(base, base.arch == ARCH_GPT2 ? "q,k,v,o,up,down" : "q,v,o,gate,down", 2, 4.0f);
    Transformer model(*backend, c);
    model.init_weights(3);
    randomize_adapters(model, 5);
    ActivationStore s = model.allocate_store(2, 8);
    fill_tokens(s, static_cast<int32_t>(c.vocab_size), 1);
    model.zero_grads();
    model.forward(s);
    model.backward(s, 1.0f);
    const int64_t begin = lora_begin(c, model.layout());
    const float* g = model.grads().data<float>();
    for (int64_t i = 0; i < begin; ++i) ASSERT_EQ(g[i], 0.0f) << preset << " base gradient " << i;
    double norm = 0;
    for (int64_t i = begin; i < model.layout().total; ++i) norm += static_cast<double>(g[i]) * g[i];
    EXPECT_GT(norm, 0.0);
    // Finite differences at 3 elements of every adapter matrix. With q/k norms (OLMo 2) these
    // adapters (0.3, scale 2) saturate the softmax: steps of 1e-2 leave a truncation error past
    // the tolerance, steps of 1e-3 agree (as they do for Qwen3's per-head norms), so the step is
    // smaller there, the tolerance the same.
    test::expect_model_gradients_match_fd(model, s, preset, begin, base.qk_norm ? 1e-3f : 1e-2f);
  }
}

// peft.dropout: the op keeps 1 - p of the elements scaled by 1 / (1 - p), the same draw the same
// mask; in the model a training pass's adapter gradients are those of its masked loss (finite
// differences with the same masks), and a pass without dropout (evaluation) is plain LoRA.
TEST(LoraDropout, TheOpKeepsOneMinusPAndTheDrawRegeneratesTheMask) {
  auto backend = make_cpu_backend();
  Allocator& a = backend->allocator();
  const int64_t n = 40000;
  const Tensor x = test::random_tensor(a, {n}, DTYPE_F32, 4), out = Tensor::empty(a, {n}, DTYPE_F32, MEM_WORKSPACE);
  const RoundingDraw draw{kLoraDropoutSeed, 3, 9};
  backend->dropout(x, out, 0.25f, draw);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = out.data<float>()[i];
    if (v == 0.0f) continue;
    ++kept;
    ASSERT_EQ(v, x.data<float>()[i] * (1.0f / 0.75f)) << i;
  }
  EXPECT_NEAR(static_cast<double>(kept) / n, 0.75, 0.01);
  const Tensor again = Tensor::empty(a, {n}, DTYPE_F32, MEM_WORKSPACE), other = Tensor::empty(a, {n}, DTYPE_F32, MEM_WORKSPACE);
  backend->copy(x, again);
  backend->dropout(again, again, 0.25f, draw);  // in place, the same draw: the same values
  EXPECT_EQ(std::memcmp(again.data<float>(), out.data<float>(), n * sizeof(float)), 0);
  backend->dropout(x, other, 0.25f, RoundingDraw{kLoraDropoutSeed, 3, 10});
  EXPECT_NE(std::memcmp(other.data<float>(), out.data<float>(), n * sizeof(float)), 0);
}

TEST(LoraDropout, GradientsAreThoseOfTheMaskedLossAndEvaluationHasNone) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    auto backend = make_cpu_backend();
    ModelConfig c = lora_of(model_preset(preset), every_target(model_preset(preset)), 2, 4.0f);
    c.lora_dropout = 0.3f;
    Transformer model(*backend, c);
    model.init_weights(3);
    randomize_adapters(model, 5);
    ActivationStore s = model.allocate_store(2, 8);
    fill_tokens(s, static_cast<int32_t>(c.vocab_size), 1);
    const int64_t begin = lora_begin(c, model.layout());
    // Evaluation (pass 0): plain LoRA, bit for bit.
    ModelConfig plain_config = c;
    plain_config.lora_dropout = 0.0f;
    Transformer plain(*backend, plain_config);
    backend->copy(model.params(), plain.params());
    ActivationStore ps = plain.allocate_store(2, 8);
    fill_tokens(ps, static_cast<int32_t>(c.vocab_size), 1);
    EXPECT_EQ(model.forward(s), plain.forward(ps)) << preset;
    // A training pass: other outputs (the test can fail), and the masked loss's gradients.
    s.dropout_pass = 7;
    model.zero_grads();
    const double dropped = model.forward(s);
    EXPECT_NE(dropped, plain.forward(ps)) << preset;
    model.backward(s, 1.0f);
    test::expect_model_gradients_match_fd(model, s, str_cat(preset, " with dropout"), begin);
  }
}

// Decoding (Transformer::forward_rows through a paged KV cache) applies the adapters too: each
// position's logits equal the full forward's.
void expect_decoding_matches_full(Backend& backend, Transformer& model, const std::string& what) {
  const ModelConfig& c = model.config();
  const int64_t T = 6, V = c.vocab_size;
  ActivationStore full = model.allocate_store(1, T);
  fill_tokens(full, static_cast<int32_t>(V), 2);
  model.forward(full, false);
  EngineConfig ec;
  ec.max_batch = 1;
  auto cache = make_paged_kv_cache(engine_cache_config(c, ec), &backend.allocator());
  kvtest::CacheRows rows;
  rows.cache = cache.get(), rows.config = &c, rows.seqs = {cache->add_sequence()};
  ActivationStore one = model.allocate_rows(1);
  for (int64_t t = 0; t < T; ++t) {
    model.forward_rows(one, {full.tokens.data<int32_t>()[t]}, {t}, rows);
    std::vector<double> got(one.logits.data<float>(), one.logits.data<float>() + V);
    std::vector<double> want(full.logits.data<float>() + t * V, full.logits.data<float>() + (t + 1) * V);
    EXPECT_LT(test::max_rel_error(got, want), 1e-5) << what << " position " << t;
    cache->advance(rows.seqs[0]);
  }
}

TEST(LoraModel, DecodingRowsMatchTheFullForward) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny", "llama-tiny+olmo2", "llama-tiny+nope", "gemma-tiny"}) {
    auto backend = make_cpu_backend();
    const ModelConfig base = family_preset(preset);
    Transformer model(*backend, lora_of(base, every_target(base)));
    model.init_weights(3);
    randomize_adapters(model, 9);
    expect_decoding_matches_full(*backend, model, preset);
  }
}

// Merging (DoRA too): the base untouched, the merged model's logits those of the adapted one; the
// adapters matter (the base's logits differ, and for DoRA also plain LoRA's with the same A, B).
TEST(LoraModel, MergeKeepsTheBaseAndGivesTheAdaptedLogits) {
  for (const bool dora : {false, true}) {
    for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
      const std::string what = str_cat(preset, dora ? " DoRA" : " LoRA");
      auto backend = make_cpu_backend();
      const ModelConfig base = model_preset(preset);
      ModelConfig c = lora_of(base, every_target(base));
      c.lora_dora = dora;
      Transformer adapted(*backend, c);
      adapted.init_weights(11);
      randomize_adapters(adapted, 13, dora);
      const std::vector<float> before(adapted.params().data<float>(),
                                      adapted.params().data<float>() + adapted.params().numel());
      Transformer merged(*backend, lora_base_config(c));
      lora_merge(*backend, c, adapted.params(), merged.params());
      // Unmerged = the base, bit for bit: merging wrote elsewhere.
      EXPECT_EQ(std::memcmp(before.data(), adapted.params().data<float>(), before.size() * sizeof(float)), 0);
      const std::vector<float> a = logits_of(adapted, 2, 12), m = logits_of(merged, 2, 12);
      const std::vector<double> ad(a.begin(), a.end()), md(m.begin(), m.end());
      EXPECT_LT(test::max_rel_error(md, ad), 1e-5) << what;
      // The other model with the same bytes where its layout has them: the base (LoRA), or plain
      // LoRA with the same A and B (DoRA).
      ModelConfig other_config = dora ? c : base;
      other_config.lora_dora = false;
      Transformer other(*backend, other_config);
      for (const ParamSpec& spec : other.layout().params) {
        std::memcpy(other.params().data<float>() + spec.offset, before.data() + adapted.layout().find(spec.name).offset,
                    static_cast<size_t>(spec.numel) * sizeof(float));
      }
      const std::vector<float> o = logits_of(other, 2, 12);
      EXPECT_GT(test::max_rel_error(std::vector<double>(o.begin(), o.end()), ad), 1e-3) << what;
      if (dora) expect_decoding_matches_full(*backend, adapted, what);
    }
  }
}

// PEFT's folders (DoRA's use_dora and magnitudes too) written and read back bit for bit.
TEST(LoraPeft, AdapterFoldersRoundTrip) {
  for (const bool dora : {false, true}) {
    for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
      const std::string what = str_cat(preset, dora ? " DoRA" : " LoRA");
      auto backend = make_cpu_backend();
      const ModelConfig base = model_preset(preset);
      ModelConfig c = lora_of(base, base.arch == ARCH_GPT2 ? "q,k,v,up" : "k,o,down", 3, 6.0f);
      c.lora_rslora = true;
      c.lora_dropout = 0.05f;
      c.lora_dora = dora;
      Transformer model(*backend, c);
      model.init_weights(1);
      randomize_adapters(model, 2, dora);
      const std::string dir = (fs::temp_directory_path() / ("loom_peft_" + std::string(preset))).string();
      fs::remove_all(dir);
      save_peft_adapter(dir, ModelState{c, model.params()});
      ASSERT_TRUE(is_peft_adapter_dir(dir));
      const nlohmann::json j = nlohmann::json::parse(test::read_file_bytes(dir + "/adapter_config.json"));
      EXPECT_EQ(j.at("use_dora").get<bool>(), dora) << what;
      const ModelConfig read = peft_adapter_config(dir, base);
      EXPECT_TRUE(read.lora());
      EXPECT_EQ(read.lora_rank, 3);
      EXPECT_EQ(read.lora_alpha, 6.0f);
      EXPECT_TRUE(read.lora_rslora);
      EXPECT_EQ(read.lora_dropout, 0.05f);  // adapter_config.json's lora_dropout
      EXPECT_EQ(read.lora_dora, dora);
      EXPECT_EQ(read.lora_targets, c.lora_targets);
      Transformer back(*backend, read);
      back.init_weights(99);  // different adapters until loaded
      load_peft_adapter(dir, ModelState{read, back.params()});
      const int64_t begin = lora_begin(c, model.layout());
      EXPECT_EQ(std::memcmp(model.params().data<float>() + begin, back.params().data<float>() + begin,
                            static_cast<size_t>(model.layout().total - begin) * sizeof(float)), 0) << what;
      if (dora) {  // read as a plain LoRA model's adapter, the magnitudes are named as not belonging
        ModelConfig lora = read;
        lora.lora_dora = false;
        Transformer plain(*backend, lora);
        const std::string msg = test::error_of([&] { load_peft_adapter(dir, ModelState{lora, plain.params()}); });
        EXPECT_NE(msg.find("lora_magnitude_vector"), std::string::npos) << msg;
      }
      fs::remove_all(dir);
    }
  }
}

TEST(LoraTrain, TheBaseStaysFrozenWithoutGradientsOrOptimizerState) {
  auto backend = make_cpu_backend();
  ModelConfig base = model_preset("gpt2-tiny");
  base.d_model = 128, base.d_ff = 512, base.n_head = 4, base.n_kv_head = 4, base.vocab_size = 512;
  const ModelConfig c = lora_of(base, "q,k,v,o,up,down", 4, 8.0f);
  Transformer model(*backend, c);
  model.init_weights(1);
  const int64_t begin = lora_begin(c, model.layout()), adapters = model.layout().total - begin;
  const std::vector<float> frozen(model.params().data<float>(), model.params().data<float>() + begin);
  TrainConfig tc;
  tc.batch_size = 4, tc.seq_len = 16, tc.steps = 30, tc.schedule.warmup = 2, tc.schedule.max_lr = 1e-2;
  Trainer trainer(*backend, model, tc);
  std::vector<int32_t> tokens(2000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7 + i / 97) % 97);
  RandomWindowSource data(tokens, 3);
  const double first = trainer.train_step(data).loss;
  double last = first;
  for (int i = 1; i < tc.steps; ++i) last = trainer.train_step(data).loss;
  EXPECT_LT(last, first - 0.1);  // deterministic: the adapters learn (slowly, on a random base)
  EXPECT_EQ(std::memcmp(frozen.data(), model.params().data<float>(), frozen.size() * sizeof(float)), 0);
  // AdamW's m and v for the adapters only.
  EXPECT_EQ(backend->allocator().tracker().peak(MEM_OPTIMIZER_STATE), static_cast<size_t>(8 * adapters));
  // The base's gradient pages were released and never written again: what stays resident is
  // the adapters' gradients (plus the page they share with the base's last elements).
  const int64_t page = 4096, resident = resident_bytes(model.grads());
  EXPECT_LE(resident, 4 * adapters + 2 * page);
  EXPECT_GT(4 * begin, 8 * (4 * adapters + 2 * page));  // the measure can fail
  std::printf("LoRA: %lld adapter of %lld parameters; gradient buffer %lld bytes resident of %lld; loss %.4f -> %.4f\n",
              static_cast<long long>(adapters), static_cast<long long>(model.layout().total),
              static_cast<long long>(resident), static_cast<long long>(4 * model.layout().total), first, last);
}

// loom memory: a LoRA run's estimate counts gradients and optimizer state of the adapters only,
// and the methods table follows its formulas (Llama-3-8B's shape, AdamW).
TEST(LoraMemory, EstimateAndMethodsTable) {
  MemoryPlan plan;
  plan.model = lora_of(model_preset("llama-tiny"), "q,k,v,o,gate,up,down", 4);
  plan.batch = 2, plan.seq_len = 16;
  const ParamLayout layout = build_param_layout(plan.model);
  const int64_t A = layout.total - lora_begin(plan.model, layout);
  const MemoryEstimate e = estimate_memory(plan);
  EXPECT_EQ(e.bytes[MEM_PARAMETERS], 4 * layout.total);
  EXPECT_EQ(e.bytes[MEM_GRADIENTS], 4 * A);
  EXPECT_EQ(e.bytes[MEM_OPTIMIZER_STATE], 8 * A);
  // QLoRA: the block matrices' fp32 bytes become their NF4 bytes (the fp32 elements are released,
  // or never written when the base is read from a folder); gradients and state unchanged.
  MemoryPlan q = plan;
  q.model.lora_quantize_base = true;
  int64_t matrix_floats = 0, matrix_nf4 = 0;
  for (const ParamSpec& spec : layout.params) {
    if (spec.offset < lora_begin(plan.model, layout) && spec.role == ROLE_HIDDEN && spec.shape.size() == 2) {
      matrix_floats += spec.numel, matrix_nf4 += static_cast<int64_t>(nf4_bytes(spec.numel));
    }
  }
  // llama-tiny, per layer: qkv (48 + 2 x 2 x 8) x 48, o 48 x 48, gate/up 2 x 80 x 48, down 48 x 80.
  EXPECT_EQ(matrix_floats, 2 * (80 * 48 + 48 * 48 + 160 * 48 + 48 * 80));
  const MemoryEstimate eq = estimate_memory(q);
  EXPECT_EQ(eq.bytes[MEM_PARAMETERS], 4 * layout.total - 4 * matrix_floats + matrix_nf4);
  EXPECT_EQ(eq.bytes[MEM_WORKSPACE], 4 * 160 * 48);  // the NF4 weight dequantized per call: gate/up, the largest
  EXPECT_EQ(e.bytes[MEM_WORKSPACE], 0);
  EXPECT_EQ(eq.bytes[MEM_GRADIENTS], 4 * A);
  EXPECT_EQ(eq.bytes[MEM_OPTIMIZER_STATE], 8 * A);

  ModelConfig llama8b = model_preset("llama-tiny");
  llama8b.vocab_size = 128256, llama8b.d_model = 4096, llama8b.n_layer = 32, llama8b.n_head = 32;
  llama8b.n_kv_head = 8, llama8b.d_ff = 14336, llama8b.max_seq_len = 8192;
  llama8b.lora_rank = 16, llama8b.lora_targets = "q,k,v,o,gate,up,down";
  OptimConfig adamw;
  adamw.name = "adamw";
  const std::vector<FinetuneMemory> rows = finetune_memory(llama8b, adamw);
  ASSERT_EQ(rows.size(), 3u);
  const int64_t P = 8030261248;  // Llama-3-8B
  EXPECT_EQ(rows[0].trainable, P);
  EXPECT_EQ(rows[0].total(), 16 * P);
  // r (in + out) per adapted matrix: 32 layers x 16 x (4096+4096 + 4096+1024 + 4096+1024 + 4096+4096 + 2 (4096+14336) + 14336+4096)
  const int64_t A8 = 32LL * 16 * (8192 + 5120 + 5120 + 8192 + 2 * 18432 + 18432);
  EXPECT_EQ(rows[1].trainable, A8);
  EXPECT_EQ(rows[1].gradients, 4 * A8);
  EXPECT_EQ(rows[1].optimizer, 8 * A8);
  // QLoRA: 6,979,321,856 block-matrix parameters at ~4.127 bits, 1,050,939,392 others in bf16.
  const int64_t matrices = 6979321856LL;
  // docs/finetune.md's NF4 figure for the 224 separate matrices, less the 4-byte double-quantization
  // mean of the 96 that Loom holds fused (q/k/v and gate/up: 128 tensors).
  EXPECT_EQ(rows[2].weights - 4 * A8 - 2 * (P - matrices), 3600417664LL - 96 * 4);
  std::printf("Llama-3-8B, AdamW: full %.1f GB, LoRA r=16 all linear %.1f GB (%lld trainable), QLoRA %.1f GB\n",
              rows[0].total() / 1e9, rows[1].total() / 1e9, static_cast<long long>(A8), rows[2].total() / 1e9);
}

TEST(LoraConfig, BadKeysAreRefusedByName) {
  const ModelConfig llama = model_preset("llama-tiny");
  EXPECT_NE(test::error_of([&] { lora_of(llama, "q,x").validate(); }).find("'x' matches no layer"), std::string::npos);
  EXPECT_NE(test::error_of([&] { lora_of(llama, "q", 1000).validate(); }).find("peft.rank = 1000 is larger than"),
            std::string::npos);
  EXPECT_EQ(lora_sites(lora_of(model_preset("gpt2-tiny"), "q"), 0).size(), 1u);  // c_attn, whole
  EXPECT_NE(test::error_of([&] { lora_of(model_preset("gpt2-tiny"), "gate").validate(); }).find("no gate"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { lora_of(model_preset("mla-tiny"), "q").validate(); }).find("MLA"), std::string::npos);
  EXPECT_NE(test::error_of([&] { lora_of(model_preset("moe-tiny"), "q,down").validate(); }).find("MoE"),
            std::string::npos);
  ModelConfig zero = lora_of(llama, "q");
  zero.lora_alpha = 0.0f;
  EXPECT_NE(test::error_of([&] { zero.validate(); }).find("peft.alpha"), std::string::npos);
}

// ---- DoRA (peft.dora; nn/lora.h): the three row ops against naive double references, a DoRA
// model at step 0 equal to its base bit for bit, the magnitudes' gradients against central
// differences (A's and B's follow PEFT's detached norm, which finite differences of the model
// cannot see: tests/test_lora_parity.cpp checks them against PyTorch) and the refusals (merging,
// decoding and PEFT's use_dora folders: with LoRA's tests above).

ModelConfig dora_of(ModelConfig c, const std::string& targets, int64_t rank = 4, float alpha = 8.0f) {
  c = lora_of(c, targets, rank, alpha);
  c.lora_dora = true;
  return c;
}

// t's values written into a tensor of `backend` (host data drawn on the CPU backend).
Tensor on(Backend& backend, const Tensor& host) {
  const Tensor t = Tensor::empty(backend.allocator(), host.shape(), DTYPE_F32, MEM_WORKSPACE);
  backend.write(t, host.data<float>());
  return t;
}

TEST(DoraOps, RowNormsWeightAndBackwardMatchDoubleReferences) {
  auto cpu = make_cpu_backend();
  Allocator& host = cpu->allocator();
  for (const char* name : {"cpu", "strict"}) {
    std::unique_ptr<Backend> backend = std::string(name) == "cpu" ? make_cpu_backend() : std::make_unique<test::StrictBackend>();
    Allocator& a = backend->allocator();
    const int64_t rows = 37, cols = 53;
    const Tensor merged = on(*backend, test::random_tensor(host, {rows, cols}, DTYPE_F32, 1));
    const Tensor base = on(*backend, test::random_tensor(host, {rows, cols}, DTYPE_F32, 2));
    const Tensor mag = on(*backend, test::random_tensor(host, {rows}, DTYPE_F32, 3));
    const Tensor grad = on(*backend, test::random_tensor(host, {rows, cols}, DTYPE_F32, 4));
    const Tensor norms = Tensor::empty(a, {rows}, DTYPE_F32, MEM_WORKSPACE);
    const Tensor out = Tensor::empty(a, {rows, cols}, DTYPE_F32, MEM_WORKSPACE);
    const Tensor dm = on(*backend, test::random_tensor(host, {rows}, DTYPE_F32, 5));  // accumulated into
    const std::vector<double> w = test::values(*backend, merged), b = test::values(*backend, base);
    const std::vector<double> m = test::values(*backend, mag), g = test::values(*backend, grad);
    const std::vector<double> dm0 = test::values(*backend, dm);
    backend->row_norms(merged, norms);
    backend->dora_weight(merged, base, mag, norms, out);
    backend->dora_backward(grad, merged, mag, norms, dm);
    const std::vector<double> n = test::values(*backend, norms), o = test::values(*backend, out);
    const std::vector<double> dg = test::values(*backend, grad), dmv = test::values(*backend, dm);
    for (int64_t j = 0; j < rows; ++j) {
      double ss = 0.0, dot = 0.0;
      for (int64_t i = 0; i < cols; ++i) ss += w[j * cols + i] * w[j * cols + i], dot += g[j * cols + i] * w[j * cols + i];
      const double norm = std::sqrt(ss), gain = m[j] / norm;
      EXPECT_NEAR(n[j], norm, 1e-6 * norm) << name << " row " << j;
      EXPECT_NEAR(dmv[j], dm0[j] + dot / norm, 1e-5 * (1.0 + std::abs(dot / norm))) << name << " row " << j;
      for (int64_t i = 0; i < cols; ++i) {
        ASSERT_NEAR(o[j * cols + i], gain * w[j * cols + i] - b[j * cols + i], 1e-5 * (1.0 + std::abs(gain))) << name;
        ASSERT_NEAR(dg[j * cols + i], gain * g[j * cols + i], 1e-5 * (1.0 + std::abs(gain))) << name;
      }
    }
    // A zero row has gain 0 (no division by zero), and out may alias merged.
    backend->fill(merged.view(0, {cols}), 0.0);
    backend->row_norms(merged, norms);
    backend->dora_weight(merged, Tensor{}, mag, norms, merged);
    const std::vector<double> after = test::values(*backend, merged);
    EXPECT_EQ(after[0], 0.0) << name;
    EXPECT_NEAR(after[cols], (m[1] / n[1]) * w[cols], 1e-5) << name;
  }
}

// The loss's gradient with respect to each magnitude is exact (the norm does not depend on m):
// central differences at 3 elements of every magnitude. The base gets none.
TEST(DoraModel, MagnitudeGradientsMatchFiniteDifferencesAndTheBaseGetsNone) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    for (const float dropout : {0.0f, 0.3f}) {
      auto backend = make_cpu_backend();
      const ModelConfig base = model_preset(preset);
      ModelConfig c = dora_of(base, base.arch == ARCH_GPT2 ? "q,k,v,o,up,down" : "q,v,o,gate,down", 2, 4.0f);
      c.lora_dropout = dropout;
      Transformer model(*backend, c);
      // Without dropout, with the linear layers' workspace: the layers compute with the merged
      // weight g V (lora_layer_weight); with dropout the adapters add their correction.
      if (dropout == 0.0f) model.set_precision(resolve_policy(PrecisionConfig{}));
      model.init_weights(3);
      randomize_adapters(model, 5, true);
      ActivationStore s = model.allocate_store(2, 8);
      fill_tokens(s, static_cast<int32_t>(c.vocab_size), 1);
      s.dropout_pass = dropout > 0.0f ? 3 : 0;
      model.zero_grads();
      model.forward(s);
      model.backward(s, 1.0f);
      const int64_t begin = lora_begin(c, model.layout());
      const float* g = model.grads().data<float>();
      for (int64_t i = 0; i < begin; ++i) ASSERT_EQ(g[i], 0.0f) << preset << " base gradient " << i;
      float* p = model.params().data<float>();
      int checked = 0;
      for (const ParamSpec& spec : model.layout().params) {
        if (!is_magnitude(spec)) continue;
        for (int64_t k = 0; k < 3; ++k) {
          const int64_t i = spec.offset + (k * 7919) % spec.numel;
          const float saved = p[i], h = 1e-2f;
          p[i] = saved + h;
          const double up = model.forward(s);
          p[i] = saved - h;
          const double down = model.forward(s);
          p[i] = saved;
          const double fd = (up - down) / (2.0 * h);
          EXPECT_NEAR(g[i], fd, 2e-3 * std::max(1.0, std::abs(fd)) + 1e-4) << preset << " " << spec.name;
          ++checked;
        }
      }
      EXPECT_EQ(checked, 3 * static_cast<int>(lora_sites(c, 0).size() * static_cast<size_t>(c.n_layer)));
      // A and B get gradients too (their values are checked against PyTorch in the parity test).
      for (const ParamSpec& spec : model.layout().params) {
        if (spec.offset < begin || is_magnitude(spec)) continue;
        double norm = 0.0;
        for (int64_t i = spec.offset; i < spec.offset + spec.numel; ++i) norm += static_cast<double>(g[i]) * g[i];
        EXPECT_GT(norm, 0.0) << preset << " " << spec.name;
      }
    }
  }
}

TEST(DoraConfig, RefusalsNameTheKeys) {
  ModelConfig c = model_preset("llama-tiny");
  c.lora_dora = true;
  std::string msg = test::error_of([&] { c.validate(); });
  EXPECT_NE(msg.find("peft.dora"), std::string::npos) << msg;
  EXPECT_NE(msg.find("peft.method = lora"), std::string::npos) << msg;
  c = dora_of(model_preset("llama-tiny"), "q,v");
  c.lora_quantize_base = true;
  msg = test::error_of([&] { c.validate(); });
  EXPECT_NE(msg.find("peft.quantize_base"), std::string::npos) << msg;
}

}  // namespace
}  // namespace loom
