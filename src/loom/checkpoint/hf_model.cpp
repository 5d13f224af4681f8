#include "loom/checkpoint/hf_model.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/hf_config.h"
#include "loom/checkpoint/hf_gpt_oss.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/dtype.h"
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

// Where a Loom parameter's rows come from: tensors of the folder, stacked along rows.
struct Piece {
  Piece(std::string n, int64_t r, std::vector<std::pair<int64_t, int64_t>> rs = {}, Shape sh = {})
      : name(std::move(n)), rows(r), runs(std::move(rs)), shape(std::move(sh)) {}
  std::string name;  // transformers' name (without a "transformer." prefix)
  int64_t rows = 0;  // rows of the Loom parameter it fills
  // A piece of rows gathered from the folder's tensor (Qwen3-Next's interleaved heads and groups):
  // its rows are the runs (first folder row, count) in order, of a folder tensor of `shape`; empty:
  // the whole tensor, of the rows' shape.
  std::vector<std::pair<int64_t, int64_t>> runs;
  Shape shape;
  // GPT-OSS: one expert's part of a fused (or MXFP4) folder tensor (checkpoint/hf_gpt_oss.h).
  std::optional<GptOssExpertRef> expert;
};


bool ends_with(const std::string& n, const std::string& s) {
  return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
}

// Qwen3-Next's folder layouts (transformers' Qwen3NextAttention / Qwen3NextGatedDeltaNet): q_proj
// holds per head [query d | gate d] (Loom: the queries in qkv_proj, the gates in gate_proj);
// in_proj_qkvz per key head g [q d_k | k d_k | v r d_v | z r d_v] and in_proj_ba [b r | a r]
// (r = value heads per key head; Loom: [q | k | v | z] and [b | a]); conv1d.weight (C, 1, K).
std::vector<Piece> qwen3_next_pieces(const ModelConfig& c, const std::string& n, const std::string& stem, int64_t rows,
                                     const ParamSpec& spec) {
  const auto strided = [](int64_t groups, int64_t stride, int64_t offset, int64_t count) {
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (int64_t g = 0; g < groups; ++g) runs.push_back({g * stride + offset, count});
    return runs;
  };
  const int64_t H = c.n_head, d = c.head_dim(), kv = c.n_kv_head * d, C = c.d_model;
  const Shape q_shape{2 * H * d, C};
  if (ends_with(n, ".self_attn.qkv_proj.weight")) {
    return {{stem + ".q_proj.weight", H * d, strided(H, 2 * d, 0, d), q_shape}, {stem + ".k_proj.weight", kv},
            {stem + ".v_proj.weight", kv}};
  }
  if (ends_with(n, ".self_attn.gate_proj.weight")) return {{stem + ".q_proj.weight", H * d, strided(H, 2 * d, d, d), q_shape}};
  const int64_t nk = c.linear_key_heads, r = c.linear_value_heads / nk, dk = c.linear_key_dim, dv = c.linear_value_dim;
  if (ends_with(n, ".linear_attn.in_proj_qkvz.weight")) {
    const int64_t G = 2 * dk + 2 * r * dv;
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (const auto& [offset, count] : {std::pair{0 * dk, dk}, {dk, dk}, {2 * dk, r * dv}, {2 * dk + r * dv, r * dv}}) {
      const auto part = strided(nk, G, offset, count);
      runs.insert(runs.end(), part.begin(), part.end());
    }
    return {{n, rows, runs, Shape{nk * G, C}}};
  }
  if (ends_with(n, ".linear_attn.in_proj_ba.weight")) {
    std::vector<std::pair<int64_t, int64_t>> runs = strided(nk, 2 * r, 0, r), a = strided(nk, 2 * r, r, r);
    runs.insert(runs.end(), a.begin(), a.end());
    return {{n, rows, runs, Shape{2 * nk * r, C}}};
  }
  if (ends_with(n, ".linear_attn.conv1d.weight")) return {{n, rows, {{0, rows}}, Shape{rows, 1, spec.shape[1]}}};
  const size_t shared = n.find(".mlp.shared_experts.");
  if (shared != std::string::npos) {
    const std::string base = n.substr(0, shared) + ".mlp.shared_expert.";
    if (ends_with(n, ".gate_up_proj.weight")) return {{base + "gate_proj.weight", rows / 2}, {base + "up_proj.weight", rows / 2}};
    return {{base + "down_proj.weight", rows}};
  }
  return {};
}

