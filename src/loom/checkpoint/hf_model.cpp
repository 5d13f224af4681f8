#include "loom/checkpoint/hf_model.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/json_file.h"

namespace loom {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kConfigFile = "config.json";
constexpr const char* kWeightsFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// config.json, read key by key: every key must be mapped, known to carry no meaning for the
// weights' arithmetic (metadata, dropout, initialisation), or refused by name.
class ConfigReader {
 public:
  ConfigReader(json j, std::string path) : j_(std::move(j)), path_(std::move(path)) {
    LOOM_CHECK(j_.is_object(), path_, ": expected a JSON object");
  }
  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }
  template <class T>
  T get(const std::string& key) {
    used_.insert(key);
    LOOM_CHECK(has(key), path_, ": key '", key, "' is missing");
    try {
      return j_[key].get<T>();
    } catch (const json::exception&) {
      throw Error(str_cat(path_, ": key '", key, "' has the wrong type (", j_[key].dump(), ")"));
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
            "max_length", "do_sample", "temperature", "top_p", "top_k", "use_return_dict"});
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

enum class LlamaFamily { llama, mistral, qwen2 };

ModelConfig llama_config(ConfigReader& r, LlamaFamily family) {
  ModelConfig c;
  c.arch = ARCH_LLAMA;
  read_int_keys(r, kLlamaKeys, c);
  c.n_kv_head = r.get<int64_t>("num_key_value_heads", c.n_head);
  c.norm_eps = r.get<float>("rms_norm_eps", 1e-6f);
  c.rope_theta = r.get<float>("rope_theta", 10000.0f);
  c.init_std = r.get<float>("initializer_range", 0.02f);
  LOOM_CHECK(c.n_head > 0, "config.json: num_attention_heads must be > 0");
  const int64_t head_dim = r.get<int64_t>("head_dim", c.d_model / c.n_head);
  if (head_dim != c.d_model / c.n_head) c.head_size = head_dim;
  if (family == LlamaFamily::mistral) c.attn_window = r.get<int64_t>("sliding_window", 0);
  c.tie_embeddings = r.get<bool>("tie_word_embeddings", false);
  if (family == LlamaFamily::qwen2) {  // Qwen2: q/k/v biases; its sliding window only on layers past max_window_layers
    c.qkv_bias = true;
    r.require("use_sliding_window", false, false, "Qwen2's per-layer sliding window is not implemented");
    r.ignore({"sliding_window", "max_window_layers"});
  }
  r.require("hidden_act", "silu", "silu", "Loom's SwiGLU gates with SiLU");
  r.require("attention_bias", false, false, "an output-projection bias (o_proj) is not implemented for llama");
  r.require("mlp_bias", false, false, "MLP biases are not implemented for llama yet");
  r.require("rope_scaling", json(), json(), "RoPE scaling (llama3, linear, yarn) is not implemented yet");
  r.require("pretraining_tp", 1, 1, "tensor-parallel slicing of the MLP at pretraining changes its arithmetic");
  r.ignore({"attention_dropout"});
  return c;
}

// Where a Loom parameter's rows come from: tensors of the folder, stacked along rows.
struct Piece {
  std::string name;  // transformers' name (without a "transformer." prefix)
  int64_t rows = 0;  // rows of the Loom parameter it fills
};

std::vector<Piece> pieces_of(const ModelConfig& c, const ParamSpec& spec) {
  const std::string& n = spec.name;
  auto ends_with = [&n](const std::string& s) { return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0; };
  // "....self_attn" of "....self_attn.qkv_proj.weight": the name less its last two components.
  const size_t last = n.rfind('.');
  const std::string stem = last == std::string::npos || last == 0 ? n : n.substr(0, n.rfind('.', last - 1));
  if (c.arch == ARCH_LLAMA && ends_with(".self_attn.qkv_proj.weight")) {
    const int64_t q = c.n_head * c.head_dim(), kv = c.n_kv_head * c.head_dim();
    return {{stem + ".q_proj.weight", q}, {stem + ".k_proj.weight", kv}, {stem + ".v_proj.weight", kv}};
  }
  if (c.arch == ARCH_LLAMA && ends_with(".self_attn.qkv_proj.bias")) {
    const int64_t q = c.n_head * c.head_dim(), kv = c.n_kv_head * c.head_dim();
    return {{stem + ".q_proj.bias", q}, {stem + ".k_proj.bias", kv}, {stem + ".v_proj.bias", kv}};
  }
  if (c.arch == ARCH_LLAMA && ends_with(".mlp.gate_up_proj.weight")) {
    return {{stem + ".gate_proj.weight", c.d_ff}, {stem + ".up_proj.weight", c.d_ff}};
  }
  return {{n, spec.shape.empty() ? 1 : spec.shape[0]}};
}

// The folder's tensors by name, from model.safetensors or the shards its index names.
class HfTensors {
 public:
  explicit HfTensors(const fs::path& dir) {
    if (fs::is_regular_file(dir / kWeightsFile)) {
      add_file(dir / kWeightsFile);
      return;
    }
    const fs::path index = dir / kIndexFile;
    const json j = read_json_file(index.string());
    LOOM_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), index.string(), ": key 'weight_map' is missing");
    std::map<std::string, std::string> expected;  // tensor -> shard
    for (const auto& [name, file] : j["weight_map"].items()) {
      LOOM_CHECK(file.is_string(), index.string(), ": weight_map['", name, "'] is not a file name");
      const std::string f = file.get<std::string>();
      LOOM_CHECK(f.find('/') == std::string::npos && f.find("..") == std::string::npos, index.string(),
                 ": weight_map['", name, "'] = '", f, "' is not a file of the folder");
      expected[name] = f;
      if (!opened_.count(f)) add_file(dir / f), opened_.insert(f);
    }
    for (const auto& [name, file] : expected) {
      LOOM_CHECK(where_.count(name) && where_.at(name)->path() == (dir / file).string(), index.string(), ": tensor '",
                 name, "' is not in ", file);
    }
  }
  // The file holding `name` (with or without a "transformer." prefix), or nullptr.
  const SafetensorsFile* find(const std::string& name, std::string* stored) const {
    for (const std::string& candidate : {name, "transformer." + name}) {
      if (auto it = where_.find(candidate); it != where_.end()) {
        *stored = candidate;
        return it->second;
      }
    }
    return nullptr;
  }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, file] : where_) out.push_back(name);
    return out;
  }
  std::string describe() const { return files_.size() == 1 ? files_[0]->path() : "the folder's safetensors shards"; }

 private:
  void add_file(const fs::path& path) {
    files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::read(path.string())));
    for (const std::string& name : files_.back()->names()) {
      LOOM_CHECK(!where_.count(name), path.string(), ": tensor '", name, "' also appears in ", where_[name]->path());
      where_[name] = files_.back().get();
    }
  }
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
  std::set<std::string> opened_;
};

