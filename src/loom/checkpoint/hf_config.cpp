#include "loom/checkpoint/hf_config.h"

#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <type_traits>

#include "loom/checkpoint/model_config_json.h"
#include "loom/core/error.h"
#include "loom/core/json_file.h"

namespace loom {

using nlohmann::json;

namespace {

// config.json, read key by key: every key must be mapped, known to carry no meaning for the
// weights' arithmetic (metadata, dropout, initialisation), or refused by name.
class ConfigReader {
 public:
  ConfigReader(json j, std::string path) : j_(std::move(j)), path_(std::move(path)) {
    LOOM_CHECK(j_.is_object(), path_, ": expected a JSON object");
  }
  const std::string& path() const { return path_; }
  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }
  // An integer key refuses a fraction (64.5 is not read as 64) and a number outside int64;
  // a float key, a value its type cannot hold (1e300 as a float).
  template <class T>
  T get(const std::string& key) {
    used_.insert(key);
    LOOM_CHECK(has(key), path_, ": key '", key, "' is missing");
    const json& v = j_[key];
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      LOOM_CHECK(v.is_number(), path_, ": key '", key, "' has the wrong type (", v.dump(), ")");
      int64_t value = 0;
      if (v.is_number_float()) {
        const double d = v.get<double>();
        LOOM_CHECK(std::isfinite(d) && std::floor(d) == d, path_, ": key '", key, "' must be an integer, got ", v.dump());
        LOOM_CHECK(std::fabs(d) < 0x1p62, path_, ": key '", key, "' = ", v.dump(), " is out of range");
        value = static_cast<int64_t>(d);
      } else if (v.is_number_unsigned()) {
        LOOM_CHECK(v.get<uint64_t>() <= uint64_t{1} << 62, path_, ": key '", key, "' = ", v.dump(), " is out of range");
        value = v.get<int64_t>();
      } else {
        value = v.get<int64_t>();
      }
      LOOM_CHECK(value >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                     (value < 0 || static_cast<uint64_t>(value) <= static_cast<uint64_t>(std::numeric_limits<T>::max())),
                 path_, ": key '", key, "' = ", v.dump(), " is out of range");
      return static_cast<T>(value);
    } else {
      try {
        if constexpr (std::is_floating_point_v<T>) {
          LOOM_CHECK(v.is_number(), path_, ": key '", key, "' has the wrong type (", v.dump(), ")");
          const double d = v.get<double>();
          LOOM_CHECK(std::isfinite(d) && std::fabs(d) <= static_cast<double>(std::numeric_limits<T>::max()), path_,
                     ": key '", key, "' = ", v.dump(), " is not a finite number");
          return static_cast<T>(d);
        } else {
          return v.get<T>();
        }
      } catch (const json::exception&) {
        throw Error(str_cat(path_, ": key '", key, "' has the wrong type (", v.dump(), ")"));
      }
    }
  }
  template <class T>
  T get(const std::string& key, T fallback) {
    used_.insert(key);
    return has(key) ? get<T>(key) : fallback;
  }
  // A key whose only value Loom implements is `expected` (absent or null counts as `fallback`).
  void require(const std::string& key, const json& expected, const json& fallback, const char* why) {
    used_.insert(key);
    const json value = has(key) ? j_[key] : fallback;
    LOOM_CHECK(value == expected, path_, ": ", key, " = ", value.dump(), " is not supported (", why, "; expected ",
               expected.dump(), ")");
  }
  void ignore(std::initializer_list<const char*> keys) {
    for (const char* k : keys) used_.insert(k);
  }
  // Refuses the first key that was neither read nor ignored.
  void finish() const {
    for (const auto& [key, value] : j_.items()) {
      LOOM_CHECK(used_.count(key) != 0, path_, ": unknown key '", key, "' (", value.dump(),
                 "): Loom does not know what it changes, so it will not guess");
    }
  }

 private:
  json j_;
  std::string path_;
  std::set<std::string> used_;
};

// Keys of every transformers config that do not change the model's arithmetic at inference
// or the meaning of its weights (metadata, generation defaults, token ids kept by the tokenizer).
void ignore_common(ConfigReader& r) {
  r.ignore({"architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
            "bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path", "initializer_range", "tokenizer_class",
            "task_specific_params", "output_attentions", "output_hidden_states", "return_dict", "is_decoder",
            "max_length", "do_sample", "temperature", "top_p", "top_k", "use_return_dict", "auto_map",
            // nanotron's marker of the config class it wrote (SmolLM, SmolLM2), and transformers.js's
            // runtime options for its ONNX files (their dtypes, its own KV cache's dtype)
            "is_llama_config", "transformers.js_config"});
}

// The required integer keys of each family and the model fields they set (read on import,
// written on export).
struct IntKey {
  const char* key;
  int64_t ModelConfig::*field;
};
constexpr IntKey kGpt2Keys[] = {{"vocab_size", &ModelConfig::vocab_size}, {"n_positions", &ModelConfig::max_seq_len},
                                {"n_embd", &ModelConfig::d_model},        {"n_layer", &ModelConfig::n_layer},
                                {"n_head", &ModelConfig::n_head}};
constexpr IntKey kLlamaKeys[] = {{"vocab_size", &ModelConfig::vocab_size},
                                 {"max_position_embeddings", &ModelConfig::max_seq_len},
                                 {"hidden_size", &ModelConfig::d_model},
                                 {"intermediate_size", &ModelConfig::d_ff},
                                 {"num_hidden_layers", &ModelConfig::n_layer},
                                 {"num_attention_heads", &ModelConfig::n_head}};
constexpr IntKey kDeepseekMlaKeys[] = {{"kv_lora_rank", &ModelConfig::mla_kv_rank},
                                       {"qk_rope_head_dim", &ModelConfig::mla_rope_dim},
                                       {"qk_nope_head_dim", &ModelConfig::mla_nope_dim},
                                       {"v_head_dim", &ModelConfig::mla_v_dim}};

template <size_t N>
void read_int_keys(ConfigReader& r, const IntKey (&keys)[N], ModelConfig& c) {
  for (const IntKey& k : keys) c.*k.field = r.get<int64_t>(k.key);
}
template <size_t N>
void write_int_keys(json& j, const IntKey (&keys)[N], const ModelConfig& c) {
  for (const IntKey& k : keys) j[k.key] = c.*k.field;
}

ModelConfig gpt2_config(ConfigReader& r) {
  ModelConfig c;
  c.arch = ARCH_GPT2;
  read_int_keys(r, kGpt2Keys, c);
  c.n_kv_head = c.n_head;
  c.d_ff = r.get<int64_t>("n_inner", 4 * c.d_model);
  c.norm_eps = r.get<float>("layer_norm_epsilon", 1e-5f);
  c.init_std = r.get<float>("initializer_range", 0.02f);
  r.require("activation_function", "gelu_new", "gelu_new", "Loom's GELU is the tanh approximation");
  r.require("tie_word_embeddings", true, true, "GPT-2's head is the token embedding");
  r.require("scale_attn_weights", true, true, "attention scores are scaled by 1/sqrt(head_dim)");
  r.require("scale_attn_by_inverse_layer_idx", false, false, "no per-layer score scaling");
  r.require("reorder_and_upcast_attn", false, false, "no reordered attention");
  r.require("add_cross_attention", false, false, "decoder-only");
  r.ignore({"n_ctx", "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type", "summary_use_proj",
            "summary_activation", "summary_proj_to_labels", "summary_first_dropout"});
  return c;
}