// The transformers tensors of a Loom parameter. Loom fuses q/k/v (rows q, k, v) and each SwiGLU
// MLP's gate/up (rows gate, up), as Phi-3 stores them (its gate_up_proj's first half gates); Mixtral names its MoE "block_sparse_moe" with experts' w1 (gate),
// w3 (up), w2 (down). Only DeepSeek-V3 stores the routing bias (elsewhere it has no pieces and
// stays zero).
std::vector<Piece> pieces_of(const ModelConfig& c, HfFamily family, const ParamSpec& spec) {
  const std::string& n = spec.name;
  // "....self_attn" of "....self_attn.qkv_proj.weight": the name less its last two components.
  const size_t last = n.rfind('.');
  const std::string stem = last == std::string::npos || last == 0 ? n : n.substr(0, n.rfind('.', last - 1));
  const int64_t rows = spec.shape.empty() ? 1 : spec.shape[0];
  if (c.arch != ARCH_LLAMA) return {{n, rows}};
  const int64_t q = c.n_head * c.head_dim(), kv = c.n_kv_head * c.head_dim();
  // Phi-3 stores qkv_proj and gate_up_proj fused, rows as Loom's: every tensor under its own name.
  if (family == HfFamily::phi3) return {{n, rows}};
  if (family == HfFamily::qwen3_next) {
    if (std::vector<Piece> p = qwen3_next_pieces(c, n, stem, rows, spec); !p.empty()) return p;
  }
  if (family == HfFamily::gpt_oss) {  // the router is mlp.router; the experts fused (hf_gpt_oss.h)
    if (const std::optional<GptOssExpertRef> ref = gpt_oss_expert_ref(n)) {
      Piece p(ref->folder, rows, {}, gpt_oss_folder_shape(c, ref->part));
      p.expert = ref;
      return {p};
    }
    if (ends_with(n, ".mlp.gate.weight")) return {{stem + ".router.weight", rows}};
    if (ends_with(n, ".mlp.gate.bias")) return {{stem + ".router.bias", rows}};
  }
  if (ends_with(n, ".self_attn.qkv_proj.weight")) {
    return {{stem + ".q_proj.weight", q}, {stem + ".k_proj.weight", kv}, {stem + ".v_proj.weight", kv}};
  }
  if (ends_with(n, ".self_attn.qkv_proj.bias")) {
    return {{stem + ".q_proj.bias", q}, {stem + ".k_proj.bias", kv}, {stem + ".v_proj.bias", kv}};
  }
  if (ends_with(n, ".mlp.gate.e_score_correction_bias")) {
    if (family == HfFamily::deepseek_v3) return {{n, rows}};
    return {};
  }
  const size_t moe = n.find(".mlp.experts.");
  if (family == HfFamily::mixtral && (moe != std::string::npos || ends_with(n, ".mlp.gate.weight"))) {
    const std::string renamed = n.substr(0, n.find(".mlp.")) + ".block_sparse_moe." + n.substr(n.find(".mlp.") + 5);
    const std::string expert = renamed.substr(0, renamed.rfind('.', renamed.rfind('.') - 1));
    if (ends_with(n, ".gate_up_proj.weight")) return {{expert + ".w1.weight", rows / 2}, {expert + ".w3.weight", rows / 2}};
    if (ends_with(n, ".down_proj.weight")) return {{expert + ".w2.weight", rows}};
    return {{renamed, rows}};
  }
  if (ends_with(n, ".gate_up_proj.weight")) return {{stem + ".gate_proj.weight", rows / 2}, {stem + ".up_proj.weight", rows / 2}};
  return {{n, rows}};
}

