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
#include "loom/checkpoint/safetensors.h"
#include "loom/core/pages.h"
#include "loom/infer/generate.h"
#include "loom/model/transformer.h"
#include "loom/train/model_source.h"
#include "loom/train/quantize_run.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return test::fixture_dir() + "/hf/" + name; }

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
                                           "qwen3_moe", "deepseek_v2", "deepseek_v3", "smollm3", "phi3", "olmo2",
                                           "gemma3", "phi3_longrope", "qwen3_next", "gpt_oss", "gpt_oss_mxfp4"));

// ---------------------------------------------------------------- bf16 weights used in place

// A fixture folder with every tensor stored as BF16 (rounded), for families whose fixture is f32.
// The folder's model.safetensors rewritten with every tensor rounded to bf16.
void to_bf16(const fs::path& from, const fs::path& out) {
  const SafetensorsFile file = SafetensorsFile::read((from / "model.safetensors").string());
  CpuAllocator host;
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& t : file.names()) {
    const Tensor f = Tensor::empty(host, file.shape(t), DTYPE_F32, MEM_WORKSPACE);
    file.copy_as_f32(t, f);
    const Tensor b = Tensor::empty(host, file.shape(t), DTYPE_BF16, MEM_WORKSPACE);
    for (int64_t i = 0; i < f.numel(); ++i) b.data<bf16>()[i] = f32_to_bf16(f.data<float>()[i]);
    tensors.emplace_back(t, b);
  }
  write_safetensors((out / "model.safetensors").string(), tensors, {{"format", "pt"}});
}

fs::path bf16_copy(const std::string& name) {
  const fs::path out = fs::path(::testing::TempDir()) / ("hf_bf16_" + name);
  fs::remove_all(out);
  fs::create_directories(out);
  fs::copy_file(fs::path(fixture(name)) / "config.json", out / "config.json");
  to_bf16(fixture(name), out);
  return out;
}

struct InferenceRun {
  std::vector<double> logits;
  double loss = 0.0;
  std::vector<int32_t> greedy;
  int64_t bf16_params = 0, resident_param_bytes = 0;
};