// Tensors the folder may hold that are not parameters: attention-mask and RoPE buffers.
bool is_buffer(const std::string& name) {
  for (const char* suffix : {".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq"}) {
    const std::string s(suffix);
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

// The shape a piece has in the folder: its rows of a parameter of `cols` columns (a vector:
// its rows alone), transposed for a GPT-2 Conv1D weight.
Shape piece_shape(const Piece& piece, const ParamSpec& spec, bool transpose) {
  if (spec.shape.size() == 1) return {piece.rows};
  return transpose ? Shape{spec.shape[1], piece.rows} : Shape{piece.rows, spec.shape[1]};
}

// Copies `piece` (f32 after widening) into rows [row, row + piece.rows) of dst (rows x cols),
// transposing a GPT-2 Conv1D weight.
void copy_piece(const HfTensors& files, const Piece& piece, const ParamSpec& spec, const Tensor& dst, int64_t row,
                std::set<std::string>& used) {
  const bool transpose = is_gpt2_conv1d_weight(spec.name);
  const int64_t cols = spec.shape.size() == 2 ? spec.shape[1] : 1;
  std::string stored;
  const SafetensorsFile* file = files.find(piece.name, &stored);
  LOOM_CHECK(file != nullptr, files.describe(), ": tensor '", piece.name, "' is missing");
  const Shape want = piece_shape(piece, spec, transpose);
  LOOM_CHECK(file->shape(stored) == want, file->path(), ": tensor '", stored, "' has shape ",
             shape_str(file->shape(stored)), ", expected ", shape_str(want));
  CpuAllocator host;
  const Tensor tmp = Tensor::empty(host, want, DTYPE_F32, MEM_WORKSPACE);
  file->copy_as_f32(stored, tmp);
  float* out = dst.data<float>() + row * cols;
  const float* in = tmp.data<float>();
  if (transpose) transpose_into(in, out, cols, piece.rows);  // (in, out) -> Loom's (out, in)
  else std::memcpy(out, in, static_cast<size_t>(piece.rows * cols) * sizeof(float));
  used.insert(stored);
}

// A tied head is the token embedding: an lm_head.weight in the folder must be that same matrix.
void check_tied_head(const HfTensors& files, const Tensor& wte, std::set<std::string>& used) {
  std::string stored;
  const SafetensorsFile* file = files.find("lm_head.weight", &stored);
  if (file == nullptr) return;
  LOOM_CHECK(file->shape(stored) == wte.shape(), file->path(), ": tensor 'lm_head.weight' has shape ",
             shape_str(file->shape(stored)), ", expected ", shape_str(wte.shape()));
  CpuAllocator host;
  const Tensor head = Tensor::empty(host, wte.shape(), DTYPE_F32, MEM_WORKSPACE);
  file->copy_as_f32(stored, head);
  LOOM_CHECK(std::memcmp(head.data<float>(), wte.data<float>(), static_cast<size_t>(wte.numel()) * sizeof(float)) == 0,
             file->path(), ": 'lm_head.weight' differs from the token embedding, but the model ties its head to it "
             "(tie_word_embeddings)");
  used.insert(stored);
}

json hf_config_json(const ModelConfig& c) {
  json j;
  if (c.arch == ARCH_GPT2) {
    j = {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"n_ctx", c.max_seq_len},
         {"n_inner", c.d_ff}, {"layer_norm_epsilon", c.norm_eps}, {"activation_function", "gelu_new"},
         {"initializer_range", c.init_std}, {"tie_word_embeddings", true}};
    write_int_keys(j, kGpt2Keys, c);
  } else {
    const bool mistral = c.attn_window > 0, qwen2 = c.qkv_bias;
    LOOM_CHECK(!(mistral && qwen2), "export to a Hugging Face folder: q/k/v biases with a sliding window (Qwen2 with "
               "use_sliding_window) are not mapped");
    const char* type = qwen2 ? "qwen2" : mistral ? "mistral" : "llama";
    const char* cls = qwen2 ? "Qwen2ForCausalLM" : mistral ? "MistralForCausalLM" : "LlamaForCausalLM";
    j = {{"architectures", {cls}}, {"model_type", type}, {"num_key_value_heads", c.n_kv_head},
         {"head_dim", c.head_dim()}, {"rms_norm_eps", c.norm_eps}, {"rope_theta", c.rope_theta},
         {"hidden_act", "silu"}, {"initializer_range", c.init_std}, {"tie_word_embeddings", c.tie_embeddings}};
    write_int_keys(j, kLlamaKeys, c);
    if (mistral) j["sliding_window"] = c.attn_window;
  }
  j["torch_dtype"] = "float32";
  return j;
}

void check_exportable(const ModelConfig& c) {
  LOOM_CHECK(!c.mla() && c.moe_experts == 0, "export to a Hugging Face folder: MLA and mixture-of-experts models "
             "are not mapped yet (model.mla_kv_rank / model.moe_experts)");
}

}  // namespace