// DeepSeek stores the RoPE part of its queries and of kv_a_proj_with_mqa's key in interleaved
// pairs (2i, 2i + 1); Loom rotates the halves (i, i + d_r/2), as transformers' DeepSeek code
// does after permuting. Row i of a d_r-wide RoPE block in Loom is row perm(i) in the folder,
// perm(i) = 2i for i < d_r/2, 2(i - d_r/2) + 1 after. Both q and k are permuted alike, so the
// scores are those of the folder. to_loom: the folder's order in, Loom's out (else back).
// The first row of each RoPE block of parameter `n` (empty: it has none).
std::vector<int64_t> deepseek_rope_starts(const ModelConfig& c, const std::string& n) {
  std::vector<int64_t> starts;
  if (ends_with(n, ".self_attn.q_proj.weight") || ends_with(n, ".self_attn.q_b_proj.weight")) {
    for (int64_t h = 0; h < c.n_head; ++h) starts.push_back(h * c.mla_qk() + c.mla_nope());
  } else if (ends_with(n, ".self_attn.kv_a_proj_with_mqa.weight")) {
    starts.push_back(c.mla_kv_rank);
  }
  return starts;
}

void permute_deepseek_rope_rows(const ModelConfig& c, const std::vector<int64_t>& starts, const Tensor& dst,
                                bool to_loom) {
  const int64_t dr = c.mla_rope_dim, cols = dst.ndim() == 2 ? dst.dim(1) : 1;
  float* data = dst.data<float>();
  std::vector<float> block(static_cast<size_t>(dr * cols));
  for (const int64_t first : starts) {
    float* rows = data + first * cols;
    std::memcpy(block.data(), rows, block.size() * sizeof(float));
    for (int64_t i = 0; i < dr; ++i) {
      const int64_t j = i < dr / 2 ? 2 * i : 2 * (i - dr / 2) + 1;
      const int64_t from = to_loom ? j : i, to = to_loom ? i : j;
      std::memcpy(rows + to * cols, block.data() + from * cols, static_cast<size_t>(cols) * sizeof(float));
    }
  }
}

bool deepseek(HfFamily f) { return f == HfFamily::deepseek_v2 || f == HfFamily::deepseek_v3; }

// Gemma's RMSNorms scale by (1 + w) (Gemma3RMSNorm: output * (1.0 + weight)): the folder keeps w,
// Loom's norms the factor 1 + w (as llama.cpp's GGUF does), added on import and taken off on export.
// (1 + w) - 1 is exact for factors in [0.5, 2] (Sterbenz), so a folder Loom wrote re-imports bitwise.
// Qwen3-Next's Qwen3NextRMSNorm is zero-centred the same way; its gated norm (linear_attn.norm,
// Qwen3NextRMSNormGated) scales by w.
bool unit_offset_norm(HfFamily f, const std::string& name) {
  if (f == HfFamily::qwen3_next) return ends_with(name, "norm.weight") && !ends_with(name, ".linear_attn.norm.weight");
  return f == HfFamily::gemma3_text && ends_with(name, "norm.weight");
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

// DeepSeek-V3's multi-token-prediction layers follow the model's layers (model.layers.{n_layer + i},
// num_nextn_predict_layers of them): not part of next-token prediction, not loaded.
bool is_extra_layer(const std::string& name, const ModelConfig& c, HfFamily family) {
  const std::string prefix = "model.layers.";
  if (family != HfFamily::deepseek_v3 || name.rfind(prefix, 0) != 0) return false;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos) return false;
  const std::string index = name.substr(prefix.size(), dot - prefix.size());
  return !index.empty() && index.size() < 10 && index.find_first_not_of("0123456789") == std::string::npos &&
         std::stoll(index) >= c.n_layer;
}

// The shape a piece has in the folder: its rows of a parameter of `cols` columns (a vector:
// its rows alone), transposed for a GPT-2 Conv1D weight.
Shape piece_shape(const Piece& piece, const ParamSpec& spec, bool transpose) {
  if (!piece.shape.empty()) return piece.shape;
  if (spec.shape.size() == 1) return {piece.rows};
  return transpose ? Shape{spec.shape[1], piece.rows} : Shape{piece.rows, spec.shape[1]};
}

