// Configuration: TOML files and --set overrides land in typed fields; unknown keys and wrong
// types are errors naming the file and key; the resolved TOML reads back to the same config.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "loom/arch/param_layout.h"
#include "loom/core/error.h"
#include "loom/checkpoint/hf_config.h"
#include "loom/train/config.h"
#include "test_util.h"

namespace loom {
using test::error_of;
namespace {

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = (std::filesystem::temp_directory_path() / ("loom_cfg_" + name)).string();
  std::ofstream(path) << text;
  return path;
}

TEST(ConfigTest, FileAndOverridesSetTypedFields) {
  LoomConfig c;
  apply_config_file(c, write_temp("ok.toml", "[model]\narch = \"llama\"\nn_layer = 3\n[optim]\nlr = 1\n"));
  apply_overrides(c, "optim.lr=2e-3,data.dir=data/x,sample.top_k=5,run.name=nan");
  EXPECT_EQ(c.model.arch, ARCH_LLAMA);
  EXPECT_EQ(c.model.n_layer, 3);
  EXPECT_DOUBLE_EQ(c.train.schedule.max_lr, 2e-3);
  EXPECT_EQ(c.data.dir, "data/x");
  EXPECT_EQ(c.run.name, "nan");  // string keys take the text as is
  EXPECT_EQ(c.sample.sampling.top_k, 5);
}

TEST(ConfigTest, UnknownKeyNamesFileAndKey) {
  LoomConfig c;
  const std::string path = write_temp("unknown.toml", "[train]\nlrr = 1.0\n");
  const std::string msg = error_of([&] { apply_config_file(c, path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.lrr"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { apply_overrides(c, "model.depth=3"); }).find("model.depth"), std::string::npos);
}

TEST(ConfigTest, WrongTypeNamesKeyAndExpectedType) {
  LoomConfig c;
  const std::string msg = error_of([&] { apply_config_file(c, write_temp("type.toml", "[train]\nsteps = \"many\"\n")); });
  EXPECT_NE(msg.find("train.steps"), std::string::npos) << msg;
  EXPECT_NE(msg.find("integer"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { apply_overrides(c, "model.arch=gpt3"); }).find("gpt3"), std::string::npos);
}

// A float key holds a 32-bit float: 1e300 would be stored as inf, and the run's own config.toml
// (config_to_toml writes inf) could not be read back. Refused by name instead; FLT_MAX itself is
// taken, and a double key takes 1e300. (Found by fuzz_config.)
TEST(ConfigTest, FloatKeyOutsideTheFloatRangeIsRefusedByName) {
  LoomConfig c;
  const std::string msg = error_of([&] { apply_overrides(c, "sample.temperature=1e300"); });
  EXPECT_NE(msg.find("sample.temperature"), std::string::npos) << msg;
  EXPECT_NE(msg.find("32-bit float"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { apply_config_file(c, write_temp("big.toml", "[sample]\ntop_p = -1e300\n")); })
                .find("sample.top_p"), std::string::npos);
  apply_overrides(c, "sample.temperature=3.4028234663852886e38,data.val_fraction=1e300");
  EXPECT_EQ(c.sample.sampling.temperature, std::numeric_limits<float>::max());
  EXPECT_EQ(c.data.val_fraction, 1e300);
  LoomConfig back;
  apply_config_text(back, config_to_toml(c), "config_to_toml");
  EXPECT_EQ(back.sample.sampling.temperature, std::numeric_limits<float>::max());
}

TEST(ConfigTest, SyntaxErrorNamesFileAndLine) {
  LoomConfig c;
  const std::string path = write_temp("syntax.toml", "[optim]\nlr = = 3\n");
  const std::string msg = error_of([&] { apply_config_file(c, path); });
  EXPECT_NE(msg.find(path + ":2"), std::string::npos) << msg;
}

TEST(ConfigTest, ResolvedTomlRoundTrips) {
  LoomConfig c;
  apply_overrides(c, "optim.lr=3e-4,model.norm_eps=1e-6,sample.prompt=\"Hi \\\"there\\\"\",train.seed=42");
  LoomConfig back;
  apply_config_file(back, write_temp("resolved.toml", config_to_toml(c)));
  EXPECT_EQ(config_to_toml(back), config_to_toml(c));
  EXPECT_EQ(back.sample.prompt, "Hi \"there\"");
  EXPECT_EQ(back.model.norm_eps, 1e-6f);
  EXPECT_EQ(back.loop.seed, 42u);
}

TEST(ConfigTest, ValidationCatchesInconsistentValues) {
  LoomConfig c;
  c.train.seq_len = c.model.max_seq_len + 1;
  EXPECT_NE(error_of([&] { c.validate(); }).find("train.seq_len"), std::string::npos);
}

// The block and expert counts are bounded, so a config read from a file cannot ask for the
// parameter layout of 10^8 blocks (the checkpoint fuzzer's out-of-memory input): refused by key.
TEST(ConfigTest, BlockAndExpertCountsAreBounded) {
  ModelConfig c = model_preset("llama-tiny");
  c.n_layer = 4096;
  c.validate();
  c.n_layer = 4097;
  EXPECT_EQ(error_of([&] { c.validate(); }), "model.n_layer must be <= 4096, got 4097");
  c.n_layer = 32, c.moe_experts = 4096, c.moe_top_k = 8;
  c.validate();  // 32 x 4096 = 2^17 expert blocks
  c.n_layer = 33;
  EXPECT_EQ(error_of([&] { c.validate(); }), "model.n_layer x model.moe_experts must be <= 131072, got 33 x 4096");
  c.n_layer = 2, c.moe_experts = 4097;
  EXPECT_EQ(error_of([&] { c.validate(); }), "model.moe_experts must be <= 4096, got 4097");
}

// Widths whose parameters have more elements than an int64 holds (a checkpoint's model_config
// with d_model 2^34, found by the checkpoint fuzzer as a signed overflow) are refused, not wrapped.
TEST(ConfigTest, ParameterCountsBeyondInt64AreRefused) {
  EXPECT_EQ(error_of([] { shape_numel(Shape{int64_t{1} << 40, int64_t{1} << 30}); }),
            "shape (1099511627776, 1073741824) has more elements than an int64 holds");
  EXPECT_EQ(shape_numel(Shape{int64_t{1} << 40, int64_t{1} << 22}), int64_t{1} << 62);
  ModelConfig c = model_preset("gpt2-tiny");
  c.d_model = int64_t{1} << 34, c.n_head = 1, c.n_kv_head = 1;
  EXPECT_NE(error_of([&] { build_param_layout(c); }).find("has more elements than an int64 holds"), std::string::npos);
  c.d_model = int64_t{1} << 30, c.d_ff = 4, c.vocab_size = 4;  // each tensor fits, the sum over blocks does not
  c.n_layer = 4096;
  EXPECT_NE(error_of([&] { build_param_layout(c); }).find("number more than an int64 holds"), std::string::npos);
}

TEST(ConfigTest, AttentionWindowIsSetAndValidated) {
  LoomConfig c;
  apply_overrides(c, "model.attn_window=3");
  EXPECT_EQ(c.model.attn_window, 3);
  c.validate();
  c.model.attn_window = -1;
  EXPECT_NE(error_of([&] { c.validate(); }).find("model.attn_window"), std::string::npos);
}

TEST(ConfigTest, AttentionWindowWithContextParallelismIsRefused) {
  LoomConfig c;
  c.model.attn_window = 4;
  c.parallel.cp = 2;
  const std::string error = error_of([&] { c.validate(); });
  EXPECT_NE(error.find("model.attn_window"), std::string::npos) << error;
  EXPECT_NE(error.find("parallel.cp"), std::string::npos) << error;
}

// Every key of the schema has a row: a type, a default that is TOML of that type and reads
// back to the default, and a meaning.
TEST(ConfigTest, SchemaGivesEveryKeyATypeDefaultAndMeaning) {
  const std::vector<ConfigKey> rows = config_schema();
  const std::vector<std::string> keys = config_keys();
  ASSERT_EQ(rows.size(), keys.size());
  std::map<std::string, ConfigKey> by_key;
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].key, keys[i]);
    EXPECT_FALSE(rows[i].meaning.empty()) << rows[i].key;
    EXPECT_EQ(rows[i].meaning.find('\n'), std::string::npos) << rows[i].key;
    EXPECT_FALSE(rows[i].type.empty()) << rows[i].key;
    EXPECT_FALSE(rows[i].default_value.empty()) << rows[i].key;
    by_key[rows[i].key] = rows[i];
    // The default, written into a TOML file, leaves a default configuration unchanged.
    const std::string section = config_key_section(rows[i].key);
    const std::string name = section.empty() ? rows[i].key : rows[i].key.substr(section.size() + 1);
    LoomConfig c;
    apply_config_text(c, (section.empty() ? "" : "[" + section + "]\n") + name + " = " + rows[i].default_value + "\n",
                      rows[i].key);
    EXPECT_EQ(config_to_toml(c), config_to_toml(LoomConfig{})) << rows[i].key;
  }
  EXPECT_EQ(by_key.size(), rows.size());  // no key twice
  auto expect_row = [&](const std::string& key, const std::string& type, const std::string& value) {
    ASSERT_EQ(by_key.count(key), 1u) << key;
    EXPECT_EQ(by_key[key].type, type) << key;
    EXPECT_EQ(by_key[key].default_value, value) << key;
  };
  expect_row("train.batch_size", "int", "4");
  expect_row("train.seed", "uint", "1337");
  expect_row("optim.name", "string", "'adamw'");
  expect_row("optim.nesterov", "tri-bool", "-1");
  expect_row("model.arch", "arch", "'gpt2'");
  expect_row("data.val_fraction", "float", "0.05");
  expect_row("parallel.overlap", "bool", "true");
  expect_row("precision.param", "string", "''");
  // String keys with a fixed set of values name them.
  EXPECT_NE(by_key["parallel.cp_attention"].meaning.find("ring | ulysses"), std::string::npos);
  EXPECT_NE(by_key["optim.name"].meaning.find("adamw"), std::string::npos);
}

// docs/config.md is config_markdown(): one table per section, regenerated when the schema changes.
TEST(ConfigTest, DocsConfigMdIsTheRenderedSchema) {
  const std::string markdown = config_markdown();
  EXPECT_NE(markdown.find("## [optim]\n\n| key | type | default | meaning |\n"), std::string::npos);
  EXPECT_NE(markdown.find("| `parallel.cp_attention` | string | `'ring'` | with cp > 1: ring \\| ulysses |\n"),
            std::string::npos);
  const char* dir = std::getenv("LOOM_SOURCE_DIR");
  const std::filesystem::path path =
      (dir && *dir ? std::filesystem::path(dir) : std::filesystem::current_path()) / "docs" / "config.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path << ": cannot open (LOOM_SOURCE_DIR names the repository)";
  std::stringstream text;
  text << in.rdbuf();
  std::istringstream file_lines(text.str()), rendered_lines(markdown);
  std::string file_line, rendered_line;
  int line = 0;
  while (true) {  // the first line that differs, for the message
    ++line;
    const bool more_file = static_cast<bool>(std::getline(file_lines, file_line));
    const bool more_rendered = static_cast<bool>(std::getline(rendered_lines, rendered_line));
    if (!more_file && !more_rendered) break;
    if (more_file != more_rendered || file_line != rendered_line) break;
  }
  EXPECT_TRUE(text.str() == markdown) << path.string() << " is stale (line " << line << ": '" << file_line
                                      << "', the schema gives '" << rendered_line << "'): regenerate it with "
                                      << "`build/bin/loom config --markdown > docs/config.md`";
}

}  // namespace
}  // namespace loom