// YaRN's magnitude correction (Peng et al. 2023, §3.4; DeepSeek's yarn_get_mscale):
// 0.1 m ln(s) + 1 for a scale s > 1, else 1.
double yarn_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// config.json's rope_scaling: null, {"rope_type" (or "type"): "llama3", "factor",
// "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
// {"rope_type": "linear", "factor"} or {"rope_type": "yarn", "factor",
// "original_max_position_embeddings" (default max_position_embeddings), "beta_fast" (32),
// "beta_slow" (1), "attention_factor" | "mscale", "mscale_all_dim"}; other types (dynamic,
// longrope) and keys are refused. YaRN's cos/sin factor is attention_factor, else
// mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
// mscale(factor, 1), as transformers computes it; DeepSeek (mla) also multiplies the scores by
// mscale(factor, mscale_all_dim)^2, as its attention does.
//
// transformers 5 writes both as one object, rope_parameters: {"rope_theta", "rope_type"
// ("default": no scaling), and the scaling's keys}; read_rope_parameters takes it to the same fields.
void read_scaling_object(const std::string& path, const char* where, json s, ModelConfig& c, bool deepseek);

void read_rope_scaling(ConfigReader& r, ModelConfig& c, bool deepseek = false) {
  if (r.has("rope_parameters")) {
    const std::string& path = r.path();
    LOOM_CHECK(!r.has("rope_scaling"), path, ": rope_parameters and rope_scaling are both set: give one");
    json p = r.get<json>("rope_parameters");
    LOOM_CHECK(p.is_object() && p.contains("rope_type") && p["rope_type"].is_string(), path,
               ": rope_parameters must be an object with a rope_type (per-layer-type rope_parameters are not supported), "
               "got ", p.dump());
    if (p.contains("rope_theta")) {
      LOOM_CHECK(!r.has("rope_theta") || r.get<json>("rope_theta") == p["rope_theta"], path,
                 ": rope_theta and rope_parameters.rope_theta differ: give one");
      LOOM_CHECK(p["rope_theta"].is_number() && p["rope_theta"].get<double>() > 0.0, path,
                 ": rope_parameters.rope_theta must be a positive number, got ", p["rope_theta"].dump());
      c.rope_theta = p["rope_theta"].get<float>();
      p.erase("rope_theta");
    }
    if (p["rope_type"] == "default") {
      for (const auto& [key, value] : p.items()) {
        LOOM_CHECK(key == "rope_type", path, ": unknown key 'rope_parameters.", key, "' (", value.dump(),
                   ") for rope_type default");
      }
    } else {
      read_scaling_object(path, "rope_parameters", std::move(p), c, deepseek);
    }
    r.ignore({"rope_scaling"});
    return;
  }
  r.ignore({"rope_parameters"});
  if (!r.has("rope_scaling")) {
    r.ignore({"rope_scaling"});
    return;
  }
  read_scaling_object(r.path(), "rope_scaling", r.get<json>("rope_scaling"), c, deepseek);
}

// One rope_scaling object (`where`: its key, for errors).
void read_scaling_object(const std::string& path, const char* where, json s, ModelConfig& c, bool deepseek) {
  LOOM_CHECK(s.is_object(), path, ": ", where, " must be an object or null, got ", s.dump());
  const std::string type_key = s.contains("rope_type") ? "rope_type" : "type";
  LOOM_CHECK(s.contains(type_key) && s[type_key].is_string(), path, ": ", where, ".rope_type is missing");
  const std::string type = s[type_key].get<std::string>();
  std::set<std::string> known = {"rope_type", "type"};
  auto number = [&](const char* key) {
    known.insert(key);
    LOOM_CHECK(s.contains(key) && s[key].is_number(), path, ": ", where, ".", key, " is missing or not a number");
    return s[key].get<double>();
  };
  // An integer of rope_scaling (a position count).
  auto integer = [&](const char* key, double value) {
    LOOM_CHECK(std::floor(value) == value && std::fabs(value) < 0x1p62, path, ": ", where, ".", key,
               " must be an integer, got ", value);
    return static_cast<int64_t>(value);
  };
  if (type == "linear") {
    c.rope_scaling = ROPE_SCALING_LINEAR;
    c.rope_factor = static_cast<float>(number("factor"));
  } else if (type == "llama3") {
    c.rope_scaling = ROPE_SCALING_LLAMA3;
    c.rope_factor = static_cast<float>(number("factor"));
    c.rope_low_freq_factor = static_cast<float>(number("low_freq_factor"));
    c.rope_high_freq_factor = static_cast<float>(number("high_freq_factor"));
    c.rope_original_context = integer("original_max_position_embeddings", number("original_max_position_embeddings"));
  } else if (type == "yarn") {
    c.rope_scaling = ROPE_SCALING_YARN;
    auto optional = [&](const char* key, double fallback) {
      known.insert(key);
      if (!s.contains(key) || s[key].is_null()) return fallback;
      LOOM_CHECK(s[key].is_number(), path, ": ", where, ".", key, " is not a number");
      return s[key].get<double>();
    };
    const double factor = number("factor");
    c.rope_factor = static_cast<float>(factor);
    c.rope_original_context = integer("original_max_position_embeddings",
                                      optional("original_max_position_embeddings", static_cast<double>(c.max_seq_len)));
    c.rope_beta_fast = static_cast<float>(optional("beta_fast", 32.0));
    c.rope_beta_slow = static_cast<float>(optional("beta_slow", 1.0));
    const double mscale = optional("mscale", 0.0), mscale_all_dim = optional("mscale_all_dim", 0.0);
    const double derived = mscale != 0.0 && mscale_all_dim != 0.0
                               ? yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                               : yarn_mscale(factor, deepseek && mscale != 0.0 ? mscale : 1.0);
    c.rope_attention_factor = static_cast<float>(optional("attention_factor", derived));
    if (deepseek && mscale_all_dim != 0.0) {
      const double m = yarn_mscale(factor, mscale_all_dim);
      c.mla_score_scale = static_cast<float>(m * m);
    }
    known.insert("truncate");  // false (GPT-OSS): the ramp's ends are not rounded
    LOOM_CHECK(!s.contains("truncate") || s["truncate"].is_boolean(), path, ": ", where, ".truncate must be true or "
               "false, got ", s["truncate"].dump());
    c.rope_yarn_truncate = !s.contains("truncate") || s["truncate"].get<bool>();
  } else if (type == "longrope" || type == "su") {
    // LongRoPE (Phi-3 128k): per-pair short and long factors; the original context and the attention
    // factor are the family's (read_longrope_context below) unless the object gives them.
    c.rope_scaling = ROPE_SCALING_LONGROPE;
    const auto list = [&](const char* key) {
      known.insert(key);
      LOOM_CHECK(s.contains(key) && s[key].is_array(), path, ": ", where, ".", key, " must be a list of numbers");
      std::string out;
      for (const json& v : s[key]) {
        LOOM_CHECK(v.is_number() && v.get<double>() > 0.0, path, ": ", where, ".", key, " has ", v.dump(),
                   ", expected positive numbers");
        if (!out.empty()) out.push_back(',');
        out.append(nlohmann::json(shortest_decimal(v.get<float>())).dump());
      }
      return out;
    };
    c.rope_short_factors = list("short_factor");
    c.rope_long_factors = list("long_factor");
    known.insert("factor");  // transformers derives the factor from the contexts when the config has both
    if (s.contains("original_max_position_embeddings")) {
      c.rope_original_context = integer("original_max_position_embeddings", number("original_max_position_embeddings"));
    }
    if (s.contains("attention_factor") && !s["attention_factor"].is_null()) {
      c.rope_attention_factor = static_cast<float>(number("attention_factor"));
    } else {
      known.insert("attention_factor");
      c.rope_attention_factor = 0.0f;  // derived by read_longrope_context
    }
  } else {
    const char* why = type == "dynamic" ? ": dynamic NTK's base grows with the sequence's length at run time" : "";
    throw Error(str_cat(path, ": ", where, ".rope_type = '", type, "' is not supported (linear, llama3, yarn, longrope)", why));
  }
  for (const auto& [key, value] : s.items()) {
    LOOM_CHECK(known.count(key) != 0, path, ": unknown key '", where, ".", key, "' (", value.dump(), ") for rope_type ",
               type);
  }
}

