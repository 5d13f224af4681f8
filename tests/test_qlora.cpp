// QLoRA (peft.quantize_base, model/transformer.h quantize_base): the base's block matrices in
// NF4 with double-quantized scales, dequantized on the fly by the linear layers. The quantized
// model computes exactly what LoRA over the dequantized base computes -- the same logits and
// adapter gradients, bit for bit, and the same adapters after training steps -- while the fp32
// pages of those matrices are released; the NF4 bytes equal the storage formula, and a
// checkpoint-style materialize_base gives back the dequantized values. The same component keeps
// a LoRA base in bf16 only (LoraBf16Base below).
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "loom/arch/param_layout.h"
#include "loom/core/pages.h"
#include "loom/precision/nf4.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

ModelConfig qlora_config() {
  ModelConfig c = model_preset("llama-tiny");
  c.d_model = 128, c.d_ff = 256, c.n_head = 4, c.n_kv_head = 2, c.vocab_size = 128;
  c.peft_method = PeftMethod::lora;
  c.lora_targets = "q,k,v,o,gate,up,down";
  c.lora_rank = 4;
  c.lora_alpha = 8.0f;
  return c;
}

void set_adapters(Transformer& m) {  // nonzero B: the adapters change the outputs
  const int64_t begin = lora_begin(m.config(), m.layout());
  float* p = m.params().data<float>();
  for (int64_t i = begin; i < m.layout().total; ++i) p[i] = 0.2f * std::sin(static_cast<float>(i) * 0.37f);
}

struct Pass {
  std::vector<float> logits, grads;
  double loss = 0;
};

Pass pass(Transformer& m) {
  ActivationStore s = m.allocate_store(2, 16);
  for (int64_t i = 0; i < s.tokens.numel(); ++i) {
    s.tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 37 + 5) % 128);
    s.targets.data<int32_t>()[i] = static_cast<int32_t>((i * 53 + 7) % 128);
  }
  m.zero_grads();
  Pass p;
  p.loss = m.forward(s);
  p.logits.assign(s.logits.data<float>(), s.logits.data<float>() + s.logits.numel());
  m.backward(s, 1.0f);
  const int64_t begin = lora_begin(m.config(), m.layout());
  p.grads.assign(m.grads().data<float>() + begin, m.grads().data<float>() + m.layout().total);
  return p;
}

TEST(Qlora, ComputesLoraOverTheDequantizedBaseAndReleasesItsPages) {
  auto backend = make_cpu_backend();
  const ModelConfig c = qlora_config();
  Transformer q(*backend, c);
  q.init_weights(4);
  set_adapters(q);
  const int64_t before = resident_bytes(q.params());
  q.quantize_base();
  const int64_t after = resident_bytes(q.params());
  // The reference: plain LoRA whose base holds the NF4-dequantized values.
  Transformer ref(*backend, c);
  q.materialize_base();
  std::memcpy(ref.params().data<float>(), q.params().data<float>(), static_cast<size_t>(q.layout().total) * sizeof(float));
  q.release_base();
  const Pass a = pass(q), b = pass(ref);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.logits, b.logits);
  EXPECT_EQ(a.grads, b.grads);
  // Quantization changed the base (the test can fail): unquantized LoRA gives other logits.
  Transformer plain(*backend, c);
  plain.init_weights(4);
  set_adapters(plain);
  EXPECT_NE(pass(plain).logits, a.logits);
  // Memory: the four matrices of every block, released; NF4 bytes = the formula.
  const int64_t n = q.quantized_params();
  const int64_t per_layer = c.qkv_width() * c.d_model + c.d_model * c.attn_width() + 3 * c.d_ff * c.d_model;
  EXPECT_EQ(n, c.n_layer * per_layer);
  int64_t formula = 0;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    for (int64_t k : {c.qkv_width() * c.d_model, c.d_model * c.attn_width(), 2 * c.d_ff * c.d_model, c.d_model * c.d_ff}) {
      formula += static_cast<int64_t>(nf4_bytes(k));
    }
  }
  EXPECT_EQ(q.quantized_bytes(), formula);
  const int64_t page = 4096;
  EXPECT_GE(before - after, 4 * n - 8 * c.n_layer * page) << "the fp32 pages of the quantized matrices go back to the OS";
  std::printf("QLoRA: %lld quantized parameters, %lld NF4 bytes (%.4f bits each); parameters resident %lld -> %lld bytes\n",
              static_cast<long long>(n), static_cast<long long>(q.quantized_bytes()),
              8.0 * static_cast<double>(q.quantized_bytes()) / static_cast<double>(n), static_cast<long long>(before),
              static_cast<long long>(after));
}

