// Hugging Face model folders (checkpoint/hf_model.h) against PyTorch: tools/make_hf_fixtures.py
// writes tiny GPT-2 (with and without the "transformer." prefix, mask buffers, a tied
// lm_head), Llama (bf16, two shards with an index), Mistral (f16, sliding window), Qwen2 (q/k/v
// biases, tied head), Llama 3.2 (llama3 rope_scaling, tied head, wide heads), Qwen3 (q/k norm),
// Mixtral and Qwen3-MoE (MoE), DeepSeek-V2 and V3 (MLA with interleaved RoPE rows, dense and MoE
// layers, shared experts, softmax / sigmoid group-limited routing) folders in
// transformers' layout and their logits and loss in float64. Loom imports each and must give the
// loss within 1e-5 relative and the logits within 1e-4 (max abs error over the largest logit),
// the stated fp32 tolerances of the parity tests. Export and re-import is bitwise, and a second
// export writes the same bytes. Bad folders are refused naming the file and the key or tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/backend/backend.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/checkpoint/model_config_json.h"
#include "loom/model/transformer.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return std::string(LOOM_FIXTURE_DIR) + "/hf/" + name; }

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return nlohmann::json::parse(s.str());
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class HfImport : public ::testing::TestWithParam<const char*> {};

TEST_P(HfImport, LogitsAndLossMatchPyTorch) {
  const std::string dir = fixture(GetParam());
  ASSERT_TRUE(is_hf_model_dir(dir)) << dir;
  const ModelConfig config = hf_model_config(dir);
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  load_hf_weights(dir, ModelState{config, model.params()});

  const nlohmann::json expected = read_json(fs::path(dir) / "expected.json");
  const std::vector<int32_t> tokens = expected["tokens"].get<std::vector<int32_t>>();
  ActivationStore store = test::next_token_store(model, tokens);
  const double loss = model.forward(store);
  const double want = expected["loss"].get<double>();
  EXPECT_LT(std::abs(loss - want) / std::abs(want), 1e-5) << loss << " vs " << want;
  const double logits_error =
      test::max_rel_error(test::values(*backend, store.logits), expected["logits"].get<std::vector<double>>());
  EXPECT_LT(logits_error, 1e-4);
  RecordProperty("logits_max_rel_error", std::to_string(logits_error));
  std::printf("%s: loss %.9f (PyTorch %.9f), logits max rel error %.2e\n", GetParam(), loss, want, logits_error);
}

TEST_P(HfImport, ExportAndReimportAreBitwise) {
  const std::string dir = fixture(GetParam());
  const ModelConfig config = hf_model_config(dir);
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  load_hf_weights(dir, ModelState{config, model.params()});
  const fs::path out = fs::path(::testing::TempDir()) / (std::string("hf_export_") + GetParam());
  fs::remove_all(out);
  save_hf_model(out.string(), ModelState{config, model.params()});
  const ModelConfig again = hf_model_config(out.string());
  EXPECT_EQ(model_config_json(again).dump(), model_config_json(config).dump());
  Transformer reloaded(*backend, again);
  load_hf_weights(out.string(), ModelState{again, reloaded.params()});
  ASSERT_EQ(reloaded.params().numel(), model.params().numel());
  EXPECT_EQ(std::memcmp(reloaded.params().data<float>(), model.params().data<float>(),
                        static_cast<size_t>(model.params().numel()) * sizeof(float)),
            0);
  const fs::path out2 = out.string() + "_again";
  fs::remove_all(out2);
  save_hf_model(out2.string(), ModelState{again, reloaded.params()});
  EXPECT_EQ(read_bytes(out / "model.safetensors"), read_bytes(out2 / "model.safetensors"));
  EXPECT_EQ(read_bytes(out / "config.json"), read_bytes(out2 / "config.json"));
}

INSTANTIATE_TEST_SUITE_P(Families, HfImport,
                         ::testing::Values("gpt2", "gpt2_plain", "llama", "mistral", "qwen2", "llama32", "qwen3", "mixtral",
                                           "qwen3_moe", "deepseek_v2", "deepseek_v3"));

// A copy of a fixture folder whose config.json or weights a test then breaks.
fs::path broken_copy(const std::string& name, const std::string& tag) {
  const fs::path out = fs::path(::testing::TempDir()) / ("hf_broken_" + name + "_" + tag);
  fs::remove_all(out);
  fs::copy(fixture(name), out, fs::copy_options::recursive);
  return out;
}

void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = read_json(dir / "config.json");
  edit(j);
  std::ofstream(dir / "config.json") << j.dump(2);
}