// LongRoPE's original context (config.json's original_max_position_embeddings, else
// max_position_embeddings) and attention factor sqrt(1 + ln(s) / ln(L)), s = max / original
// (1 for s <= 1), as transformers' _compute_longrope_parameters derives them.
void read_longrope_context(ConfigReader& r, ModelConfig& c) {
  if (c.rope_scaling != ROPE_SCALING_LONGROPE) return;
  c.rope_original_context = r.get<int64_t>("original_max_position_embeddings", c.max_seq_len);
  LOOM_CHECK(c.rope_original_context > 0, r.path(), ": original_max_position_embeddings must be > 0");
  if (c.rope_attention_factor == 0.0f) {
    const double s = static_cast<double>(c.max_seq_len) / static_cast<double>(c.rope_original_context);
    c.rope_attention_factor = static_cast<float>(
        s <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(s) / std::log(static_cast<double>(c.rope_original_context))));
  }
}

// LongRoPE's factors as config.json lists, read from the model's RopeSpec (ModelConfig::rope parses them).
json factor_list(const float* factors, int64_t pairs) {
  json out = json::array();
  for (int64_t j = 0; j < pairs; ++j) out.push_back(shortest_decimal(factors[j]));
  return out;
}

json rope_scaling_json(const ModelConfig& c) {
  const auto d = shortest_decimal;
  if (c.rope_scaling == ROPE_SCALING_LONGROPE) {  // Phi3Config takes these three keys only
    const RopeSpec r = c.rope();
    return {{"type", "longrope"}, {"short_factor", factor_list(r.short_factor, c.head_dim() / 2)},
            {"long_factor", factor_list(r.long_factor, c.head_dim() / 2)}};
  }
  if (c.rope_scaling == ROPE_SCALING_LINEAR) return {{"rope_type", "linear"}, {"factor", d(c.rope_factor)}};
  if (c.rope_scaling == ROPE_SCALING_YARN) {
    return {{"rope_type", "yarn"},
            {"factor", d(c.rope_factor)},
            {"original_max_position_embeddings", c.rope_original_context},
            {"beta_fast", d(c.rope_beta_fast)},
            {"beta_slow", d(c.rope_beta_slow)},
            {"attention_factor", d(c.rope_attention_factor)},
            {"truncate", c.rope_yarn_truncate}};
  }
  return {{"rope_type", "llama3"},
          {"factor", d(c.rope_factor)},
          {"low_freq_factor", d(c.rope_low_freq_factor)},
          {"high_freq_factor", d(c.rope_high_freq_factor)},
          {"original_max_position_embeddings", c.rope_original_context}};
}

// The keys the Llama-derived families share (llama, mistral, qwen2/3, mixtral, qwen3_moe and
// DeepSeek's non-attention keys).
// tie_default: tie_word_embeddings when absent (the family's configuration class's default).
void read_llama_common(ConfigReader& r, ModelConfig& c, bool deepseek = false, bool tie_default = false,
                       bool attention_bias = false) {
  c.arch = ARCH_LLAMA;
  read_int_keys(r, kLlamaKeys, c);
  c.n_kv_head = r.get<int64_t>("num_key_value_heads", c.n_head);
  c.norm_eps = r.get<float>("rms_norm_eps", 1e-6f);
  c.rope_theta = r.get<float>("rope_theta", 10000.0f);
  c.init_std = r.get<float>("initializer_range", 0.02f);
  c.tie_embeddings = r.get<bool>("tie_word_embeddings", tie_default);
  LOOM_CHECK(c.n_head > 0, r.path(), ": num_attention_heads must be > 0");
  r.require("hidden_act", "silu", "silu", "Loom's SwiGLU gates with SiLU");
  if (!attention_bias) {  // (GPT-OSS reads it: model.qkv_bias and attn_out_bias)
    r.require("attention_bias", false, false, "an output-projection bias (o_proj) is not implemented for llama");
  }
  r.require("mlp_bias", false, false, "MLP biases are not implemented for llama yet");
  // pretraining_tp > 1 (SmolLM3 writes 2): transformers' Llama once split the projections into
  // that many slices and summed their products, the same linear maps in another order; today's
  // modeling code reads it nowhere.
  r.ignore({"pretraining_tp"});
  if (!deepseek) {  // nanotron's key (SmolLM2 writes false): pairs (2i, 2i + 1) rotate other dimensions
    r.require("rope_interleaved", false, false, "RoPE on interleaved pairs (2i, 2i + 1) is not transformers' "
              "rotate-half (i, i + d/2) that the weights of a llama folder are laid out for");
  }
  read_rope_scaling(r, c, deepseek);
  r.ignore({"attention_dropout"});
}

void read_head_dim(ConfigReader& r, ModelConfig& c) {
  const int64_t head_dim = r.get<int64_t>("head_dim", c.d_model / c.n_head);
  if (head_dim != c.d_model / c.n_head || c.d_model % c.n_head != 0) c.head_size = head_dim;
}