// Real Hub config.json files (tests/fixtures/hub_configs/, as the Hub serves them) load with
// every key either mapped or ignored for a stated reason (docs/models.md). SmolLM2-135M-Instruct
// carries nanotron's is_llama_config, rope_interleaved = false and a transformers.js_config
// block: it loads as a llama of 30 layers, d 576, GQA 9/3, tied head, theta 1e5; the same file
// with rope_interleaved = true is refused naming the key (pairs (2i, 2i + 1) would rotate other
// dimensions), and an unknown key still is.
TEST(HubConfigTest, SmolLM2sRealConfigLoadsAndItsMathChangingKeysAreRefused) {
  namespace fs = std::filesystem;
  const char* source = std::getenv("LOOM_SOURCE_DIR");
  const fs::path real = (source && *source ? fs::path(source) : fs::current_path()) / "tests" / "fixtures" /
                        "hub_configs" / "SmolLM2-135M-Instruct.json";
  const loom::HfConfig c = loom::read_hf_config(real.string());
  EXPECT_EQ(c.family, loom::HfFamily::llama);
  EXPECT_EQ(c.model.n_layer, 30);
  EXPECT_EQ(c.model.d_model, 576);
  EXPECT_EQ(c.model.n_head, 9);
  EXPECT_EQ(c.model.n_kv_head, 3);
  EXPECT_EQ(c.model.d_ff, 1536);
  EXPECT_EQ(c.model.vocab_size, 49152);
  EXPECT_EQ(c.model.max_seq_len, 8192);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_FLOAT_EQ(c.model.rope_theta, 100000.0f);
  std::ifstream in(real);
  const nlohmann::json original = nlohmann::json::parse(in);
  const fs::path broken = fs::temp_directory_path() / ("loom_hub_config_" + std::to_string(::getpid()) + ".json");
  for (const auto& [key, value] : std::map<std::string, nlohmann::json>{{"rope_interleaved", true}, {"frobnicate", 3}}) {
    nlohmann::json j = original;
    j[key] = value;
    std::ofstream(broken) << j.dump(2);
    const std::string msg = loom::test::error_of([&] { loom::read_hf_config(broken.string()); });
    EXPECT_NE(msg.find(key), std::string::npos) << msg;
    EXPECT_NE(msg.find(broken.string()), std::string::npos) << msg;
  }
  fs::remove(broken);
}

