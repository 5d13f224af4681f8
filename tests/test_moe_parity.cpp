// PyTorch parity of the mixture-of-experts blocks: tools/moe_reference.py builds two tiny MoE
// models in float64 (Llama blocks with a softmax router, renormalised scaled gates, a shared
// expert, a dense first layer and all three auxiliary losses; GPT-2 blocks with DeepSeek-V3's
// sigmoid router, group-limited routing and capacity factor 1, which drops) and stores the
// weights (the routing bias non-zero), a batch, the logits, the cross-entropy, the auxiliary
// losses and the gradient of their sum for every parameter. Loom in fp32 must match each within
// 1e-5 relative (max |a - b| / max |reference| per tensor), and drop the same assignments.
#include <gtest/gtest.h>

#include <string>

#include "loom/checkpoint/safetensors.h"
#include "loom/model/transformer.h"
#include "test_util.h"

namespace loom {
namespace {

ModelConfig moe_config_from(const SafetensorsFile& f) {
  ModelConfig c;
  auto i64 = [&](const char* key) { return std::stoll(f.metadata_value(key)); };
  auto f32 = [&](const char* key) { return std::stof(f.metadata_value(key)); };
  c.arch = arch_from_name(f.metadata_value("arch"));
  c.vocab_size = i64("vocab_size"), c.max_seq_len = i64("max_seq_len"), c.n_layer = i64("n_layer");
  c.n_head = i64("n_head"), c.n_kv_head = i64("n_kv_head"), c.d_model = i64("d_model"), c.d_ff = i64("d_ff");
  c.norm_eps = f32("norm_eps"), c.rope_theta = f32("rope_theta");
  c.moe_experts = i64("moe_experts"), c.moe_top_k = i64("moe_top_k"), c.moe_d_ff = i64("moe_d_ff");
  c.moe_shared = i64("moe_shared"), c.moe_dense_layers = i64("moe_dense_layers");
  c.moe_sigmoid = i64("moe_sigmoid") != 0, c.moe_renorm = i64("moe_renorm") != 0;
  c.moe_route_scale = f32("moe_route_scale"), c.moe_groups = i64("moe_groups"), c.moe_topk_groups = i64("moe_topk_groups");
  c.moe_capacity_factor = f32("moe_capacity_factor"), c.moe_aux_alpha = f32("moe_aux_alpha");
  c.moe_seq_aux_alpha = f32("moe_seq_aux_alpha"), c.moe_z_alpha = f32("moe_z_alpha");
  return c;
}

class MoeParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeParityTest, LogitsLossesDropsAndEveryGradientMatchPyTorch) {
  auto backend = make_cpu_backend();
  const SafetensorsFile f = SafetensorsFile::read(test::fixture_dir() + "/" + GetParam());
  const ModelConfig config = moe_config_from(f);
  Transformer model(*backend, config);
  for (const ParamSpec& p : model.layout().params) f.copy_into(p.name, model.param(p.name));
  auto ref = [&](const std::string& name) { return test::values(f.tensor(name, backend->allocator(), MEM_WORKSPACE)); };
  const int64_t B = std::stoll(f.metadata_value("batch")), T = std::stoll(f.metadata_value("seq_len"));
  ActivationStore store = model.allocate_store(B, T);
  f.copy_into("tokens", store.tokens);
  f.copy_into("targets", store.targets);
  model.zero_grads();
  const double loss = model.forward(store);
  const double logits_err = test::max_rel_error(test::values(store.logits), ref("logits"));
  EXPECT_LT(logits_err, 1e-5);
  EXPECT_LT(std::abs(loss - ref("loss")[0]) / ref("loss")[0], 1e-5);
  double aux = 0.0;
  std::vector<double> dropped;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    if (!config.moe_layer(l)) continue;
    const MoeSaved& m = store.blocks[l].mlp.moe;
    aux += m.aux + m.seq_aux + m.z;
    dropped.push_back(static_cast<double>(m.dropped));
  }
  EXPECT_LT(std::abs(aux - ref("aux")[0]) / ref("aux")[0], 1e-5) << aux << " vs " << ref("aux")[0];
  EXPECT_EQ(dropped, ref("dropped"));
  model.backward(store, 1.0f);
  double worst = 0.0;
  for (const ParamSpec& p : model.layout().params) {
    const std::vector<double> want = ref("grad." + p.name);
    const std::vector<double> got = test::values(model.grad(p.name));
    if (p.role == ROLE_BUFFER) {  // the routing bias is not trained: no gradient on either side
      for (double g : got) EXPECT_EQ(g, 0.0) << p.name;
      continue;
    }
    const double err = test::max_rel_error(got, want);
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-5) << p.name;
  }
  std::printf("%s: logits %.2e, worst gradient %.2e (max |a - b| / max |ref|), dropped", GetParam().c_str(), logits_err,
              worst);
  for (double d : dropped) std::printf(" %.0f", d);
  std::printf("\n");
}

INSTANTIATE_TEST_SUITE_P(TinyMoe, MoeParityTest,
                         ::testing::Values("moe_llama_tiny.safetensors", "moe_gpt2_tiny.safetensors"));

}  // namespace
}  // namespace loom
