// QLoRA (peft.quantize_base, model/transformer.h quantize_base): the base's block matrices in
// NF4 with double-quantized scales, dequantized on the fly by the linear layers. The quantized
// model computes exactly what LoRA over the dequantized base computes -- the same logits and
// adapter gradients, bit for bit, and the same adapters after training steps -- while the fp32
// pages of those matrices are released; the NF4 bytes equal the storage formula, and a
// checkpoint-style materialize_base gives back the dequantized values.
#include <gtest/gtest.h>

#include <cstring>

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