// SmolLM3's NoPE layers: no_rope_layers[i] = 0 where layer i skips RoPE, which Loom keeps as
// every no_rope_layer_interval-th layer (model.nope_interval); a list of another pattern is
// refused. transformers derives the list from the interval (default 4) when it is absent.
void read_nope_layers(ConfigReader& r, ModelConfig& c) {
  const int64_t interval = r.get<int64_t>("no_rope_layer_interval", 4);
  LOOM_CHECK(interval >= 0, r.path(), ": no_rope_layer_interval must be >= 0, got ", interval);
  c.nope_interval = interval;
  if (!r.has("no_rope_layers")) {
    r.ignore({"no_rope_layers"});
    return;
  }
  const json list = r.get<json>("no_rope_layers");
  LOOM_CHECK(list.is_array() && static_cast<int64_t>(list.size()) >= c.n_layer, r.path(),
             ": no_rope_layers must be a list of at least num_hidden_layers = ", c.n_layer,
             " entries (1: RoPE, 0: none)");
  bool every = true;  // all ones: RoPE on every layer whatever the interval (entries past the layers unused)
  for (int64_t i = 0; i < c.n_layer; ++i) every = every && list[static_cast<size_t>(i)] == 1;
  if (every) c.nope_interval = 0;
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const json& v = list[static_cast<size_t>(i)];
    LOOM_CHECK(v == (c.rope_layer(i) ? 1 : 0), r.path(), ": no_rope_layers = ", list.dump(), " is not supported (Loom "
               "skips RoPE on every no_rope_layer_interval-th layer, layers ", interval - 1, ", ", 2 * interval - 1,
               ", ...; entry ", i, " is ", v.dump(), ")");
  }
}

// layer_types of sliding and full attention layers, kept as model.window_pattern N (layers N-1,
// 2N-1, ... full): N is one past the first full layer (past the last layer when none is), and a
// list of another pattern is refused naming its entry. Absent: the family's pattern stays.
void read_window_layer_types(ConfigReader& r, ModelConfig& c) {
  if (!r.has("layer_types")) return;
  const json list = r.get<json>("layer_types");
  LOOM_CHECK(list.is_array() && static_cast<int64_t>(list.size()) == c.n_layer, r.path(),
             ": layer_types must list num_hidden_layers = ", c.n_layer, " entries");
  int64_t first_full = 0;
  while (first_full < c.n_layer && list[static_cast<size_t>(first_full)] == "sliding_attention") ++first_full;
  c.window_pattern = first_full < c.n_layer ? first_full + 1 : c.n_layer + 1;  // none global: past the last layer
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const json& v = list[static_cast<size_t>(i)];
    LOOM_CHECK(v == (c.layer_window(i) > 0 ? "sliding_attention" : "full_attention"), r.path(), ": layer_types = ",
               list.dump(), " is not supported (Loom makes every N-th layer global, layers N-1, 2N-1, ...; entry ",
               i, " is ", v.dump(), ")");
  }
}

// Gemma 3's local and global layers: layer_types (transformers >= 4.53) or sliding_window_pattern N
// (layers N-1, 2N-1, ... global; Gemma3TextConfig's default 6), kept as model.window_pattern; a
// layer_types list of another pattern is refused.
void read_gemma_layers(ConfigReader& r, ModelConfig& c) {
  c.attn_window = r.get<int64_t>("sliding_window", 4096);
  LOOM_CHECK(c.attn_window > 0, r.path(), ": sliding_window must be > 0, got ", c.attn_window);
  c.window_pattern = r.get<int64_t>("sliding_window_pattern", 6);
  LOOM_CHECK(c.window_pattern > 0, r.path(), ": sliding_window_pattern must be > 0, got ", c.window_pattern);
  read_window_layer_types(r, c);
  c.rope_local_theta = r.get<float>("rope_local_base_freq", 10000.0f);
}

// Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text): pre and post norms around attention and
// MLP, q/k norms per head, (1 + w) RMSNorms (the folder's w, Loom's 1 + w: hf_model.cpp), GeGLU,
// the embedding times sqrt(hidden_size), local and global layers with their own RoPE, a tied head.
void read_gemma3(ConfigReader& r, ModelConfig& c) {
  c.sandwich_norm = c.qk_norm = true;
  c.gate_activation = GateActivation::gelu_tanh;
  c.embed_scale = std::sqrt(static_cast<float>(c.d_model));  // Gemma3TextScaledWordEmbedding, in fp32
  r.require("hidden_activation", "gelu_pytorch_tanh", "gelu_pytorch_tanh", "Gemma's gate is GELU's tanh approximation");
  // Scores scale by query_pre_attn_scalar^-1/2; Loom's attention scales by head_dim^-1/2 (Gemma 3
  // 1B, 4B, 12B: 256 = head_dim; 27B: 168 of 128 is refused).
  const double scalar = r.get<double>("query_pre_attn_scalar", 256.0);
  LOOM_CHECK(scalar == static_cast<double>(c.head_dim()), r.path(), ": query_pre_attn_scalar = ", scalar,
             " is not supported (Loom scales attention scores by head_dim^-1/2; head_dim = ", c.head_dim(), ")");
  r.require("final_logit_softcapping", nullptr, nullptr, "logit soft-capping (Gemma 2) is not implemented");
  r.require("attn_logit_softcapping", nullptr, nullptr, "attention soft-capping (Gemma 2) is not implemented");
  read_gemma_layers(r, c);
  // transformers' choice of KV cache class for generate(); no effect on the arithmetic.
  r.ignore({"cache_implementation"});
}

// Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): gated DeltaNet blocks with every
// full_attention_interval-th block a gated full attention (q/k norms, RoPE on partial_rotary_factor
// of each head, head_dim 256 by default), zero-centred (1 + w) RMSNorms (hf_model.cpp), MoE with a
// sigmoid-gated shared expert. transformers' Qwen3NextConfig defaults where a key is absent.
void read_qwen3_next(ConfigReader& r, ModelConfig& c) {
  if (!r.has("head_dim")) c.head_size = 256;
  c.qk_norm = c.attn_output_gate = true;
  c.rope_fraction = r.get<float>("partial_rotary_factor", 0.25f);
  c.linear_interval = r.get<int64_t>("full_attention_interval", 4);
  LOOM_CHECK(c.linear_interval > 0, r.path(), ": full_attention_interval must be > 0, got ", c.linear_interval);
  c.linear_key_heads = r.get<int64_t>("linear_num_key_heads", 16);
  c.linear_value_heads = r.get<int64_t>("linear_num_value_heads", 32);
  c.linear_key_dim = r.get<int64_t>("linear_key_head_dim", 128);
  c.linear_value_dim = r.get<int64_t>("linear_value_head_dim", 128);
  c.linear_conv_taps = r.get<int64_t>("linear_conv_kernel_dim", 4);
  if (r.has("layer_types")) {
    const json list = r.get<json>("layer_types");
    LOOM_CHECK(list.is_array() && static_cast<int64_t>(list.size()) == c.n_layer, r.path(),
               ": layer_types must list num_hidden_layers = ", c.n_layer, " entries");
    for (int64_t i = 0; i < c.n_layer; ++i) {
      const json& v = list[static_cast<size_t>(i)];
      LOOM_CHECK(v == (c.linear_layer(i) ? "linear_attention" : "full_attention"), r.path(), ": layer_types = ",
                 list.dump(), " is not supported (Loom makes every full_attention_interval-th layer full attention, "
                 "layers N-1, 2N-1, ...; entry ", i, " is ", v.dump(), ")");
    }
  }
  r.require("use_sliding_window", false, false, "Qwen3-Next's sliding window is not implemented");
  r.ignore({"sliding_window", "max_window_layers"});
  c.moe_experts = r.get<int64_t>("num_experts", 512);
  if (c.moe_experts == 0) {
    r.ignore({"num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
              "shared_expert_intermediate_size", "output_router_logits", "router_aux_loss_coef"});
    return;
  }
  c.moe_top_k = r.get<int64_t>("num_experts_per_tok", 10);
  c.moe_d_ff = r.get<int64_t>("moe_intermediate_size", 512);
  c.moe_renorm = r.get<bool>("norm_topk_prob", true) && c.moe_top_k > 1;
  r.require("decoder_sparse_step", 1, 1, "every layer is an MoE layer in Loom's mapping");
  r.require("mlp_only_layers", json::array(), json::array(), "dense layers among MoE layers are not mapped");
  const int64_t shared = r.get<int64_t>("shared_expert_intermediate_size", 512);
  LOOM_CHECK(shared > 0 && c.moe_d_ff > 0 && shared % c.moe_d_ff == 0, r.path(), ": shared_expert_intermediate_size = ",
             shared, " must be a positive multiple of moe_intermediate_size = ", c.moe_d_ff,
             " (Loom's shared experts are moe_shared experts of that width)");
  c.moe_shared = shared / c.moe_d_ff;
  c.moe_shared_gate = true;
  r.ignore({"output_router_logits", "router_aux_loss_coef"});  // training: set model.moe_aux_alpha to train with it
}

// GPT-OSS (GptOssForCausalLM, model_type gpt_oss): attention with biases on q/k/v/o and a sink
// logit per head, layer_types alternating sliding and full attention (every N-th full: model.
// window_pattern; transformers' default when absent alternates from a sliding layer 0), MoE on
// every layer with a router bias, softmax over the top k logits (= Loom's renormalised softmax),
// experts with biases and the clamped SwiGLU (swiglu_limit must be 7), YaRN with truncate = false.
// The release's experts are MXFP4 (quantization_config.quant_method = mxfp4): dequantized on load
// (hf_model.cpp). transformers' GptOssConfig defaults where a key is absent.
void read_gpt_oss(ConfigReader& r, ModelConfig& c) {
  c.qkv_bias = c.attn_out_bias = r.get<bool>("attention_bias", true);
  c.attn_sinks = true;
  c.gate_activation = GateActivation::swiglu_oai;
  r.require("swiglu_limit", 7.0, 7.0, "the clamped SwiGLU's limit is fixed at 7 (GPT-OSS's released value)");
  c.moe_experts = r.get<int64_t>("num_local_experts", 128);
  c.moe_top_k = r.get<int64_t>("num_experts_per_tok", 4);
  LOOM_CHECK(!r.has("experts_per_token") || r.get<int64_t>("experts_per_token") == c.moe_top_k, r.path(),
             ": experts_per_token (", r.get<int64_t>("experts_per_token", 0), ") differs from num_experts_per_tok (",
             c.moe_top_k, ")");
  c.moe_d_ff = c.d_ff;
  c.moe_renorm = c.moe_top_k > 1;  // softmax over the top k logits
  c.moe_router_bias = c.moe_expert_bias = true;
  c.attn_window = r.get<int64_t>("sliding_window", 128);
  LOOM_CHECK(c.attn_window > 0, r.path(), ": sliding_window must be > 0, got ", c.attn_window);
  c.window_pattern = 2;
  read_window_layer_types(r, c);
  if (r.has("quantization_config")) {
    const json q = r.get<json>("quantization_config");
    LOOM_CHECK(q.is_object() && q.value("quant_method", "") == "mxfp4", r.path(), ": quantization_config ",
               q.dump(), " is not supported (the release's mxfp4 experts are)");
  }
  // The context the model was pre-trained with (YaRN's original_max_position_embeddings says it too).
  r.ignore({"initial_context_length", "output_router_logits", "router_aux_loss_coef"});
}

// Mixtral, Qwen3-MoE: every layer routes each token to num_experts_per_tok of E experts by the
// softmax of the router's logits (no shared experts, no groups); training-only keys ignored.
void read_softmax_moe(ConfigReader& r, ModelConfig& c, const char* experts_key) {
  c.moe_experts = r.get<int64_t>(experts_key);
  c.moe_top_k = r.get<int64_t>("num_experts_per_tok");
  r.ignore({"output_router_logits", "router_aux_loss_coef"});  // training: set model.moe_aux_alpha to train with it
}

ModelConfig llama_family_config(ConfigReader& r, HfFamily family) {
  ModelConfig c;
  // SmolLM3Config and Gemma3TextConfig tie by default (SmolLM3-3B omits the key)
  read_llama_common(r, c, false, family == HfFamily::smollm3 || family == HfFamily::gemma3_text,
                    family == HfFamily::gpt_oss);
  read_head_dim(r, c);
  switch (family) {
    case HfFamily::mistral:
    case HfFamily::mixtral: c.attn_window = r.get<int64_t>("sliding_window", 0); break;
    case HfFamily::qwen2:
    case HfFamily::qwen3:
    case HfFamily::qwen3_moe:
      // Qwen2: q/k/v biases; Qwen3: q/k norms instead. Their sliding window (only on layers past
      // max_window_layers) is off in the released models.
      c.qkv_bias = family == HfFamily::qwen2;
      c.qk_norm = family != HfFamily::qwen2;
      r.require("use_sliding_window", false, false, "Qwen's per-layer sliding window is not implemented");
      r.require("use_mrope", false, false, "Qwen2-VL's multimodal RoPE sections are not implemented");
      r.ignore({"sliding_window", "max_window_layers", "layer_types"});
      break;
    case HfFamily::phi3:
      // Phi-3's window (transformers masks keys j <= i - sliding_window, as Loom's attn_window);
      // the dropouts are training's; original_max_position_embeddings is LongRoPE's (refused above).
      c.attn_window = r.get<int64_t>("sliding_window", 0);
      r.require("partial_rotary_factor", 1.0, 1.0, "RoPE on a fraction of each head (Phi-4-mini) is not implemented");
      read_longrope_context(r, c);
      r.ignore({"embd_pdrop", "resid_pdrop", "original_max_position_embeddings"});
      break;
    case HfFamily::olmo2:  // Olmo2DecoderLayer: x + norm(attn(x)), h + norm(mlp(h)); q_norm over H hd, k_norm KV hd
      c.qk_norm = c.qk_norm_whole = c.post_norm = true;
      break;
    case HfFamily::gemma3_text: read_gemma3(r, c); break;
    case HfFamily::qwen3_next: read_qwen3_next(r, c); break;
    case HfFamily::gpt_oss: read_gpt_oss(r, c); break;
    case HfFamily::smollm3:
      read_nope_layers(r, c);
      r.require("use_sliding_window", false, false, "SmolLM3's sliding window is not implemented");
      r.ignore({"sliding_window", "max_window_layers", "layer_types"});
      break;
    default: break;
  }
  if (family == HfFamily::mixtral) {
    read_softmax_moe(r, c, "num_local_experts");
    r.require("router_jitter_noise", 0.0, 0.0, "router noise is a training choice Loom does not implement");
  } else if (family == HfFamily::qwen3_moe) {
    read_softmax_moe(r, c, "num_experts");
    c.moe_d_ff = r.get<int64_t>("moe_intermediate_size");
    c.moe_renorm = r.get<bool>("norm_topk_prob", false) && c.moe_top_k > 1;
    r.require("decoder_sparse_step", 1, 1, "every layer is an MoE layer in Loom's mapping");
    r.require("mlp_only_layers", json::array(), json::array(), "dense layers among MoE layers are not mapped");
  }
  return c;
}

