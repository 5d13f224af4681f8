// GPT-OSS (attention sinks, alternating sliding windows, YaRN without truncation, MoE with router
// and expert biases and the clamped SwiGLU) against tools/make_gpt_oss_fixture.py's float64
// PyTorch reference, written from transformers' modeling_gpt_oss.py: the loss and the logits
// (HfImport checks those for both folders) and every parameter's gradient, mapped into Loom's
// layout by the script independently of Loom's import code; and the release's MXFP4 experts,
// dequantized on import, giving the reference computed from the dequantized weights.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/backend/backend.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/model/transformer.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

nlohmann::json expected_of(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "expected.json");
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());
}

class GptOss : public ::testing::TestWithParam<const char*> {};

TEST_P(GptOss, ConfigMapsTheReleasesKeys) {
  const ModelConfig c = hf_model_config(test::fixture_dir() + "/hf/" + GetParam());
  EXPECT_TRUE(c.attn_sinks && c.qkv_bias && c.attn_out_bias && c.moe_router_bias && c.moe_expert_bias);
  EXPECT_EQ(c.gate_activation, GateActivation::swiglu_oai);
  EXPECT_EQ(c.attn_window, 5);
  EXPECT_EQ(c.layer_window(0), 5);  // layer_types: sliding, full
  EXPECT_EQ(c.layer_window(1), 0);
  EXPECT_EQ(c.rope_scaling, ROPE_SCALING_YARN);
  EXPECT_FALSE(c.rope_yarn_truncate);
  EXPECT_NEAR(c.rope_attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-6);
}

TEST_P(GptOss, EveryGradientMatchesPyTorch) {
  const std::string dir = test::fixture_dir() + "/hf/" + GetParam();
  const ModelConfig config = hf_model_config(dir);
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  load_hf_weights(dir, ModelState{config, model.params()});
  const nlohmann::json expected = expected_of(dir);
  ActivationStore store = test::next_token_store(model, expected["tokens"].get<std::vector<int32_t>>());
  model.zero_grads();
  const double loss = model.forward(store);
  const double want = expected["loss"].get<double>();
  EXPECT_LT(std::abs(loss - want) / want, 1e-5) << loss << " vs " << want;
  model.backward(store, 1.0f);
  double worst = 0.0;
  std::string worst_name;
  int checked = 0;
  for (const ParamSpec& spec : model.layout().params) {
    if (spec.name.find("e_score_correction_bias") != std::string::npos) continue;  // a buffer: no gradient
    ASSERT_TRUE(expected["grads"].contains(spec.name)) << spec.name;
    const double err = test::max_rel_error(test::values(*backend, model.grads().view(spec.offset, spec.shape)),
                                           expected["grads"][spec.name].get<std::vector<double>>());
    EXPECT_LT(err, 1e-4) << spec.name;
    if (err > worst) worst = err, worst_name = spec.name;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(expected["grads"].size()));
  std::printf("%s: loss %.9f (PyTorch %.9f), %d gradients, worst rel error %.2e (%s)\n", GetParam(), loss, want,
              checked, worst, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(Folders, GptOss, ::testing::Values("gpt_oss", "gpt_oss_mxfp4"));

}  // namespace
}  // namespace loom