TEST(Qlora, TrainingStepsGiveLorasAdaptersOverTheDequantizedBase) {
  auto backend = make_cpu_backend();
  const ModelConfig c = qlora_config();
  Transformer q(*backend, c), ref(*backend, c);
  q.init_weights(9);
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 16, tc.steps = 3, tc.schedule.warmup = 0, tc.schedule.max_lr = 1e-2;
  Trainer tq(*backend, q, tc);
  q.quantize_base();
  q.materialize_base();
  std::memcpy(ref.params().data<float>(), q.params().data<float>(), static_cast<size_t>(q.layout().total) * sizeof(float));
  q.release_base();
  Trainer tr(*backend, ref, tc);
  std::vector<int32_t> tokens(500);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7 + i / 13) % 128);
  RandomWindowSource dq(tokens, 2), dr(tokens, 2);
  for (int s = 0; s < 3; ++s) EXPECT_EQ(tq.train_step(dq).loss, tr.train_step(dr).loss) << s;
  const int64_t begin = lora_begin(c, q.layout());
  EXPECT_EQ(std::memcmp(q.params().data<float>() + begin, ref.params().data<float>() + begin,
                        static_cast<size_t>(q.layout().total - begin) * sizeof(float)),
            0);
}

TEST(Qlora, RefusedWithoutLora) {
  auto backend = make_cpu_backend();
  Transformer m(*backend, model_preset("llama-tiny"));
  EXPECT_NE(test::error_of([&] { m.quantize_base(); }).find("needs peft.method = lora"), std::string::npos);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// LoRA with precision.param = bf16 (model/frozen_base.h keep_base_bf16): the frozen block
// matrices and the untied head live only in the bf16 copy the layers read. What is computed
// does not change -- the same losses and adapters as the same run keeping its fp32 base, bit for
// bit -- while those fp32 pages are released; materialize_base gives back the bf16 values.
TrainConfig bf16_train_config() {
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 16, tc.steps = 3, tc.schedule.warmup = 0, tc.schedule.max_lr = 1e-2;
  tc.precision.param = "bf16";
  return tc;
}

std::vector<double> three_steps(Trainer& t) {
  std::vector<int32_t> tokens(500);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7 + i / 13) % 128);
  RandomWindowSource data(tokens, 2);
  std::vector<double> losses;
  for (int s = 0; s < 3; ++s) losses.push_back(t.train_step(data).loss);
  return losses;
}