// in (rows, cols) -> out (cols, rows).
template <typename T>
void transpose_elements(const T* in, T* out, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
}

// Copies `piece` into rows [row, row + piece.rows) of dst (rows x cols), transposing a GPT-2
// Conv1D weight: f32 after widening, or into a bf16 dst as stored (BF16 entries only).
void copy_piece(const HfTensors& files, const Piece& piece, const ParamSpec& spec, const Tensor& dst, int64_t row,
                std::set<std::string>& used) {
  const bool transpose = is_gpt2_conv1d_weight(spec.name), wide = dst.dtype() == DTYPE_F32;
  const int64_t cols = spec.shape.size() == 2 ? spec.shape[1] : 1;
  std::string stored;
  const SafetensorsFile* file = files.find(piece.name, &stored);
  LOOM_CHECK(file != nullptr, files.describe(), ": tensor '", piece.name, "' is missing");
  const Shape want = piece_shape(piece, spec, transpose);
  LOOM_CHECK(file->shape(stored) == want, file->path(), ": tensor '", stored, "' has shape ",
             shape_str(file->shape(stored)), ", expected ", shape_str(want));
  const Tensor rows = dst.view(row * cols, {piece.rows, cols});
  CpuAllocator host;
  const Tensor from = transpose || !piece.runs.empty() ? Tensor::empty(host, want, dst.dtype(), MEM_WORKSPACE) : rows;
  if (wide) file->copy_as_f32(stored, from);
  else file->copy_as_bf16(stored, from);
  int64_t at = 0;
  for (const auto& [first, count] : piece.runs) {  // the gathered rows, in order
    const size_t row_bytes = static_cast<size_t>(cols) * dtype_size(dst.dtype());
    std::memcpy(static_cast<char*>(rows.raw_data()) + at * row_bytes, static_cast<const char*>(from.raw_data()) + first * row_bytes,
                static_cast<size_t>(count) * row_bytes);
    at += count;
  }
  if (transpose && wide) transpose_elements(from.data<float>(), rows.data<float>(), cols, piece.rows);  // (in, out) -> (out, in)
  else if (transpose) transpose_elements(from.data<bf16>(), rows.data<bf16>(), cols, piece.rows);
  used.insert(stored);
}

// A tied head is the token embedding: an lm_head.weight in the folder must be that same matrix
// (wte: the loaded embedding, f32 or as stored in bf16).
void check_tied_head(const HfTensors& files, const Tensor& wte, std::set<std::string>& used) {
  std::string stored;
  const SafetensorsFile* file = files.find("lm_head.weight", &stored);
  if (file == nullptr) return;
  LOOM_CHECK(file->shape(stored) == wte.shape(), file->path(), ": tensor 'lm_head.weight' has shape ",
             shape_str(file->shape(stored)), ", expected ", shape_str(wte.shape()));
  const bool wide = wte.dtype() == DTYPE_F32;
  bool same = wide || file->stored_dtype(stored) == "BF16";
  if (same) {
    CpuAllocator host;
    const Tensor head = Tensor::empty(host, wte.shape(), wte.dtype(), MEM_WORKSPACE);
    if (wide) file->copy_as_f32(stored, head);
    else file->copy_as_bf16(stored, head);
    same = std::memcmp(head.raw_data(), wte.raw_data(), wte.nbytes()) == 0;
  }
  LOOM_CHECK(same, file->path(), ": 'lm_head.weight' differs from the token embedding, but the model ties its head to "
             "it (tie_word_embeddings)");
  used.insert(stored);
}

// The number N of a "<prefix>N." at the start of `name` (after any "transformer."), or -1.
int64_t index_after(const std::string& name, const std::string& prefix) {
  const size_t at = name.find(prefix);
  if (at == std::string::npos) return -1;
  const size_t first = at + prefix.size(), dot = name.find('.', first);
  if (dot == std::string::npos || dot == first || dot - first > 9) return -1;
  for (size_t i = first; i < dot; ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(first, dot - first));
}