// DeepSeek-V2 / V3: MLA attention, dense MLPs on the first first_k_dense_replace layers and
// MoE ones after, with n_shared_experts always-on experts fused into one MLP.
ModelConfig deepseek_config(ConfigReader& r, HfFamily family) {
  const bool v3 = family == HfFamily::deepseek_v3;
  ModelConfig c;
  read_llama_common(r, c, true);
  c.n_kv_head = c.n_head;  // MLA: num_key_value_heads carries no meaning
  read_int_keys(r, kDeepseekMlaKeys, c);
  c.mla_q_rank = r.get<int64_t>("q_lora_rank", 0);
  r.ignore({"head_dim"});  // transformers' DeepseekV3Config writes qk_rope_head_dim here
  r.require("rope_interleave", true, true, "the RoPE rows are permuted from DeepSeek's interleaved pairs on import");
  c.moe_experts = r.get<int64_t>("n_routed_experts", 0);
  if (c.moe_experts > 0) {
    c.moe_top_k = r.get<int64_t>("num_experts_per_tok");
    c.moe_d_ff = r.get<int64_t>("moe_intermediate_size");
    c.moe_shared = r.get<int64_t>("n_shared_experts", 0);
    c.moe_dense_layers = std::min(r.get<int64_t>("first_k_dense_replace", 0), c.n_layer);
    r.require("moe_layer_freq", 1, 1, "every layer after first_k_dense_replace is an MoE layer");
    const bool norm = r.get<bool>("norm_topk_prob", false) && c.moe_top_k > 1;
    const float scale = r.get<float>("routed_scaling_factor", 1.0f);
    c.moe_renorm = norm;
    // V2 scales the gates only when it does not renormalise them; V3 always.
    c.moe_route_scale = v3 || !norm ? scale : 1.0f;
    r.require("scoring_func", v3 ? "sigmoid" : "softmax", v3 ? "sigmoid" : "softmax",
              v3 ? "DeepSeek-V3 routes by sigmoid scores" : "DeepSeek-V2 routes by softmax scores");
    const int64_t groups = r.get<int64_t>("n_group", 1);
    if (v3) {
      r.require("topk_method", "noaux_tc", "noaux_tc", "V3's group-limited routing scores a group by its two best experts");
      c.moe_sigmoid = true;
      c.moe_groups = groups;
      c.moe_topk_groups = r.get<int64_t>("topk_group", 1);
    } else {
      const std::string method = r.get<std::string>("topk_method", "greedy");
      LOOM_CHECK(method == "greedy" || groups <= 1, r.path(), ": topk_method = '", method, "' with n_group = ", groups,
                 " is not supported (V2's group_limited_greedy scores a group by its best expert; Loom's groups "
                 "by their two best)");
      r.ignore({"topk_group"});
    }
  }
  r.ignore({"n_group", "topk_group", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
            "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "topk_method", "scoring_func",
            "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux", "num_key_value_heads"});
  // DeepSeek-V3's multi-token-prediction layers (model.layers.{n_layer + i}) are not part of the
  // next-token model; their tensors are skipped on import.
  r.ignore({"num_nextn_predict_layers"});
  return c;
}

// The transformers class of each family (config.json's "architectures"), in HfFamily's order.
const char* family_class(HfFamily f) {
  constexpr const char* kNames[] = {"GPT2LMHeadModel",    "LlamaForCausalLM",    "MistralForCausalLM",
                                    "Qwen2ForCausalLM",   "Qwen3ForCausalLM",    "MixtralForCausalLM",
                                    "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                                    "SmolLM3ForCausalLM",  "Phi3ForCausalLM",       "Olmo2ForCausalLM",
                                    "Gemma3ForCausalLM",  "Qwen3NextForCausalLM",  "GptOssForCausalLM"};
  return kNames[static_cast<int>(f)];
}

// Families whose real config.json Loom knows but whose arithmetic it does not implement yet: what
// each would need (nullptr: not one of them).
const char* unimplemented_family(const std::string& type) {
  static const std::map<std::string, const char*> kWhy = {
      {"gemma3", "Gemma 3's multimodal folder (vision tower and text_config): export its text model as gemma3_text "
                 "(Gemma3ForCausalLM)"},
      {"gemma2", "Gemma 2 needs (1 + w) RMSNorms before and after attention and MLP, GeGLU, logit soft-capping and "
                 "alternating sliding layers"},
      {"qwen2_moe", "Qwen2-MoE scales its shared expert by a sigmoid gate (shared_expert_gate), which Loom's MoE has not"},
  };
  const auto it = kWhy.find(type);
  return it == kWhy.end() ? nullptr : it->second;
}

}  // namespace

HfConfig read_hf_config(const std::string& path) {
  ConfigReader r(read_json_file(path), path);
  HfConfig out;
  const std::string type = r.get<std::string>("model_type");
  const std::optional<HfFamily> family = enum_from_name<HfFamily>(type);
  const char* missing = unimplemented_family(type);
  LOOM_CHECK(missing == nullptr, path, ": model_type '", type, "' is not supported yet: ", missing);
  LOOM_CHECK(family.has_value(), path, ": model_type '", type, "' is not supported yet (", enum_choices<HfFamily>(), ")");
  out.family = *family;
  ignore_common(r);
  switch (out.family) {
    case HfFamily::gpt2: out.model = gpt2_config(r); break;
    case HfFamily::deepseek_v2:
    case HfFamily::deepseek_v3: out.model = deepseek_config(r, out.family); break;
    default: out.model = llama_family_config(r, out.family);
  }
  r.finish();
  try {
    out.model.validate();
  } catch (const Error& e) {
    throw Error(str_cat(path, ": ", e.what()));
  }
  return out;
}