TEST(HfImportErrors, UnknownOrUnsupportedConfigKeysAreRefusedByName) {
  struct Case {
    const char* fixture;
    std::function<void(nlohmann::json&)> edit;
    const char* expected;
  };
  const Case cases[] = {
      {"llama", [](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}}; },
       "rope_scaling.low_freq_factor is missing"},
      {"llama", [](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 4.0}}; },
       "rope_scaling.rope_type = 'dynamic' is not supported"},
      {"llama", [](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"truncate", false}}; },
       "rope_scaling.truncate = false is not supported"},
      {"llama", [](nlohmann::json& j) { j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}, {"beta", 1}}; },
       "unknown key 'rope_scaling.beta'"},
      {"llama", [](nlohmann::json& j) { j["attention_bias"] = true; }, "attention_bias"},
      {"qwen2", [](nlohmann::json& j) { j["use_sliding_window"] = true; }, "use_sliding_window"},
      {"llama", [](nlohmann::json& j) { j["model_type"] = "qwen4"; }, "model_type 'qwen4'"},
      {"llama", [](nlohmann::json& j) { j["frobnicate"] = 3; }, "unknown key 'frobnicate'"},
      {"llama", [](nlohmann::json& j) { j.erase("hidden_size"); }, "'hidden_size' is missing"},
      {"llama", [](nlohmann::json& j) { j["hidden_size"] = "wide"; }, "'hidden_size' has the wrong type"},
      {"gpt2", [](nlohmann::json& j) { j["activation_function"] = "relu"; }, "activation_function"},
      {"deepseek_v2", [](nlohmann::json& j) { j["topk_method"] = "group_limited_greedy", j["n_group"] = 2; },
       "topk_method = 'group_limited_greedy' with n_group = 2 is not supported"},
      {"deepseek_v3", [](nlohmann::json& j) { j["scoring_func"] = "softmax"; }, "scoring_func"},
      {"deepseek_v3", [](nlohmann::json& j) { j["moe_layer_freq"] = 2; }, "moe_layer_freq"},
      {"mixtral", [](nlohmann::json& j) { j["router_jitter_noise"] = 0.1; }, "router_jitter_noise"},
      {"qwen3_moe", [](nlohmann::json& j) { j["mlp_only_layers"] = {0}; }, "mlp_only_layers"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const fs::path dir = broken_copy(c.fixture, "config" + std::to_string(i++));
    edit_config(dir, c.edit);
    const std::string msg = test::error_of([&] { hf_model_config(dir.string()); });
    EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
  }
}

TEST(HfImportErrors, MissingExtraOrMisshapenTensorsAreRefusedByName) {
  auto backend = make_cpu_backend();
  // A config that does not match the weights: every tensor's shape is checked, when the config
  // is read (before a model of its size is allocated).
  {
    const fs::path dir = broken_copy("mistral", "shape");
    edit_config(dir, [](nlohmann::json& j) { j["intermediate_size"] = 40; });
    const std::string msg = test::error_of([&] { hf_model_config(dir.string()); });
    EXPECT_NE(msg.find("mlp.gate_proj.weight' has shape (48, 32), expected (40, 32)"), std::string::npos) << msg;
  }
  // Fewer layers in the config than in the file: the extra layer's tensors are refused.
  {
    const fs::path dir = broken_copy("mistral", "extra");
    edit_config(dir, [](nlohmann::json& j) { j["num_hidden_layers"] = 1; });
    const ModelConfig config = hf_model_config(dir.string());
    Transformer model(*backend, config);
    const std::string msg = test::error_of([&] { load_hf_weights(dir.string(), ModelState{config, model.params()}); });
    EXPECT_NE(msg.find("model.layers.1."), std::string::npos) << msg;
    EXPECT_NE(msg.find("is not a parameter"), std::string::npos) << msg;
  }
  // A shard the index names but that is gone.
  {
    const fs::path dir = broken_copy("llama", "shard");
    fs::remove(dir / "model-00002-of-00002.safetensors");
    const std::string msg = test::error_of([&] { hf_model_config(dir.string()); });
    EXPECT_NE(msg.find("model-00002-of-00002.safetensors"), std::string::npos) << msg;
  }
}

// A Loom model no transformers family describes is refused on export, naming what does not fit
// (and nothing is written).
TEST(HfExportErrors, ModelsWithoutATransformersFamilyAreRefused) {
  struct Case {
    std::function<void(ModelConfig&)> edit;
    const char* expected;
  };
  const Case cases[] = {
      {[](ModelConfig& c) { c.moe_experts = 4, c.moe_shared = 1; }, "maps to Mixtral or Qwen3-MoE"},
      {[](ModelConfig& c) { c.moe_experts = 4, c.moe_renorm = false; }, "Mixtral renormalises"},
      {[](ModelConfig& c) { c.qkv_bias = c.qk_norm = true; }, "no transformers family"},
      {[](ModelConfig& c) {
         c.mla_kv_rank = 16, c.mla_rope_dim = 4, c.moe_experts = 4, c.moe_groups = 2;
       },
       "group_limited_greedy"},
  };
  auto backend = make_cpu_backend();
  int i = 0;
  for (const Case& c : cases) {
    ModelConfig config = model_preset("llama-tiny");
    c.edit(config);
    Transformer model(*backend, config);
    const fs::path out = fs::path(::testing::TempDir()) / ("hf_export_refused_" + std::to_string(i++));
    fs::remove_all(out);
    const std::string msg = test::error_of([&] { save_hf_model(out.string(), ModelState{config, model.params()}); });
    EXPECT_NE(msg.find("export to a Hugging Face folder"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
    EXPECT_FALSE(fs::exists(out / "model.safetensors"));
  }
}

}  // namespace
}  // namespace loom