// The first index with no tensor at all: the layers (or experts) 0..k-1 the files hold.
int64_t indices_held(const std::vector<std::string>& names, const std::function<int64_t(const std::string&)>& index) {
  std::set<int64_t> held;
  for (const std::string& name : names)
    if (const int64_t i = index(name); i >= 0) held.insert(i);
  int64_t k = 0;
  while (held.count(k)) ++k;
  return k;
}

int64_t layer_index(const std::string& name, const ModelConfig& c) {
  if (c.arch != ARCH_GPT2) return name.rfind("model.layers.", 0) == 0 ? index_after(name, "model.layers.") : -1;
  const std::string bare = name.rfind("transformer.", 0) == 0 ? name.substr(12) : name;
  return bare.rfind("h.", 0) == 0 ? index_after(bare, "h.") : -1;
}

int64_t expert_index(const std::string& name) { return index_after(name, ".experts."); }

const char* layers_key(HfFamily f) { return f == HfFamily::gpt2 ? "n_layer" : "num_hidden_layers"; }
const char* experts_key(HfFamily f) {
  return f == HfFamily::mixtral ? "num_local_experts" : f == HfFamily::qwen3_moe ? "num_experts" : "n_routed_experts";
}

FolderLookup lookup_in(const HfTensors& files) {
  return [&files](const std::string& name, std::string* stored) { return files.find(name, stored); };
}

// The folder's tensors against its config.json, before a model of that size is allocated: the
// layers and experts it says against those the files hold (a config's 10^9 layers over 2 layers'
// tensors is refused here, naming the first missing tensor, instead of allocating for them),
// then every parameter's tensors present with the shapes the config gives them.
void check_hf_tensors(const fs::path& dir, const HfConfig& hf, const HfTensors& files) {
  const ModelConfig& c = hf.model;
  const std::string config_path = (dir / kConfigFile).string();
  const std::vector<std::string> names = files.names();
  const int64_t layers = indices_held(names, [&](const std::string& n) { return layer_index(n, c); });
  // GPT-OSS fuses its experts (hf_gpt_oss.h): their count is the router's rows.
  const auto fused_experts = [&]() -> int64_t {
    std::string stored;
    const SafetensorsFile* f = files.find("model.layers.0.mlp.router.weight", &stored);
    return f != nullptr && f->shape(stored).size() == 2 ? f->shape(stored)[0] : 0;
  };
  const int64_t experts = c.moe_experts == 0 ? 0 : hf.family == HfFamily::gpt_oss ? fused_experts()
                                                                                   : indices_held(names, expert_index);
  // A config no larger than the files: the parameters are walked over it, in layout order.
  ModelConfig bounded = c;
  bounded.n_layer = std::min(c.n_layer, layers + 1);
  bounded.moe_dense_layers = std::min(c.moe_dense_layers, bounded.n_layer);
  if (c.moe_experts > 0) {
    bounded.moe_experts = std::min(c.moe_experts, experts + 1);
    bounded.moe_top_k = std::min(c.moe_top_k, bounded.moe_experts);
  }
  const ParamLayout layout = build_param_layout(bounded);
  // First the counts (a tensor of a layer or expert past those held), then every tensor.
  for (const bool counts : {true, false}) {
    for (const ParamSpec& spec : layout.params) {
      const bool transpose = is_gpt2_conv1d_weight(spec.name);
      for (const Piece& piece : pieces_of(c, hf.family, spec)) {
        std::string stored;
        if (piece.expert) {  // a fused GPT-OSS tensor (or its MXFP4 blocks and scales): shapes checked on read
          LOOM_CHECK(!gpt_oss_stored_names(lookup_in(files), *piece.expert).empty(), "tensor '", piece.name,
                     "' is missing from the safetensors files in ", dir.string());
          continue;
        }
        const SafetensorsFile* file = files.find(piece.name, &stored);
        if (counts) {
          if (file != nullptr) continue;
          const std::string missing = str_cat("tensor '", piece.name, "' is missing from the safetensors files in ",
                                              dir.string());
          LOOM_CHECK(layer_index(piece.name, c) < layers, missing, ", which hold ", layers, " layers; ", config_path,
                     " says ", layers_key(hf.family), " ", c.n_layer);
          LOOM_CHECK(expert_index(piece.name) < experts || c.moe_experts == 0, missing, ", which hold ", experts,
                     " experts per layer; ", config_path, " says ", experts_key(hf.family), " ", c.moe_experts);
          continue;
        }
        LOOM_CHECK(file != nullptr, files.describe(), ": tensor '", piece.name, "' is missing");
        const Shape want = piece_shape(piece, spec, transpose);
        LOOM_CHECK(file->shape(stored) == want, file->path(), ": tensor '", stored, "' has shape ",
                   shape_str(file->shape(stored)), ", expected ", shape_str(want), " (from ", config_path, ")");
      }
    }
  }
}

}  // namespace

