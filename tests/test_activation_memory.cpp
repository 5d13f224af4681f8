// Activation memory of one rank: the MEM_ACTIVATIONS bytes that Transformer::allocate_store
// counts equal Loom's per-layer formula times the layer count plus the model-end terms, to the
// byte, for GPT-2 and Llama (GQA) at tensor-parallel sizes t = 1, 2, 4. The per-layer part is
// then compared with Korthikanti et al. (arXiv 2205.05198, §4.1-4.2), tensor-parallel
// formula sbh(10 + 24/t + 5as/(ht)) bytes (16-bit, dropout masks included), converted to Loom:
// every 16-bit term doubled (fp32) and the three dropout-mask terms (as²b/t after softmax, sbh
// after attention, sbh after the MLP; 1 byte per element) removed, which leaves
//   REF32(t) = 2 [sbh (8 + 24/t) + 4as²b/t] = sbh (16 + 48/t) + 8as²b/t.
// The derivation, term by term, is in docs/activation_memory.md.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/memory.h"
#include "loom/arch/config.h"
#include "loom/model/transformer.h"
#include "loom/nn/block.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {
namespace {

constexpr int64_t kF32 = 4;  // Loom keeps every activation in fp32 (tokens / targets: i32, also 4 bytes)

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

// Loom's bytes per layer for one rank of a t-way tensor-parallel group (docs/activation_memory.md):
//   replicated: input, norm1, mid, norm2 (4 sbh) and the norm statistics (mean + rstd per norm for
//               LayerNorm, rstd only for RMSNorm)
//   sliced:     qkv sb(a + 2kv)hd/t, probs as²b/t, attn sb a hd/t, fc m sbF/t (m = 2 for SwiGLU),
//               act sbF/t
int64_t loom_layer_bytes(const ModelConfig& g, int64_t t, int64_t b, int64_t s) {
  const int64_t h = g.d_model, a = g.n_head, kv = g.n_kv_head, hd = g.head_dim(), F = g.d_ff;
  const int64_t stats = g.rmsnorm() ? 2 : 4;  // per token, both norms together
  const int64_t m = g.gated_mlp() ? 2 : 1;
  const int64_t replicated = 4 * s * b * h + stats * s * b;
  const int64_t sliced = s * b * (a + 2 * kv) * hd + a * s * s * b + s * b * a * hd + m * s * b * F + s * b * F;
  EXPECT_EQ(sliced % t, 0);
  return kF32 * (replicated + sliced / t);
}

// The model's ends: tokens and targets (i32), final_input and final_norm (sbh), the final norm's
// statistics (2 sb or sb), logits (sb ceil(V/t): the rank's vocabulary slice, padded), losses and
// lse (sb each).
int64_t loom_end_bytes(const ModelConfig& g, int64_t t, int64_t b, int64_t s) {
  const int64_t stats = g.rmsnorm() ? 1 : 2;
  return kF32 * s * b * (2 + 2 * g.d_model + stats + ceil_div(g.vocab_size, t) + 2);
}

// Korthikanti's TP formula sbh(10 + 24/t + 5as/(ht)), fp32 and without dropout masks (see top).
int64_t reference_layer_bytes(const ModelConfig& g, int64_t t, int64_t b, int64_t s) {
  const int64_t h = g.d_model, a = g.n_head;
  EXPECT_EQ((24 * s * b * h) % t, 0);
  EXPECT_EQ((4 * a * s * s * b) % t, 0);
  return 2 * (8 * s * b * h + 24 * s * b * h / t + 4 * a * s * s * b / t);
}

// Loom minus REF32, split into the terms that differ (all in bytes):
struct Difference {
  int64_t norm_stats;      // + Loom's mean/rstd, not in Korthikanti's count
  int64_t dropout_output;  // - his attention-dropout output 2as²b/t (fp32: 4as²b/t), which without
                           //   dropout is the softmax output Loom keeps once (probs)
  int64_t qkv_attn_width;  // his Q, K, V and attention output are h wide; Loom's are a hd, kv hd
                           //   (GQA: K and V are kv/a as wide), a hd
  int64_t mlp_width;       // his GeLU input + output are 4h + 4h wide; Loom's fc + act are (m+1)F
  int64_t sum() const { return norm_stats + dropout_output + qkv_attn_width + mlp_width; }
};

Difference difference(const ModelConfig& g, int64_t t, int64_t b, int64_t s) {
  const int64_t h = g.d_model, a = g.n_head, kv = g.n_kv_head, hd = g.head_dim(), F = g.d_ff;
  const int64_t m = g.gated_mlp() ? 2 : 1;
  Difference d;
  d.norm_stats = kF32 * (g.rmsnorm() ? 2 : 4) * s * b;
  d.dropout_output = -kF32 * a * s * s * b / t;
  d.qkv_attn_width = kF32 * s * b * ((a + 2 * kv) * hd + a * hd - 4 * h) / t;
  d.mlp_width = kF32 * s * b * ((m + 1) * F - 8 * h) / t;
  return d;
}

struct TpCase {
  int t;
  double ratio;      // measured per layer / REF32, computed by hand from the closed forms below
  bool within_15pct;  // |ratio - 1| <= 0.15: asserted as is, never loosened (see each config)
};

// Builds one rank's slice for each t on a fresh backend and checks its activation bytes.
void check(const char* name, const ModelConfig& global, int64_t b, int64_t s, const std::vector<TpCase>& cases) {
  std::printf("\n%s: L=%lld h=%lld a=%lld kv=%lld F=%lld V=%lld, b=%lld s=%lld (bytes)\n", name,
              static_cast<long long>(global.n_layer), static_cast<long long>(global.d_model),
              static_cast<long long>(global.n_head), static_cast<long long>(global.n_kv_head),
              static_cast<long long>(global.d_ff), static_cast<long long>(global.vocab_size),
              static_cast<long long>(b), static_cast<long long>(s));
  std::printf("%2s %14s %14s %14s %7s | %10s %12s %12s %12s\n", "t", "measured/layer", "Loom formula", "REF32", "ratio",
              "norm stats", "dropout out", "qkv/attn w", "mlp width");
  for (const TpCase& c : cases) {
    SCOPED_TRACE(std::string(name) + " t=" + std::to_string(c.t));
    const ModelConfig local = tp_local_config(global, c.t);

    // One block's saved record on its own allocator: the measured bytes per layer.
    auto block_backend = make_cpu_backend();
    const BlockSaved saved = allocate_block_saved(block_backend->allocator(), local, resolve_layer_plan(local, 0, {}),
                                                  {.batch = b, .seq_len = s});
    const auto layer = static_cast<int64_t>(block_backend->allocator().tracker().current(MEM_ACTIVATIONS));

    // The whole store of a freshly built slice: every layer plus the model's ends.
    auto backend = make_cpu_backend();
    Transformer model(*backend, local);
    ASSERT_EQ(backend->allocator().tracker().current(MEM_ACTIVATIONS), 0u);
    const ActivationStore store = model.allocate_store(b, s);
    const auto total = static_cast<int64_t>(backend->allocator().tracker().current(MEM_ACTIVATIONS));

    // (a) Loom's formula, to the byte.
    const int64_t formula = loom_layer_bytes(global, c.t, b, s);
    EXPECT_EQ(layer, formula);
    EXPECT_EQ(total, global.n_layer * formula + loom_end_bytes(global, c.t, b, s));

    // (b) Against Korthikanti's formula converted to fp32 without dropout masks: the difference is
    // exactly the named terms, and the ratio is the hand-computed one.
    const int64_t reference = reference_layer_bytes(global, c.t, b, s);
    const Difference d = difference(global, c.t, b, s);
    EXPECT_EQ(layer - reference, d.sum());
    const double ratio = static_cast<double>(layer) / static_cast<double>(reference);
    EXPECT_NEAR(ratio, c.ratio, 5e-5);
    EXPECT_EQ(std::abs(ratio - 1.0) <= 0.15, c.within_15pct) << "ratio " << ratio;
    // (c) Tensor + sequence parallel: the residual stream and norms on 1/t of the sequence as
    // well, so a layer keeps exactly 1/t of the t = 1 bytes (Korthikanti's sbh(34 + 5as/h)/t).
    auto sp_backend = make_cpu_backend();
    const BlockSaved sp_saved = allocate_block_saved(
        sp_backend->allocator(), local,
        resolve_layer_plan(local, 0, {.tensor_parallel = true, .sequence_parallel = true}),
        {.batch = b, .seq_len = s, .seq_shards = c.t});
    const auto sp_layer = static_cast<int64_t>(sp_backend->allocator().tracker().current(MEM_ACTIVATIONS));
    EXPECT_EQ(sp_layer * c.t, loom_layer_bytes(global, 1, b, s));
    std::printf("%2d %14lld %14lld %14lld %7.4f | %10lld %12lld %12lld %12lld | tp+sp %lld = t=1 / t\n", c.t,
                static_cast<long long>(layer),
                static_cast<long long>(formula), static_cast<long long>(reference), ratio,
                static_cast<long long>(d.norm_stats), static_cast<long long>(d.dropout_output),
                static_cast<long long>(d.qkv_attn_width), static_cast<long long>(d.mlp_width),
                static_cast<long long>(sp_layer));
  }
}

// GPT-2 (MHA, F = 4h, GELU, LayerNorm): Loom = sbh(16 + 48/t) + 16sb + 4as²b/t exactly, i.e.
// Korthikanti's 10 + 24/t structure in fp32 without masks, plus the norm statistics and minus
// the dropout output: ratio = (16 + 16/h + (48 + 4as/h)/t) / (16 + (48 + 8as/h)/t).
TEST(ActivationMemoryTest, Gpt2TinyMatchesTheFormulaAndKorthikanti) {
  // h = 32, as/h = 4·16/32 = 2: (16.5 + 56/t) / (16 + 64/t).
  check("gpt2-tiny", model_preset("gpt2-tiny"), 2, 16,
        {{1, 72.5 / 80.0, true}, {2, 44.5 / 48.0, true}, {4, 30.5 / 32.0, true}});
}

TEST(ActivationMemoryTest, Gpt2LargerMatchesTheFormulaAndKorthikanti) {
  ModelConfig c = model_preset("gpt2-tiny");
  c.n_layer = 2, c.d_model = 128, c.n_head = 8, c.n_kv_head = 8, c.d_ff = 512, c.vocab_size = 512, c.max_seq_len = 64;
  // h = 128, as/h = 8·64/128 = 4: (16.125 + 64/t) / (16 + 80/t). At t = 1 the ratio is outside
  // 15% (0.835; t = 2 is just inside at 0.859): REF32's attention-map bytes 8as²b/t are the softmax output and the dropout
  // output (4as²b/t each), while Loom keeps probs once; at as/h = 4 the dropout output is 16/t
  // of the 16 + 80/t. Not loosened: the difference is asserted term by term.
  check("gpt2 h128 s64", c, 2, 64,
        {{1, 80.125 / 96.0, false}, {2, 48.125 / 56.0, true}, {4, 32.125 / 36.0, true}});
}

// Llama (GQA, SwiGLU, RMSNorm): Loom = sbh(16 + 8/h) + (4/t) sb [hd(2a + 2kv) + 3F + as].
TEST(ActivationMemoryTest, LlamaTinyMatchesTheFormulaAndKorthikanti) {
  // h = 48, a = 6, kv = 2, F = 80, as/h = 2: (16 + 1/6 + (8 + 8/3 + 20 + 8)/t) / (16 + 64/t).
  // Outside 15% at both t: besides the dropout output (-8/t, in units of sbh bytes), the MLP is narrow
  // (SwiGLU fc + act = 3F = 5h vs Korthikanti's GeLU 4h + 4h = 8h: -12/t) and K, V are a third
  // of Q (GQA: -16/3/t).
  check("llama-tiny", model_preset("llama-tiny"), 2, 16,
        {{1, (16.0 + 1.0 / 6.0 + 38.0 + 2.0 / 3.0) / 80.0, false},
         {2, (16.0 + 1.0 / 6.0 + (38.0 + 2.0 / 3.0) / 2.0) / 48.0, false}});
}

TEST(ActivationMemoryTest, LlamaGqaLargerMatchesTheFormulaAndKorthikanti) {
  ModelConfig c = model_preset("llama-tiny");
  // 3F = 8h: SwiGLU's fc + act are as wide as Korthikanti's GeLU input + output.
  c.n_layer = 2, c.d_model = 192, c.n_head = 12, c.n_kv_head = 4, c.d_ff = 512, c.vocab_size = 512, c.max_seq_len = 64;
  // h = 192, hd = 16, as/h = 4: (16 + 1/24 + (32/3 + 32 + 16)/t) / (16 + 80/t). Outside 15% at
  // t = 1, 2 (0.778, 0.810; t = 4 is just inside at 0.853): the dropout output (-16/t) and GQA's
  // narrower K, V (-16/3/t); the MLP term is zero.
  check("llama h192 kv4 s64", c, 2, 64,
        {{1, (16.0 + 1.0 / 24.0 + 58.0 + 2.0 / 3.0) / 96.0, false},
         {2, (16.0 + 1.0 / 24.0 + (58.0 + 2.0 / 3.0) / 2.0) / 56.0, false},
         {4, (16.0 + 1.0 / 24.0 + (58.0 + 2.0 / 3.0) / 4.0) / 36.0, true}});
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// Context parallel (ring attention) on cp ranks: every per-position tensor holds s/cp positions,
// and attention keeps its log-sum-exp (a·s·b/cp) in place of the (s, s) probabilities, so per
// layer Loom keeps exactly the t = 1 bytes of everything but probs at s/cp, plus lse. Against
// Korthikanti's per-position part converted to fp32 without dropout (64sbh, the 34sbh of the
// 16-bit count less its 2sbh of masks, doubled) divided by cp, and no attention-score term,
// GPT-2's ratio is 1 + (16 + 4a)/(64h) (the norm statistics and lse).
TEST(ActivationMemoryTest, ContextParallelKeepsOneCpthPlusTheLogSumExp) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig g = model_preset(preset);
    const int64_t b = 2, s = 16, h = g.d_model, a = g.n_head;
    for (const int64_t cp : {2, 4}) {
      auto backend = make_cpu_backend();
      const BlockSaved saved = allocate_block_saved(backend->allocator(), g, resolve_layer_plan(g, 0, {.context = PlanChoices::RING}),
                                                    {.batch = b, .seq_len = s / cp});
      const auto layer = static_cast<int64_t>(backend->allocator().tracker().current(MEM_ACTIVATIONS));
      const int64_t probs = kF32 * a * s * s * b, lse = kF32 * a * s * b / cp;
      // Every per-position term is linear in s: the t = 1 formula at s/cp, less its probs term.
      const int64_t expected = loom_layer_bytes(g, 1, b, s / cp) - probs / (cp * cp) + lse;
      EXPECT_EQ(layer, expected) << preset << " cp=" << cp;
      const double reference = 64.0 * static_cast<double>(s * b * h) / static_cast<double>(cp);
      const double ratio = static_cast<double>(layer) / reference;
      if (!g.gated_mlp()) {
        EXPECT_NEAR(ratio, 1.0 + (16.0 + 4.0 * a) / (64.0 * h), 1e-12) << preset;
      }
      std::printf("%s cp=%lld: %lld bytes per layer, Korthikanti per-position part / cp (fp32, no dropout) %.0f, "
                  "ratio %.4f\n", preset, static_cast<long long>(cp), static_cast<long long>(layer), reference, ratio);
    }
  }
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// FlashAttention (train.flash_attention): a layer keeps lse (a s b floats) in place of probs
// (a s^2 b), everything else as the t = 1 formula; the whole store is L such layers plus the
// same model ends. The attention-map term, quadratic in s, is gone: per layer Loom then keeps
// less than REF32 at every s (REF32 still counts 8as^2b for the softmax and dropout outputs).
TEST(ActivationMemoryTest, FlashAttentionKeepsTheLogSumExpInPlaceOfProbs) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig g = model_preset(preset);
    const int64_t b = 2, s = 16, a = g.n_head;
    const LayerPlan flash = resolve_layer_plan(g, 0, {.flash = true});
    auto block_backend = make_cpu_backend();
    const BlockSaved saved = allocate_block_saved(block_backend->allocator(), g, flash,
                                                  {.batch = b, .seq_len = s});
    const auto layer = static_cast<int64_t>(block_backend->allocator().tracker().current(MEM_ACTIVATIONS));
    const int64_t probs = kF32 * a * s * s * b, lse = kF32 * a * s * b;
    EXPECT_EQ(layer, loom_layer_bytes(g, 1, b, s) - probs + lse) << preset;
    EXPECT_EQ(layer, block_saved_bytes(g, flash, {.batch = b, .seq_len = s})) << preset;

    auto backend = make_cpu_backend();
    Transformer model(*backend, g);
    model.set_flash_attention(true);
    const ActivationStore store = model.allocate_store(b, s);
    const auto total = static_cast<int64_t>(backend->allocator().tracker().current(MEM_ACTIVATIONS));
    EXPECT_EQ(total, g.n_layer * layer + loom_end_bytes(g, 1, b, s)) << preset;
    EXPECT_LT(layer, reference_layer_bytes(g, 1, b, s)) << preset;
    std::printf("%s flash: %lld bytes per layer (probs: %lld), store %lld\n", preset, static_cast<long long>(layer),
                static_cast<long long>(loom_layer_bytes(g, 1, b, s)), static_cast<long long>(total));
  }
}

}  // namespace
}  // namespace loom