// The other real config.json files of issue 48's list, each loaded with the family and shape its
// model card states, or refused for the math-changing reason its family's modeling code has
// (tests/fixtures/hub_configs/README.md says where each file comes from).
TEST(HubConfigTest, TheFamiliesRealConfigsLoadOrAreRefusedForAStatedReason) {
  namespace fs = std::filesystem;
  using loom::HfFamily;
  const char* source = std::getenv("LOOM_SOURCE_DIR");
  const fs::path dir = (source && *source ? fs::path(source) : fs::current_path()) / "tests" / "fixtures" / "hub_configs";
  struct Loads {
    const char* file;
    HfFamily family;
    int64_t n_layer, d_model, n_head, n_kv_head, head_dim, vocab;
    bool tied;
    std::function<void(const loom::ModelConfig&)> more;
  };
  const Loads loads[] = {
      {"SmolLM3-3B.json", HfFamily::smollm3, 36, 2048, 16, 4, 128, 128256, true,  // tied by SmolLM3Config's default
       [](const loom::ModelConfig& c) {
         EXPECT_EQ(c.nope_interval, 4);
         EXPECT_TRUE(c.rope_layer(0) && c.rope_layer(2) && !c.rope_layer(3) && !c.rope_layer(35));
         EXPECT_FLOAT_EQ(c.rope_theta, 5e6f);
       }},
      {"Llama-3.2-1B.json", HfFamily::llama, 16, 2048, 32, 8, 64, 128256, true,
       [](const loom::ModelConfig& c) {
         EXPECT_EQ(c.rope_scaling, loom::ROPE_SCALING_LLAMA3);
         EXPECT_FLOAT_EQ(c.rope_factor, 32.0f);
         EXPECT_EQ(c.rope_original_context, 8192);
       }},
      {"Qwen2.5-0.5B.json", HfFamily::qwen2, 24, 896, 14, 2, 64, 151936, true,
       [](const loom::ModelConfig& c) { EXPECT_TRUE(c.qkv_bias); EXPECT_EQ(c.attn_window, 0); }},
      {"Qwen3-0.6B.json", HfFamily::qwen3, 28, 1024, 16, 8, 128, 151936, true,
       [](const loom::ModelConfig& c) { EXPECT_TRUE(c.qk_norm); EXPECT_EQ(c.head_size, 128); }},
      {"OLMo-2-0425-1B.json", HfFamily::olmo2, 16, 2048, 16, 16, 128, 100352, false,
       [](const loom::ModelConfig& c) {
         EXPECT_TRUE(c.post_norm && c.qk_norm && c.qk_norm_whole);
         EXPECT_EQ(c.q_norm_width(), 2048);
         EXPECT_FLOAT_EQ(c.rope_theta, 500000.0f);
       }},
      {"Phi-3-mini-4k-instruct.json", HfFamily::phi3, 32, 3072, 32, 32, 96, 32064, false,
       [](const loom::ModelConfig& c) { EXPECT_EQ(c.attn_window, 2047); EXPECT_EQ(c.max_seq_len, 4096); }},
      {"Phi-3-mini-128k-instruct.json", HfFamily::phi3, 32, 3072, 32, 32, 96, 32064, false,
       [](const loom::ModelConfig& c) {  // LongRoPE: 48 short and 48 long factors over an original 4096
         EXPECT_EQ(c.rope_scaling, loom::ROPE_SCALING_LONGROPE);
         EXPECT_EQ(c.rope_original_context, 4096);
         EXPECT_EQ(c.max_seq_len, 131072);
         EXPECT_NEAR(c.rope_attention_factor, std::sqrt(1.0 + std::log(32.0) / std::log(4096.0)), 1e-6);
         const loom::RopeSpec r = c.rope();
         EXPECT_EQ(r.short_factor[47] > 0.0f && r.long_factor[47] > 0.0f && r.short_factor[48] == 0.0f, true);
         EXPECT_FALSE(loom::rope_span(r, 4096).long_span);
         EXPECT_TRUE(loom::rope_span(r, 4097).long_span);
       }},
      {"gemma-3-1b-it.json", HfFamily::gemma3_text, 26, 1152, 4, 1, 256, 262144, true,  // tied by Gemma3TextConfig's default
       [](const loom::ModelConfig& c) {
         EXPECT_TRUE(c.sandwich_norm && c.qk_norm && !c.qk_norm_whole);
         EXPECT_EQ(c.gate_activation, loom::GateActivation::gelu_tanh);
         EXPECT_FLOAT_EQ(c.embed_scale, std::sqrt(1152.0f));
         EXPECT_EQ(c.attn_window, 512);
         EXPECT_EQ(c.window_pattern, 6);
         EXPECT_EQ(c.layer_window(0), 512);  // layers 5, 11, 17, 23 global, the others within 512
         EXPECT_EQ(c.layer_window(5), 0);
         EXPECT_EQ(c.layer_window(23), 0);
         EXPECT_EQ(c.layer_window(25), 512);
         EXPECT_FLOAT_EQ(c.rope(0).theta, 10000.0);
         EXPECT_FLOAT_EQ(c.rope(5).theta, 1e6);
         EXPECT_EQ(c.max_seq_len, 32768);
       }},
      {"Qwen3-Next-80B-A3B-Instruct.json", HfFamily::qwen3_next, 48, 2048, 16, 2, 256, 151936, false,
       [](const loom::ModelConfig& c) {  // 36 gated DeltaNet blocks and 12 gated attention blocks (3, 7, ..., 47)
         EXPECT_EQ(c.linear_interval, 4);
         EXPECT_EQ(c.linear_layer_count(), 36);
         EXPECT_TRUE(c.linear_layer(0) && !c.linear_layer(3) && !c.linear_layer(47));
         EXPECT_EQ(c.linear_key_heads, 16);
         EXPECT_EQ(c.linear_value_heads, 32);
         EXPECT_EQ(c.linear_key_dim, 128);
         EXPECT_EQ(c.linear_value_dim, 128);
         EXPECT_EQ(c.rotary_dim(), 64);  // 0.25 x 256
         EXPECT_TRUE(c.attn_output_gate && c.qk_norm && c.moe_shared_gate);
         EXPECT_EQ(c.moe_experts, 512);
         EXPECT_EQ(c.moe_top_k, 10);
         EXPECT_EQ(c.moe_shared, 1);
         // Per sequence: 36 blocks x (3 x 8192 conv + 32 x 128 x 128 state) floats = 27 MiB, whatever its length.
         EXPECT_EQ(c.linear_state_floats(), 3 * 8192 + 32 * 128 * 128);
       }},
  };
  for (const Loads& l : loads) {
    SCOPED_TRACE(l.file);
    const loom::HfConfig c = loom::read_hf_config((dir / l.file).string());
    EXPECT_EQ(c.family, l.family);
    EXPECT_EQ(c.model.n_layer, l.n_layer);
    EXPECT_EQ(c.model.d_model, l.d_model);
    EXPECT_EQ(c.model.n_head, l.n_head);
    EXPECT_EQ(c.model.n_kv_head, l.n_kv_head);
    EXPECT_EQ(c.model.head_dim(), l.head_dim);
    EXPECT_EQ(c.model.vocab_size, l.vocab);
    EXPECT_EQ(c.model.tie_embeddings, l.tied);
    l.more(c.model);
  }
}