bool is_hf_model_dir(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  return fs::is_regular_file(d / kConfigFile, ec) &&
         (fs::is_regular_file(d / kWeightsFile, ec) || fs::is_regular_file(d / kIndexFile, ec));
}

ModelConfig hf_model_config(const std::string& dir) {
  const HfConfig hf = read_hf_config((fs::path(dir) / kConfigFile).string());
  check_hf_tensors(fs::path(dir), hf, HfTensors{fs::path(dir)});
  return hf.model;
}

void load_hf_weights(const std::string& dir, const ModelState& model) { load_hf_weights(dir, model, {}); }

bool hf_stored_as_bf16(const std::string& dir, const ModelConfig& config, const std::vector<std::string>& names) {
  const HfWeightReader reader(dir, config);
  for (const std::string& name : names) {
    if (!reader.stored_as_bf16(name)) return false;
  }
  return true;
}

struct HfWeightReader::State {
  fs::path dir;
  ModelConfig config;
  HfFamily family;
  HfTensors files;
  ParamLayout layout;
};

HfWeightReader::HfWeightReader(const std::string& dir, const ModelConfig& c)
    : s_(std::make_unique<State>(State{fs::path(dir), c, read_hf_config((fs::path(dir) / kConfigFile).string()).family,
                                       HfTensors{fs::path(dir)}, build_param_layout(c)})) {
  check_hf_tensors(s_->dir, HfConfig{s_->family, c}, s_->files);
  // Every tensor of the folder is a parameter's (or a known buffer), before anything is read.
  std::set<std::string> used;
  for (const ParamSpec& spec : s_->layout.params) {
    for (const Piece& piece : pieces_of(c, s_->family, spec)) {
      std::string stored;
      if (piece.expert) {
        for (const std::string& name : gpt_oss_stored_names(lookup_in(s_->files), *piece.expert)) used.insert(name);
      } else if (s_->files.find(piece.name, &stored) != nullptr) {
        used.insert(stored);
      }
    }
  }
  std::string head;
  if (c.tied_head() && s_->files.find("lm_head.weight", &head) != nullptr) used.insert(head);  // compared in read()
  for (const std::string& name : s_->files.names()) {
    LOOM_CHECK(used.count(name) || is_buffer(name) || is_extra_layer(name, c, s_->family), s_->files.describe(),
               ": tensor '", name, "' is not a parameter of a ", arch_name(c.arch), " model with this config.json");
  }
}

HfWeightReader::~HfWeightReader() = default;

bool HfWeightReader::stored_as_bf16(const std::string& name) const {
  const std::vector<Piece> pieces = pieces_of(s_->config, s_->family, s_->layout.find(name));
  if (pieces.empty() || pieces.front().expert) return false;  // (GPT-OSS's experts are read in f32)
  for (const Piece& piece : pieces) {
    std::string stored;
    const SafetensorsFile* file = s_->files.find(piece.name, &stored);
    if (file == nullptr || file->stored_dtype(stored) != "BF16") return false;
  }
  return true;
}