HfFamily hf_family_of(const ModelConfig& c) {
  const char* where = "export to a Hugging Face folder: ";
  if (c.arch == ARCH_GPT2) {
    LOOM_CHECK(!c.mla() && c.moe_experts == 0, where, "GPT-2 with MoE or MLA is no transformers family");
    return HfFamily::gpt2;
  }
  const bool moe = c.moe_experts > 0;
  if (c.mla()) {
    LOOM_CHECK(!c.qkv_bias && !c.qk_norm && c.attn_window == 0 && c.head_size == 0, where,
               "MLA (DeepSeek) with q/k/v biases, q/k norms, a window or a set head_size is no transformers family");
    LOOM_CHECK(!moe || c.moe_sigmoid || c.moe_groups == 1, where,
               "softmax routing with groups (DeepSeek-V2's group_limited_greedy) scores groups differently");
    LOOM_CHECK(!moe || c.moe_sigmoid || !c.moe_renorm || c.moe_route_scale == 1.0f, where,
               "DeepSeek-V2 does not scale renormalised gates (model.moe_route_scale must be 1)");
    return moe && c.moe_sigmoid ? HfFamily::deepseek_v3 : HfFamily::deepseek_v2;
  }
  if (c.attn_sinks || c.attn_out_bias || c.moe_router_bias || c.moe_expert_bias ||
      c.gate_activation == GateActivation::swiglu_oai) {
    LOOM_CHECK(c.attn_sinks && c.gate_activation == GateActivation::swiglu_oai && moe && c.moe_router_bias &&
                   c.moe_expert_bias && c.qkv_bias == c.attn_out_bias && !c.qk_norm && c.moe_shared == 0 &&
                   c.moe_dense_layers == 0 && !c.moe_sigmoid && c.moe_groups == 1 && c.moe_route_scale == 1.0f &&
                   c.moe_renorm == (c.moe_top_k > 1) && c.expert_ff() == c.d_ff && c.attn_window > 0 &&
                   c.window_pattern > 0 && c.rope_local_theta == 0.0f && c.linear_interval == 0 && !c.tie_embeddings &&
                   c.nope_interval == 0 && c.rope_fraction == 1.0f,
               where, "attention sinks, the clamped SwiGLU and biased routers and experts map to GPT-OSS, which has "
               "all of them with q/k/v/o biases alike, softmax top-k MoE on every layer (no shared experts) of "
               "width d_ff, interleaved windows with one RoPE, an untied head and no q/k norms");
    return HfFamily::gpt_oss;
  }
  if (c.linear_interval > 0 || c.attn_output_gate || c.moe_shared_gate || c.rope_fraction != 1.0f) {
    LOOM_CHECK(c.linear_interval > 0 && c.attn_output_gate && c.qk_norm && !c.qk_norm_whole && !c.qkv_bias &&
                   c.attn_window == 0 && c.nope_interval == 0 && !c.tie_embeddings && c.gate_activation == GateActivation::silu &&
                   c.embed_scale == 0.0f && (!moe || (c.moe_shared > 0 && c.moe_shared_gate && c.moe_dense_layers == 0 &&
                                                      !c.moe_sigmoid && c.moe_groups == 1 && c.moe_route_scale == 1.0f)),
               where, "linear attention, gated attention, a shared-expert gate or partial RoPE map to Qwen3-Next, which "
               "has linear-attention blocks, gated attention with per-head q/k norms, an untied head and (with MoE) "
               "softmax routing on every layer with gated shared experts");
    return HfFamily::qwen3_next;
  }
  if (c.sandwich_norm || c.gate_activation != GateActivation::silu || c.embed_scale > 0.0f || c.window_pattern > 0) {
    const bool global_rope = c.rope_scaling == ROPE_SCALING_NONE || c.rope_scaling == ROPE_SCALING_LINEAR;
    LOOM_CHECK(c.sandwich_norm && c.qk_norm && !c.qk_norm_whole && c.gate_activation == GateActivation::gelu_tanh &&
                   c.embed_scale == std::sqrt(static_cast<float>(c.d_model)) && c.tie_embeddings && !moe &&
                   !c.qkv_bias && c.nope_interval == 0 && c.attn_window > 0 && c.window_pattern > 0 &&
                   c.rope_local_theta > 0.0f && global_rope,
               where, "sandwich norms, GeGLU, a scaled embedding and interleaved windows map to Gemma 3, which has all "
               "of them with per-head q/k norms, embed_scale = sqrt(d_model), rope_local_theta, a tied head and no "
               "MoE, q/k/v biases or NoPE layers");
    return HfFamily::gemma3_text;
  }
  if (c.post_norm || c.qk_norm_whole) {
    LOOM_CHECK(c.post_norm && c.qk_norm && c.qk_norm_whole && !moe && !c.qkv_bias && c.attn_window == 0 &&
                   c.nope_interval == 0,
               where, "post-norms and whole-width q/k norms map to OLMo 2, which has both and no MoE, q/k/v biases, "
               "window or NoPE layers");
    return HfFamily::olmo2;
  }
  if (c.rope_scaling == ROPE_SCALING_LONGROPE) {
    const double s = static_cast<double>(c.max_seq_len) / static_cast<double>(c.rope_original_context);
    const double derived = s <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(s) / std::log(static_cast<double>(c.rope_original_context)));
    LOOM_CHECK(!moe && !c.qkv_bias && !c.qk_norm && c.nope_interval == 0 &&
                   c.rope_attention_factor == static_cast<float>(derived),
               where, "LongRoPE maps to Phi-3, which has no MoE, q/k/v biases, q/k norms or NoPE layers and derives "
               "the attention factor from max_seq_len / rope_original_context (", derived, ", model has ",
               c.rope_attention_factor, ")");
    return HfFamily::phi3;
  }
  if (c.nope_interval > 0) {
    LOOM_CHECK(!moe && !c.qkv_bias && !c.qk_norm && c.attn_window == 0, where, "NoPE layers (model.nope_interval, "
               "SmolLM3) with MoE, q/k/v biases, q/k norms or a sliding window are no transformers family");
    return HfFamily::smollm3;
  }
  if (moe) {
    LOOM_CHECK(c.moe_shared == 0 && c.moe_dense_layers == 0 && !c.moe_sigmoid && c.moe_groups == 1 &&
                   c.moe_route_scale == 1.0f && !c.qkv_bias,
               where, "an MoE model without MLA maps to Mixtral or Qwen3-MoE: softmax top-k routing over every layer, "
               "no shared experts, groups, route scale or q/k/v biases");
    if (c.qk_norm) {
      LOOM_CHECK(c.attn_window == 0, where, "Qwen3-MoE has no sliding window here");
      return HfFamily::qwen3_moe;
    }
    LOOM_CHECK(c.moe_renorm, where, "Mixtral renormalises its gates (model.moe_renorm must be true)");
    return HfFamily::mixtral;
  }
  const bool mistral = c.attn_window > 0;
  LOOM_CHECK(int(mistral) + int(c.qkv_bias) + int(c.qk_norm) <= 1, where, "a sliding window, q/k/v biases and q/k "
             "norms (Mistral, Qwen2, Qwen3) together are no transformers family");
  return c.qk_norm ? HfFamily::qwen3 : c.qkv_bias ? HfFamily::qwen2 : mistral ? HfFamily::mistral : HfFamily::llama;
}