InferenceRun run_inference(const std::string& dir, Backend& backend, bool f32_weights) {
  const ModelSource source = model_source(dir);
  const std::unique_ptr<Transformer> model = open_inference_model(source, backend, f32_weights);
  EXPECT_FALSE(model->has_gradients());
  const nlohmann::json expected = read_json(fs::path(fixture(source.config.model.arch == ARCH_GPT2 ? "gpt2" : "llama")) /
                                            "expected.json");
  const std::vector<int32_t> tokens = expected["tokens"].get<std::vector<int32_t>>();
  InferenceRun run;
  const int64_t T = static_cast<int64_t>(tokens.size()) - 1;
  ActivationStore store = model->allocate_store(1, T);
  backend.write(store.tokens, tokens.data());  // (through the backend: the strict one's memory too)
  backend.write(store.targets, tokens.data() + 1);
  run.loss = model->forward(store);
  run.logits = test::values(backend, store.logits);
  SamplingConfig greedy;
  greedy.temperature = 0.0f;
  GenerateOptions options;
  options.max_new_tokens = 12;
  run.greedy = generate(*model, std::vector<int32_t>(tokens.begin(), tokens.begin() + 5), greedy, options);
  run.bf16_params = model->bf16_weight_params();
  run.resident_param_bytes = model->params().host_accessible() ? resident_bytes(model->params()) : -1;
  return run;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

// Llama's fixture stores bf16 weights in two shards: its linear weights are used as they are,
// the f32 buffer's pages there are never written, and the result is the f32 path's (the same
// weights widened) up to the order of the f32 sums: the same greedy tokens, logits within 1e-5
// of the largest, PyTorch's logits within the import's 1e-4. GPT-2 (Conv1D weights stored
// transposed, a tied head that stays f32) likewise from a bf16 copy of its fixture. The strict
// backend (memory the host may not read) gives the CPU's bits.
TEST(HfBf16InPlace, GivesTheF32PathsTokensAndHoldsHalfTheBytes) {
  auto cpu = make_cpu_backend();
  for (const std::string& dir : {fixture("llama"), bf16_copy("gpt2").string()}) {
    const ModelSource source = model_source(dir);
    const ModelConfig& c = source.config.model;
    const std::vector<std::string> names = bf16_in_place_names(source);
    ASSERT_EQ(static_cast<int64_t>(names.size()), 4 * c.n_layer + (c.tied_head() ? 1 : 2)) << dir;  // + embedding
    const InferenceRun in_place = run_inference(dir, *cpu, false), widened = run_inference(dir, *cpu, true);
    EXPECT_EQ(widened.bf16_params, 0);
    const ParamLayout layout = build_param_layout(c);
    int64_t linear = 0;
    for (const std::string& n : names) linear += layout.find(n).numel;
    EXPECT_EQ(in_place.bf16_params, linear) << dir;
    // The widened run holds every f32 page; the in-place run about the rest (norms, embeddings).
    const int64_t page = 4096, f32_bytes = layout.total * 4, rest = (layout.total - linear) * 4;
    EXPECT_GE(widened.resident_param_bytes, f32_bytes - page) << dir;
    EXPECT_LE(in_place.resident_param_bytes, rest + 2 * page * static_cast<int64_t>(layout.params.size())) << dir;
    EXPECT_LT(in_place.resident_param_bytes, widened.resident_param_bytes) << dir;
    EXPECT_EQ(in_place.greedy, widened.greedy) << dir;
    double scale = 0.0;
    for (double v : widened.logits) scale = std::max(scale, std::fabs(v));
    EXPECT_LT(max_abs_diff(in_place.logits, widened.logits), 1e-5 * scale) << dir;
    EXPECT_NEAR(in_place.loss, widened.loss, 1e-6 * std::fabs(widened.loss)) << dir;
    if (c.arch != ARCH_GPT2) {  // the fixture's PyTorch logits (the bf16 weights, in float64)
      const nlohmann::json expected = read_json(fs::path(dir) / "expected.json");
      EXPECT_LT(test::max_rel_error(in_place.logits, expected["logits"].get<std::vector<double>>()), 1e-4);
    }
    test::StrictBackend strict;
    const InferenceRun device = run_inference(dir, strict, false);
    EXPECT_EQ(device.bf16_params, linear);
    EXPECT_EQ(device.logits, in_place.logits) << dir;
    EXPECT_EQ(device.greedy, in_place.greedy) << dir;
    std::printf("%s: %lld of %lld parameters in bf16; resident f32 parameter bytes %lld in place, %lld widened; "
                "logits max diff %.2e\n", fs::path(dir).filename().c_str(), static_cast<long long>(linear),
                static_cast<long long>(layout.total), static_cast<long long>(in_place.resident_param_bytes),
                static_cast<long long>(widened.resident_param_bytes), max_abs_diff(in_place.logits, widened.logits));
  }
  // f16 (Mistral's fixture) and f32 weights are widened: nothing in place.
  EXPECT_TRUE(bf16_in_place_names(model_source(fixture("mistral"))).empty());
  EXPECT_TRUE(bf16_in_place_names(model_source(fixture("gpt2"))).empty());
}

TEST(HfBf16InPlace, AnInferenceModelRefusesBackwardAndANonFiniteWeightIsNamed) {
  auto cpu = make_cpu_backend();
  const std::unique_ptr<Transformer> model = open_inference_model(model_source(fixture("llama")), *cpu);
  ActivationStore store = test::next_token_store(*model, {1, 2, 3, 4});
  model->forward(store);
  EXPECT_NE(test::error_of([&] { model->backward(store, 1.0f); }).find("inference"), std::string::npos);
  EXPECT_EQ(cpu->allocator().tracker().current(MEM_GRADIENTS), 0u);
  // A NaN in a bf16 weight is refused by name, as in the f32 path.
  const fs::path broken = fs::path(::testing::TempDir()) / "hf_bf16_nan";
  fs::remove_all(broken);
  fs::copy(fixture("llama"), broken, fs::copy_options::recursive);
  for (const auto& entry : fs::directory_iterator(broken)) {
    if (entry.path().extension() != ".safetensors") continue;
    const SafetensorsFile file = SafetensorsFile::read(entry.path().string());
    if (!file.has("model.layers.0.mlp.down_proj.weight")) continue;
    CpuAllocator host;
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& t : file.names()) {
      Tensor v = Tensor::empty(host, file.shape(t), DTYPE_BF16, MEM_WORKSPACE);
      file.copy_as_bf16(t, v);
      if (t == "model.layers.0.mlp.down_proj.weight") v.data<bf16>()[3] = f32_to_bf16(NAN);
      tensors.emplace_back(t, v);
    }
    write_safetensors(entry.path().string(), tensors, {{"format", "pt"}});
  }
  const std::string e = test::error_of([&] { open_inference_model(model_source(broken.string()), *cpu); });
  EXPECT_NE(e.find("mlp"), std::string::npos) << e;
  EXPECT_NE(e.find("non-finite"), std::string::npos) << e;
}

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
      {"llama", [](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"truncate", "no"}}; },
       "rope_scaling.truncate must be true or false"},
      // GPT-OSS: another swiglu_limit, layer types of another pattern, another quantization
      {"gpt_oss", [](nlohmann::json& j) { j["swiglu_limit"] = 10.0; }, "swiglu_limit"},
      {"gpt_oss", [](nlohmann::json& j) { j["layer_types"] = {"full_attention", "sliding_attention"}; },
       "layer_types = [\"full_attention\",\"sliding_attention\"] is not supported"},
      {"gpt_oss_mxfp4", [](nlohmann::json& j) { j["quantization_config"]["quant_method"] = "gptq"; },
       "quantization_config"},
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
      // SmolLM3's NoPE list must be every no_rope_layer_interval-th layer, of num_hidden_layers entries
      {"smollm3", [](nlohmann::json& j) { j["no_rope_layers"] = {1, 1, 0, 1}; }, "no_rope_layers = [1,1,0,1] is not supported"},
      {"smollm3", [](nlohmann::json& j) { j["no_rope_layers"] = {1, 0}; }, "no_rope_layers must be a list of at least"},
      {"smollm3", [](nlohmann::json& j) { j["use_sliding_window"] = true; }, "use_sliding_window"},
      {"phi3", [](nlohmann::json& j) { j["partial_rotary_factor"] = 0.75; }, "partial_rotary_factor"},
      {"phi3", [](nlohmann::json& j) { j["rope_scaling"] = {{"type", "longrope"}, {"short_factor", {1.0}}, {"long_factor", {1.0}}}; },
       "model.rope_short_factors has 1 factors, expected head_dim / 2 = 4"},
      {"phi3_longrope", [](nlohmann::json& j) { j["rope_scaling"]["long_factor"][2] = -1.0; }, "long_factor has -1.0, expected positive"},
      {"qwen2", [](nlohmann::json& j) { j["use_mrope"] = true; }, "use_mrope"},
      {"llama", [](nlohmann::json& j) { j["model_type"] = "gemma2"; }, "model_type 'gemma2' is not supported yet: Gemma 2 needs"},
      // Gemma 3: 27B's query_pre_attn_scalar, Gemma 2's soft-capping, layer types of another pattern
      {"gemma3", [](nlohmann::json& j) { j["query_pre_attn_scalar"] = 168; }, "query_pre_attn_scalar = 168 is not supported"},
      {"gemma3", [](nlohmann::json& j) { j["final_logit_softcapping"] = 30.0; }, "final_logit_softcapping = 30.0 is not supported"},
      {"gemma3", [](nlohmann::json& j) { j["hidden_activation"] = "silu"; }, "hidden_activation"},
      {"gemma3", [](nlohmann::json& j) {
         j["layer_types"] = {"sliding_attention", "full_attention", "full_attention", "sliding_attention"};
       }, "layer_types = [\"sliding_attention\",\"full_attention\",\"full_attention\",\"sliding_attention\"] is not supported"},
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