void HfWeightReader::read(const std::string& name, const Tensor& dst) const {
  const ModelConfig& c = s_->config;
  const ParamSpec& spec = s_->layout.find(name);
  const bool wide = dst.dtype() == DTYPE_F32;
  LOOM_CHECK(dst.device() == DEVICE_CPU && dst.shape() == spec.shape && (wide || dst.dtype() == DTYPE_BF16), name,
             ": read into a host f32 or bf16 tensor of shape ", shape_str(spec.shape), ", got ", dst.describe());
  LOOM_CHECK(wide || !deepseek(s_->family), name, ": DeepSeek's permuted RoPE rows are read in f32 only");
  const std::vector<Piece> pieces = pieces_of(c, s_->family, spec);
  if (pieces.empty()) std::memset(dst.raw_data(), 0, dst.nbytes());  // (DeepSeek-V2's absent routing bias)
  std::set<std::string> used;
  int64_t row = 0;
  for (const Piece& piece : pieces) {
    if (piece.expert) {
      LOOM_CHECK(wide, name, ": GPT-OSS's fused experts are read in f32 only");
      read_gpt_oss_expert(lookup_in(s_->files), c, *piece.expert, dst.data<float>(), used);
    } else {
      copy_piece(s_->files, piece, spec, dst, row, used);
    }
    row += piece.rows;
  }
  if (deepseek(s_->family)) permute_deepseek_rope_rows(c, deepseek_rope_starts(c, spec.name), dst, true);
  if (unit_offset_norm(s_->family, name)) {
    LOOM_CHECK(wide, name, ": Gemma's (1 + w) norm weights are read in f32 only");
    for (int64_t i = 0; i < dst.numel(); ++i) dst.data<float>()[i] += 1.0f;
  }
  if (c.tied_head() && name == embedding_param_name(c)) check_tied_head(s_->files, dst, used);
}

void load_hf_weights(const std::string& dir, const ModelState& model, const std::map<std::string, Tensor>& bf16) {
  const HfWeightReader reader(dir, model.config);
  const ParamLayout layout = build_param_layout(model.config);
  LOOM_CHECK(model.params.numel() == layout.total, "load_hf_weights: a parameter buffer of ", model.params.numel(),
             " floats for a model of ", layout.total);
  for (const ParamSpec& spec : layout.params) {
    const auto it = bf16.find(spec.name);
    reader.read(spec.name, it != bf16.end() ? it->second : model.params.view(spec.offset, spec.shape));
  }
}

namespace {

class HfParamReader final : public BufferedParamReader {
 public:
  HfParamReader(const std::string& dir, const ModelConfig& config) : BufferedParamReader(config, dir), reader_(dir, config) {}

 private:
  void fill(const ParamSpec& spec, const Tensor& dst) override { reader_.read(spec.name, dst); }
  HfWeightReader reader_;
};

}  // namespace

std::unique_ptr<ParamReader> hf_param_reader(const std::string& dir, const ModelConfig& config) {
  return std::make_unique<HfParamReader>(dir, config);
}