json hf_config_json(const ModelConfig& c) {
  const HfFamily f = hf_family_of(c);
  json j = {{"architectures", {family_class(f)}}, {"model_type", std::string(enum_name(f))}};
  if (f == HfFamily::gpt2) {
    j.update({{"n_ctx", c.max_seq_len}, {"n_inner", c.d_ff}, {"layer_norm_epsilon", shortest_decimal(c.norm_eps)},
              {"activation_function", "gelu_new"}, {"initializer_range", shortest_decimal(c.init_std)}, {"tie_word_embeddings", true}});
    write_int_keys(j, kGpt2Keys, c);
    j["torch_dtype"] = "float32";
    return j;
  }
  j.update({{"num_key_value_heads", c.n_kv_head}, {"rms_norm_eps", shortest_decimal(c.norm_eps)},
            {"rope_theta", shortest_decimal(c.rope_theta)}, {"initializer_range", shortest_decimal(c.init_std)},
            {"tie_word_embeddings", c.tie_embeddings}});
  if (f != HfFamily::gemma3_text) j["hidden_act"] = "silu";
  write_int_keys(j, kLlamaKeys, c);
  if (c.rope_scaling != ROPE_SCALING_NONE) j["rope_scaling"] = rope_scaling_json(c);
  if (c.mla() && c.mla_score_scale != 1.0f) {  // DeepSeek's YaRN: the score scale as mscale_all_dim
    LOOM_CHECK(c.rope_scaling == ROPE_SCALING_YARN && c.rope_factor > 1.0f, "export to a Hugging Face folder: "
               "model.mla_score_scale != 1 is written as rope_scaling.mscale_all_dim, which needs rope_scaling = yarn "
               "with rope_factor > 1");
    j["rope_scaling"]["mscale_all_dim"] = (std::sqrt(static_cast<double>(c.mla_score_scale)) - 1.0) /
                                          (0.1 * std::log(static_cast<double>(c.rope_factor)));
  }
  if (c.attn_window > 0) j["sliding_window"] = c.attn_window;
  switch (f) {
    case HfFamily::mixtral:
      j.update({{"num_local_experts", c.moe_experts}, {"num_experts_per_tok", c.moe_top_k}});
      break;
    case HfFamily::qwen3_moe:
      j.update({{"num_experts", c.moe_experts}, {"num_experts_per_tok", c.moe_top_k}, {"moe_intermediate_size", c.expert_ff()},
                {"norm_topk_prob", c.moe_renorm}});
      break;
    case HfFamily::phi3:
      j["original_max_position_embeddings"] = c.rope_original_context;
      break;
    case HfFamily::gemma3_text: {
      json types = json::array();
      for (int64_t i = 0; i < c.n_layer; ++i) types.push_back(c.layer_window(i) > 0 ? "sliding_attention" : "full_attention");
      j.update({{"hidden_activation", "gelu_pytorch_tanh"}, {"query_pre_attn_scalar", c.head_dim()},
                {"sliding_window_pattern", c.window_pattern}, {"layer_types", types},
                {"rope_local_base_freq", shortest_decimal(c.rope_local_theta)}, {"final_logit_softcapping", nullptr},
                {"attn_logit_softcapping", nullptr}, {"attention_bias", false}});
      break;
    }
    case HfFamily::qwen3_next: {
      json types = json::array();
      for (int64_t i = 0; i < c.n_layer; ++i) types.push_back(c.linear_layer(i) ? "linear_attention" : "full_attention");
      j.update({{"full_attention_interval", c.linear_interval}, {"layer_types", types},
                {"linear_num_key_heads", c.linear_key_heads}, {"linear_num_value_heads", c.linear_value_heads},
                {"linear_key_head_dim", c.linear_key_dim}, {"linear_value_head_dim", c.linear_value_dim},
                {"linear_conv_kernel_dim", c.linear_conv_taps}, {"partial_rotary_factor", shortest_decimal(c.rope_fraction)},
                {"use_sliding_window", false}, {"num_experts", c.moe_experts}, {"decoder_sparse_step", 1},
                {"mlp_only_layers", json::array()}});
      if (c.moe_experts > 0) {
        j.update({{"num_experts_per_tok", c.moe_top_k}, {"moe_intermediate_size", c.expert_ff()},
                  {"shared_expert_intermediate_size", c.moe_shared * c.expert_ff()}, {"norm_topk_prob", c.moe_renorm}});
      }
      break;
    }
    case HfFamily::gpt_oss: {
      json types = json::array();
      for (int64_t i = 0; i < c.n_layer; ++i) types.push_back(c.layer_window(i) > 0 ? "sliding_attention" : "full_attention");
      j.update({{"attention_bias", c.qkv_bias}, {"layer_types", types}, {"num_local_experts", c.moe_experts},
                {"num_experts_per_tok", c.moe_top_k}, {"experts_per_token", c.moe_top_k}, {"swiglu_limit", 7.0},
                {"initial_context_length", c.rope_scaling == ROPE_SCALING_YARN ? c.rope_original_context : c.max_seq_len}});
      break;
    }
    case HfFamily::smollm3: {
      json list = json::array();
      for (int64_t i = 0; i < c.n_layer; ++i) list.push_back(c.rope_layer(i) ? 1 : 0);
      j.update({{"no_rope_layer_interval", c.nope_interval}, {"no_rope_layers", list}, {"use_sliding_window", false}});
      break;
    }
    case HfFamily::deepseek_v2:
    case HfFamily::deepseek_v3:
      write_int_keys(j, kDeepseekMlaKeys, c);
      j["qk_nope_head_dim"] = c.mla_nope();
      j["v_head_dim"] = c.mla_v();
      j["q_lora_rank"] = c.mla_q_rank > 0 ? json(c.mla_q_rank) : json();
      if (c.moe_experts > 0) {
        j.update({{"n_routed_experts", c.moe_experts}, {"num_experts_per_tok", c.moe_top_k},
                  {"moe_intermediate_size", c.expert_ff()}, {"n_shared_experts", c.moe_shared},
                  {"first_k_dense_replace", c.moe_dense_layers}, {"moe_layer_freq", 1},
                  {"norm_topk_prob", c.moe_renorm}, {"routed_scaling_factor", shortest_decimal(c.moe_route_scale)},
                  {"scoring_func", c.moe_sigmoid ? "sigmoid" : "softmax"},
                  {"topk_method", c.moe_sigmoid ? "noaux_tc" : "greedy"}, {"n_group", c.moe_groups},
                  {"topk_group", c.moe_topk_groups}});
      }
      break;
    default: break;
  }
  if (f != HfFamily::mixtral && f != HfFamily::deepseek_v2 && f != HfFamily::deepseek_v3) j["head_dim"] = c.head_dim();
  j["torch_dtype"] = "float32";
  return j;
}

}  // namespace loom
