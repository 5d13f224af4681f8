// LoRA against PyTorch: tools/make_lora_fixtures.py writes tiny Llama (all seven targets; q and v
// with rsLoRA) and GPT-2 (c_attn, both c_proj, c_fc; rsLoRA) Hugging Face folders, adapters in
// PEFT's layout with nonzero A and B, and the adapted model's logits, loss and the adapters'
// gradients in float64 autograd; the *_dora cases add trained DoRA magnitudes (use_dora) on every
// layer, the norm detached as PEFT's. Loom reads the adapter folder (checkpoint/peft.h) onto the
// imported base and must give the loss within 1e-5 relative, the logits within 1e-4 (max abs
// error over the largest, the parity tests' fp32 tolerance) and every adapter's gradient within
// 1e-5 (max abs error over its largest element).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/checkpoint/peft.h"
#include "loom/model/transformer.h"
#include "loom/nn/lora.h"
#include "loom/precision/policy.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

class LoraParity : public ::testing::TestWithParam<const char*> {};

TEST_P(LoraParity, LogitsLossAndAdapterGradientsMatchPyTorch) {
  // DoRA's two computations: the adapters' correction, and (with the layers' workspace, no
  // dropout) the layers on the merged weight g V (nn/lora.h lora_layer_weight).
  for (const bool workspace : {false, true}) {
  const fs::path dir = fs::path(test::fixture_dir()) / "lora" / GetParam();
  const std::string base_dir = (dir / "base").string(), adapter_dir = (dir / "adapter").string();
  const ModelConfig base = hf_model_config(base_dir);
  const ModelConfig config = peft_adapter_config(adapter_dir, base);
  ASSERT_TRUE(config.lora());
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  if (workspace) model.set_precision(resolve_policy(PrecisionConfig{}));
  const int64_t begin = lora_begin(config, model.layout());
  load_hf_weights(base_dir, ModelState{base, model.params().view(0, {begin})});
  load_peft_adapter(adapter_dir, ModelState{config, model.params()});

  std::ifstream in(dir / "expected.json");
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json expected = nlohmann::json::parse(text.str());
  EXPECT_NEAR(config.lora_scale(), expected["scale"].get<double>(), 1e-6);
  const std::vector<int32_t> tokens = expected["tokens"].get<std::vector<int32_t>>();
  ActivationStore store = test::next_token_store(model, tokens);
  model.zero_grads();
  const double loss = model.forward(store);
  const double want = expected["loss"].get<double>();
  EXPECT_LT(std::abs(loss - want) / std::abs(want), 1e-5) << loss << " vs " << want;
  const double logits_error =
      test::max_rel_error(test::values(*backend, store.logits), expected["logits"].get<std::vector<double>>());
  EXPECT_LT(logits_error, 1e-4);
  model.backward(store, 1.0f);
  double worst = 0.0;
  int checked = 0;
  const std::string prefix = "base_model.model." + std::string(config.arch == ARCH_GPT2 ? "transformer." : "");
  for (const ParamSpec& spec : model.layout().params) {
    if (spec.offset < begin) continue;
    const std::string name = prefix + spec.name;
    ASSERT_TRUE(expected["grads"].contains(name)) << name;
    const double err = test::max_rel_error(test::values(model.grads().view(spec.offset, spec.shape)),
                                           expected["grads"][name].get<std::vector<double>>());
    EXPECT_LT(err, 1e-5) << name;
    worst = std::max(worst, err);
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(expected["grads"].size()));
  std::printf("%s%s: loss %.9f (PyTorch %.9f), logits max rel error %.2e, %d adapter gradients, worst rel error %.2e\n",
              GetParam(), workspace ? " (workspace)" : "", loss, want, logits_error, checked, worst);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, LoraParity, ::testing::Values("llama", "llama_qv", "gpt2", "llama_dora", "gpt2_dora"));

}  // namespace
}  // namespace loom