void save_hf_model(const std::string& dir, ParamReader& params, DType dtype) {
  const ModelConfig& c = params.config();
  LOOM_CHECK(!c.lora(), dir, ": a model with LoRA adapters is written merged (nn/lora.h lora_merge) or its adapters "
             "alone (checkpoint/peft.h)");
  LOOM_CHECK(dtype == DTYPE_F32 || dtype == DTYPE_BF16, dir, ": a Hugging Face folder is written in f32 or bf16, not ",
             dtype_name(dtype));
  const HfFamily family = hf_family_of(c);
  const ParamLayout layout = build_param_layout(c);
  std::vector<SafetensorsWriter::Entry> entries;
  std::set<std::string> declared;  // a folder tensor gathered from several pieces is one entry
  for (const ParamSpec& spec : layout.params) {
    for (const Piece& piece : pieces_of(c, family, spec)) {
      if (!declared.insert(piece.name).second) continue;
      entries.push_back({piece.name, dtype == DTYPE_BF16 ? "BF16" : "F32",
                         piece_shape(piece, spec, is_gpt2_conv1d_weight(spec.name))});
    }
  }
  // Gathered folder tensors (Piece::runs), filled row by row from their pieces and written whole.
  struct Pending {
    std::vector<float> values;
    int64_t filled = 0;
  };
  std::map<std::string, Pending> pending;
  fs::create_directories(dir);
  const std::string path = (fs::path(dir) / kWeightsFile).string();
  const std::string tmp = str_cat(path, ".", ::getpid(), ".tmp");
  try {
    SafetensorsWriter writer(tmp, entries, {{"format", "pt"}});
    CpuAllocator host;
    for (const ParamSpec& spec : layout.params) {
      const float* values = params.read(spec.name).data();
      const std::vector<int64_t> rope_starts = deepseek(family) ? deepseek_rope_starts(c, spec.name) : std::vector<int64_t>{};
      Tensor copy;
      if (!rope_starts.empty()) {  // a host copy in the folder's RoPE row order
        copy = Tensor::empty(host, spec.shape, DTYPE_F32, MEM_WORKSPACE);
        std::memcpy(copy.data<float>(), values, static_cast<size_t>(spec.numel) * sizeof(float));
        permute_deepseek_rope_rows(c, rope_starts, copy, false);
        values = copy.data<float>();
      } else if (unit_offset_norm(family, spec.name)) {  // Gemma: the folder's w of Loom's 1 + w
        copy = Tensor::empty(host, spec.shape, DTYPE_F32, MEM_WORKSPACE);
        for (int64_t i = 0; i < spec.numel; ++i) copy.data<float>()[i] = values[i] - 1.0f;
        values = copy.data<float>();
      }
      const int64_t cols = spec.shape.size() == 2 ? spec.shape[1] : 1;
      const bool transpose = is_gpt2_conv1d_weight(spec.name);
      int64_t row = 0;
      for (const Piece& piece : pieces_of(c, family, spec)) {
        const float* in = values + row * cols;
        auto n = static_cast<size_t>(piece.rows * cols);
        row += piece.rows;
        // Gathered into a folder tensor (Qwen3-Next's row runs, GPT-OSS's fused experts): written
        // once every piece of it is in.
        if (piece.expert || !piece.runs.empty()) {
          Pending& p = pending[piece.name];
          p.values.resize(static_cast<size_t>(shape_numel(piece.shape)));
          if (piece.expert) {
            write_gpt_oss_expert(c, *piece.expert, in, p.values.data());
          } else {
            int64_t at = 0;
            for (const auto& [first, count] : piece.runs) {
              std::memcpy(p.values.data() + first * cols, in + at * cols, static_cast<size_t>(count * cols) * sizeof(float));
              at += count;
            }
          }
          p.filled += static_cast<int64_t>(n);
          if (p.filled < static_cast<int64_t>(p.values.size())) continue;
          in = p.values.data();
          n = p.values.size();
        }
        std::vector<float> transposed;
        if (transpose) {  // Loom's (out, in) -> (in, out)
          transposed.resize(n);
          transpose_into(in, transposed.data(), piece.rows, cols);
          in = transposed.data();
        }
        if (dtype == DTYPE_F32) {
          writer.write(piece.name, in, n * sizeof(float));
        } else {
          std::vector<bf16> narrow(n);
          for (size_t k = 0; k < n; ++k) narrow[k] = f32_to_bf16(in[k]);
          writer.write(piece.name, narrow.data(), n * sizeof(bf16));
        }
        pending.erase(piece.name);
      }
    }
    writer.close();
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  rename_into_place(tmp, path);
  write_file_atomic((fs::path(dir) / kConfigFile).string(), hf_config_json(c).dump(2) + "\n");
}

void save_hf_model(const std::string& dir, const ModelState& model) {
  const auto reader = flat_param_reader(model.config, {model.params.data<float>(), static_cast<size_t>(model.params.numel())});
  save_hf_model(dir, *reader, DTYPE_F32);
}

}  // namespace loom