bool is_hf_model_dir(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  return fs::is_regular_file(d / kConfigFile, ec) &&
         (fs::is_regular_file(d / kWeightsFile, ec) || fs::is_regular_file(d / kIndexFile, ec));
}

ModelConfig hf_model_config(const std::string& dir) {
  const fs::path path = fs::path(dir) / kConfigFile;
  ConfigReader r(read_json_file(path.string()), path.string());
  const std::string type = r.get<std::string>("model_type");
  ignore_common(r);
  ModelConfig c;
  if (type == "gpt2") c = gpt2_config(r);
  else if (type == "llama") c = llama_config(r, LlamaFamily::llama);
  else if (type == "mistral") c = llama_config(r, LlamaFamily::mistral);
  else if (type == "qwen2") c = llama_config(r, LlamaFamily::qwen2);
  else throw Error(str_cat(path.string(), ": model_type '", type, "' is not supported yet (gpt2, llama, mistral, qwen2)"));
  r.finish();
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(str_cat(path.string(), ": ", e.what()));
  }
  return c;
}

void load_hf_weights(const std::string& dir, const ModelState& model) {
  const ModelConfig& c = model.config;
  check_exportable(c);
  const ParamLayout layout = build_param_layout(c);
  LOOM_CHECK(model.params.numel() == layout.total, "load_hf_weights: a parameter buffer of ", model.params.numel(),
             " floats for a model of ", layout.total);
  const HfTensors files{fs::path(dir)};
  std::set<std::string> used;
  for (const ParamSpec& spec : layout.params) {
    const Tensor dst = model.params.view(spec.offset, spec.shape);
    int64_t row = 0;
    for (const Piece& piece : pieces_of(c, spec)) {
      copy_piece(files, piece, spec, dst, row, used);
      row += piece.rows;
    }
  }
  if (c.tied_head()) {
    const ParamSpec& embedding = layout.find(embedding_param_name(c));
    check_tied_head(files, model.params.view(embedding.offset, embedding.shape), used);
  }
  for (const std::string& name : files.names()) {
    LOOM_CHECK(used.count(name) || is_buffer(name), files.describe(), ": tensor '", name, "' is not a parameter of a ",
               arch_name(c.arch), " model with this config.json");
  }
}