// transformers 5 writes rope_theta and rope_scaling as one rope_parameters object: the same
// folder in that form gives the same model config (llama32: llama3 scaling; qwen3: yarn; llama:
// rope_type default), and both forms at once are refused.
TEST(HfImport, Transformers5RopeParametersGiveTheSameConfig) {
  int i = 0;
  for (const char* name : {"llama32", "qwen3", "llama"}) {
    const ModelConfig want = hf_model_config(fixture(name));
    const fs::path dir = broken_copy(name, "rope_parameters" + std::to_string(i++));
    edit_config(dir, [](nlohmann::json& j) {
      nlohmann::json p = j["rope_scaling"].is_null() ? nlohmann::json{{"rope_type", "default"}} : j["rope_scaling"];
      p["rope_theta"] = j["rope_theta"];
      j.erase("rope_scaling"), j.erase("rope_theta");
      j["rope_parameters"] = p;
    });
    EXPECT_EQ(model_config_json(hf_model_config(dir.string())).dump(), model_config_json(want).dump()) << name;
    edit_config(dir, [](nlohmann::json& j) { j["rope_scaling"] = j["rope_parameters"]; });
    EXPECT_NE(test::error_of([&] { hf_model_config(dir.string()); }).find("rope_parameters and rope_scaling are both set"),
              std::string::npos);
  }
  const fs::path dir = broken_copy("llama", "rope_parameters_dynamic");
  edit_config(dir, [](nlohmann::json& j) { j["rope_parameters"] = {{"rope_type", "dynamic"}, {"factor", 2.0}}; });
  const std::string msg = test::error_of([&] { hf_model_config(dir.string()); });
  EXPECT_NE(msg.find("rope_parameters.rope_type = 'dynamic' is not supported"), std::string::npos) << msg;
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

// A Llama-shaped bf16 Hugging Face folder of random weights whose every linear layer quantizes
// (input widths multiples of 32): the fixture's config with intermediate_size 64.
fs::path quantizable_bf16_folder(bool tied) {
  ModelConfig c = hf_model_config(fixture("llama"));
  c.d_ff = 64;
  c.tie_embeddings = tied;
  auto cpu = make_cpu_backend();
  Transformer model(*cpu, c);
  model.init_weights(11);
  const fs::path f32 = fs::path(::testing::TempDir()) / (tied ? "hf_quant_src_f32_tied" : "hf_quant_src_f32");
  const fs::path out = fs::path(::testing::TempDir()) / (tied ? "hf_quant_src_tied" : "hf_quant_src");
  fs::remove_all(f32), fs::remove_all(out);
  save_hf_model(f32.string(), ModelState{c, model.params()});
  fs::create_directories(out);
  fs::copy_file(f32 / "config.json", out / "config.json");
  to_bf16(f32, out);
  return out;
}

// Streaming quantization (train/quantize_run.h) reads a bf16 folder block by block into lazy
// pages and writes each weight as it is made; its codes, scales and zeros are bitwise those of
// quantize_model on the whole model loaded in f32 (every method, tied and untied heads), its
// token embedding stays BF16 with the source's bits, and the folder it writes decodes as the
// in-memory model does. A broken variant (a weight written otherwise than planned) is refused.
TEST(HfStreamingQuantize, EqualsTheWholeModelsQuantizationAndKeepsTheEmbeddingInBf16) {
  struct Case {
    QuantMethod method;
    int bits;
    IntStorage storage;
  };
  const Case cases[] = {{QuantMethod::gptq, 4, {}},
                        {QuantMethod::rtn, 4, {.f16_scales = true, .symmetric = true}},
                        {QuantMethod::awq, 4, {.f16_scales = true}},
                        {QuantMethod::smoothquant, 8, {}},
                        {QuantMethod::gptq, 3, {.symmetric = true}}};
  for (const bool tied : {false, true}) {
    const fs::path dir = quantizable_bf16_folder(tied);
    const ModelSource source = model_source(dir.string());
    const ModelConfig& c = source.config.model;
    std::vector<std::vector<int32_t>> sequences;
    for (int s = 0; s < 6; ++s) {  // two batches, the second short
      std::vector<int32_t> seq(16);
      for (int t = 0; t < 16; ++t) seq[static_cast<size_t>(t)] = (s * 37 + t * 11 + t * t) % static_cast<int>(c.vocab_size);
      sequences.push_back(seq);
    }
    for (const Case& k : cases) {
      QuantizeOptions o;
      o.method = k.method, o.bits = k.bits, o.group = 32, o.storage = k.storage, o.calib_seq_len = 16;
      if (k.method == QuantMethod::smoothquant) o.group = 0;
      const std::string what = str_cat(quant_method_name(k.method), " ", k.bits, tied ? " tied" : "");
      const fs::path out = fs::path(::testing::TempDir()) / "hf_quant_out";
      const QuantizeRunResult r = quantize_to_folder(source, o, sequences, out.string(), {});
      EXPECT_EQ(r.total_params, build_param_layout(c).total) << what;
      auto cpu = make_cpu_backend();
      Transformer whole(*cpu, c);
      load_weights(source, whole.params());
      const std::map<std::string, IntWeight> expected = quantize_model(whole, sequences, o, {});
      Transformer back(*cpu, c);
      std::map<std::string, IntWeight> read;
      CpuAllocator host;
      const Tensor embedding = Tensor::empty(host, back.param(embedding_param_name(c)).shape(), DTYPE_BF16, MEM_WORKSPACE);
      const nlohmann::json meta = read_quantized_model(out.string(), ModelState{c, back.params()}, read,
                                                       {{embedding_param_name(c), embedding}});
      EXPECT_EQ(meta.at("scales").get<std::string>(), k.storage.f16_scales ? "f16" : "f32") << what;
      ASSERT_EQ(read.size(), expected.size()) << what;
      int64_t stored = 0;
      for (const auto& [name, q] : expected) {
        const IntWeight& b = read.at(name);
        EXPECT_EQ(b.codes, q.codes) << what << " " << name;
        EXPECT_EQ(b.scales, q.scales) << what << " " << name;
        EXPECT_EQ(b.zeros, q.zeros) << what << " " << name;
        EXPECT_EQ(b.input_scale, q.input_scale) << what << " " << name;
        stored += q.stored_bytes();
        if (k.storage.symmetric) {
          for (uint8_t z : b.zeros) ASSERT_EQ(z, 1 << (k.bits - 1)) << what;
        }
      }
      EXPECT_EQ(r.stored_bytes, stored) << what;
      // The embedding: BF16 in the file, the source's bits.
      EXPECT_EQ(quantized_model_bf16_params(out.string()), std::vector<std::string>{embedding_param_name(c)}) << what;
      HfWeightReader reader(dir.string(), c);
      const Tensor original = Tensor::empty(host, embedding.shape(), DTYPE_BF16, MEM_WORKSPACE);
      reader.read(embedding_param_name(c), original);
      EXPECT_EQ(std::memcmp(original.raw_data(), embedding.raw_data(), embedding.nbytes()), 0) << what;
      // The folder decodes as the in-memory quantized model (embedding widened exactly): the same logits.
      Transformer ref(*cpu, c);
      load_weights(source, ref.params());
      ref.set_flash_attention(true);  // as an inference model's
      ref.set_int_weights(std::map<std::string, IntWeight>(expected));
      const std::unique_ptr<Transformer> served = open_inference_model(model_source(out.string()), *cpu);
      EXPECT_EQ(served->bf16_weight_params(), embedding.numel()) << what;
      ActivationStore a = test::next_token_store(ref, {3, 1, 4, 1, 5, 9}), b = test::next_token_store(*served, {3, 1, 4, 1, 5, 9});
      ref.forward(a);
      served->forward(b);
      EXPECT_EQ(test::values(*cpu, a.logits), test::values(*cpu, b.logits)) << what;
    }
    // A writer refuses a weight quantized otherwise than planned, and an uncommitted folder is removed.
    {
      QuantizedModelPlan plan;
      plan.model = c;
      const std::string name = "model.layers.0.mlp.down_proj.weight";
      plan.quantized[name] = {int_weight_spec(4, 32, c.d_model, c.d_ff, false, name), false};
      const fs::path out = fs::path(::testing::TempDir()) / "hf_quant_refused";
      fs::remove_all(out);
      {
        QuantizedModelWriter writer(out.string(), plan);
        const std::vector<float> w(static_cast<size_t>(c.d_model * c.d_ff), 0.25f);
        const IntWeight other = rtn_quantize(w, int_weight_spec(8, 32, c.d_model, c.d_ff, false, name));
        EXPECT_NE(test::error_of([&] { writer.write_weight(name, other); }).find("otherwise than planned"), std::string::npos);
        EXPECT_NE(test::error_of([&] { writer.commit("", {}); }).find("never written"), std::string::npos);
      }
      EXPECT_FALSE(fs::exists(out.string() + ".tmp"));
      EXPECT_FALSE(fs::exists(out));
    }
  }
}

}  // namespace
}  // namespace loom