float bf16_value(float x) {  // round to nearest even, as Backend::cast does
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

TEST(LoraBf16Base, TrainsAsTheSameRunKeepingItsFp32BaseAndReleasesItsPages) {
  auto backend = make_cpu_backend();
  const ModelConfig c = qlora_config();
  ASSERT_FALSE(c.tied_head());
  Transformer k(*backend, c), ref(*backend, c);
  k.init_weights(9);
  ref.init_weights(9);
  const std::vector<float> initial(k.params().data<float>(), k.params().data<float>() + k.layout().total);
  const TrainConfig tc = bf16_train_config();
  Trainer tk(*backend, k, tc), tr(*backend, ref, tc);
  const int64_t before = resident_bytes(k.params());
  k.keep_base_bf16();
  const int64_t after = resident_bytes(k.params());
  const FrozenBase& base = k.frozen_base();
  ASSERT_TRUE(base.bf16());
  const int64_t per_layer = c.qkv_width() * c.d_model + c.d_model * c.attn_width() + 3 * c.d_ff * c.d_model;
  EXPECT_EQ(base.params(), c.n_layer * per_layer + c.vocab_size * c.d_model);  // + the head
  EXPECT_EQ(base.bytes(), 2 * base.params());
  EXPECT_EQ(k.quantized_params(), 0);
  EXPECT_GE(before - after, 4 * base.params() - 2 * (4 * c.n_layer + 1) * 4096) << "the fp32 pages go back to the OS";
  EXPECT_EQ(three_steps(tk), three_steps(tr));
  const int64_t begin = lora_begin(c, k.layout());
  EXPECT_EQ(std::memcmp(k.params().data<float>() + begin, ref.params().data<float>() + begin,
                        static_cast<size_t>(k.layout().total - begin) * sizeof(float)),
            0);
  // The fp32 elements were not read: they are still released (zero), and materialize_base
  // writes each base weight's bf16 value.
  const ParamSpec& down = k.layout().find("model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(k.params().data<float>()[down.offset + 5], 0.0f);
  k.materialize_base();
  for (int64_t i = 0; i < down.numel; i += 97) {
    ASSERT_EQ(k.params().data<float>()[down.offset + i], bf16_value(initial[static_cast<size_t>(down.offset + i)])) << i;
  }
  k.release_base();
  // The test can fail: refreshing the whole bf16 copy from the released fp32 elements (what
  // sync_weight_copy must not do) zeroes the base and changes the loss.
  Transformer broken(*backend, c);
  broken.init_weights(9);
  Trainer tb(*backend, broken, tc);
  broken.keep_base_bf16();
  backend->cast(broken.params(), broken.params_bf16());
  EXPECT_NE(three_steps(tb), three_steps(tk));
}

TEST(LoraBf16Base, ReadFromAFolderOneWeightAtATimeAsKeptAfterLoading) {
  auto backend = make_cpu_backend();
  const ModelConfig c = qlora_config();
  Transformer kept(*backend, c), streamed(*backend, c, ModelUse{.lazy_params = true});
  kept.init_weights(3);
  std::vector<float> values(kept.params().data<float>(), kept.params().data<float>() + kept.layout().total);
  // The streamed model gets everything but the compact weights in fp32; those come from `read`.
  std::set<int64_t> compact;
  for (const ParamSpec* s : FrozenBase::weight_specs(c, kept.layout(), kept.params(), true)) compact.insert(s->offset);
  for (const ParamSpec& s : kept.layout().params) {
    if (compact.count(s.offset) == 0) {
      std::memcpy(streamed.params().data<float>() + s.offset, values.data() + s.offset, static_cast<size_t>(s.numel) * 4);
    }
  }
  const TrainConfig tc = bf16_train_config();
  Trainer tk(*backend, kept, tc), ts(*backend, streamed, tc);
  kept.keep_base_bf16();
  int reads = 0;
  streamed.load_bf16_base([&](const std::string& name, const Tensor& dst) {
    const ParamSpec& s = kept.layout().find(name);
    std::memcpy(dst.data<float>(), values.data() + s.offset, static_cast<size_t>(s.numel) * 4);
    ++reads;
  });
  EXPECT_EQ(reads, 4 * c.n_layer + 1);
  EXPECT_TRUE(streamed.frozen_base().streamed());
  EXPECT_EQ(three_steps(ts), three_steps(tk));
  EXPECT_LT(resident_bytes(streamed.params()), 4 * (kept.layout().total - streamed.frozen_base().params()) + (1 << 20));
}

TEST(LoraBf16Base, RefusedWithoutTheBf16CopyOrWithDora) {
  auto backend = make_cpu_backend();
  Transformer m(*backend, qlora_config());
  m.init_weights(1);
  EXPECT_NE(test::error_of([&] { m.keep_base_bf16(); }).find("precision.param = bf16"), std::string::npos);
  ModelConfig dora = qlora_config();
  dora.lora_dora = true;
  EXPECT_FALSE(FrozenBase::keeps_bf16(dora, true, 0));
  EXPECT_FALSE(FrozenBase::keeps_bf16(qlora_config(), true, 1)) << "ZeRO gathers the fp32 buffer";
  EXPECT_TRUE(FrozenBase::keeps_bf16(qlora_config(), true, 0));
}

}  // namespace
}  // namespace loom