void save_hf_model(const std::string& dir, const ModelState& model) {
  const ModelConfig& c = model.config;
  check_exportable(c);
  const ParamLayout layout = build_param_layout(c);
  CpuAllocator host;
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const ParamSpec& spec : layout.params) {
    const Tensor src = model.params.view(spec.offset, spec.shape);
    const int64_t cols = spec.shape.size() == 2 ? spec.shape[1] : 1;
    const bool transpose = is_gpt2_conv1d_weight(spec.name);
    int64_t row = 0;
    for (const Piece& piece : pieces_of(c, spec)) {
      Tensor t = Tensor::empty(host, piece_shape(piece, spec, transpose), DTYPE_F32, MEM_WORKSPACE);
      const float* in = src.data<float>() + row * cols;
      float* out = t.data<float>();
      if (transpose) transpose_into(in, out, piece.rows, cols);  // Loom's (out, in) -> (in, out)
      else std::memcpy(out, in, static_cast<size_t>(piece.rows * cols) * sizeof(float));
      tensors.emplace_back(piece.name, std::move(t));
      row += piece.rows;
    }
  }
  fs::create_directories(dir);
  write_safetensors((fs::path(dir) / kWeightsFile).string(), tensors, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / kConfigFile).string(), hf_config_json(c).dump(2) + "\n");
}

}  // namespace loom
