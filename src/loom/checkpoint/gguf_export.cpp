#include "loom/checkpoint/gguf_export.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/gguf.h"
#include "loom/core/error.h"
#include "loom/precision/formats.h"
#include "loom/precision/ggml_blocks.h"

namespace loom {

namespace {

// llama.cpp's llama_ftype: what general.file_type says of the matrices.
uint32_t file_type(GgufExportType type) {
  switch (type) {
    case GgufExportType::F32: return 0;   // LLAMA_FTYPE_ALL_F32
    case GgufExportType::F16: return 1;   // LLAMA_FTYPE_MOSTLY_F16
    case GgufExportType::Q8_0: return 7;  // LLAMA_FTYPE_MOSTLY_Q8_0
    case GgufExportType::Q4_0: return 2;  // LLAMA_FTYPE_MOSTLY_Q4_0
  }
  return 0;
}

GgmlType matrix_type(GgufExportType type) {
  switch (type) {
    case GgufExportType::F32: return GgmlType::F32;
    case GgufExportType::F16: return GgmlType::F16;
    case GgufExportType::Q8_0: return GgmlType::Q8_0;
    case GgufExportType::Q4_0: return GgmlType::Q4_0;
  }
  return GgmlType::F32;
}

// Encodes tensors in the file's types and adds them to the writer.
class TensorSink {
 public:
  TensorSink(GgufWriter& writer, GgufExportType type) : writer_(writer), type_(type) {}

  // A (rows, cols) row-major matrix, or a vector when rows == 0.
  void add(const std::string& name, std::span<const float> x, int64_t rows, int64_t cols) {
    const bool matrix = rows > 0;
    GgmlType t = matrix ? matrix_type(type_) : GgmlType::F32;
    if ((t == GgmlType::Q8_0 || t == GgmlType::Q4_0) && cols % kGgmlBlockElements != 0) t = GgmlType::F32;
    std::vector<uint8_t> bytes(ggml_tensor_bytes(t, x.size()));
    switch (t) {
      case GgmlType::F32: std::memcpy(bytes.data(), x.data(), bytes.size()); break;
      case GgmlType::F16:
        for (size_t k = 0; k < x.size(); ++k) {
          const auto bits = static_cast<uint16_t>(encode(FMT_FP16, x[k], /*saturate=*/false));
          bytes[2 * k] = static_cast<uint8_t>(bits & 0xFF), bytes[2 * k + 1] = static_cast<uint8_t>(bits >> 8);
        }
        break;
      case GgmlType::Q8_0: ggml_quantize(GgmlBlock::Q8_0, x, bytes); break;
      case GgmlType::Q4_0: ggml_quantize(GgmlBlock::Q4_0, x, bytes); break;
    }
    std::vector<uint64_t> ne{static_cast<uint64_t>(matrix ? cols : static_cast<int64_t>(x.size()))};
    if (matrix) ne.push_back(static_cast<uint64_t>(rows));
    writer_.add_tensor(name, std::move(ne), t, std::move(bytes));
    ++tensors_;
    if (matrix && t == matrix_type(type_)) ++converted_;
  }
  int64_t tensors() const { return tensors_; }
  int64_t converted() const { return converted_; }

 private:
  GgufWriter& writer_;
  GgufExportType type_;
  int64_t tensors_ = 0, converted_ = 0;
};

// A parameter of the flat buffer by its Loom name.
class Params {
 public:
  Params(const ModelConfig& config, std::span<const float> flat) : layout_(build_param_layout(config)), flat_(flat) {
    LOOM_CHECK(static_cast<int64_t>(flat.size()) == layout_.total, "export_gguf: ", flat.size(),
               " parameters for a model of ", layout_.total);
  }
  std::span<const float> operator()(const std::string& name) const {
    const ParamSpec& p = layout_.find(name);
    return flat_.subspan(static_cast<size_t>(p.offset), static_cast<size_t>(p.numel));
  }
  const Shape& shape(const std::string& name) const { return layout_.find(name).shape; }

 private:
  ParamLayout layout_;
  std::span<const float> flat_;
};

void add_matrix(TensorSink& sink, const Params& params, const std::string& loom, const std::string& gguf) {
  const Shape& s = params.shape(loom);
  sink.add(gguf, params(loom), s[0], s[1]);
}

void add_vector(TensorSink& sink, const Params& params, const std::string& loom, const std::string& gguf) {
  sink.add(gguf, params(loom), 0, 0);
}

void add_gpt2_tensors(const ModelConfig& c, const Params& params, TensorSink& sink) {
  add_matrix(sink, params, "wte.weight", "token_embd.weight");
  add_matrix(sink, params, "wpe.weight", "position_embd.weight");
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "h." + std::to_string(i) + ".", b = "blk." + std::to_string(i) + ".";
    for (const char* kind : {"weight", "bias"}) {
      const std::string k = kind;
      add_vector(sink, params, p + "ln_1." + k, b + "attn_norm." + k);
      (k == "weight" ? add_matrix : add_vector)(sink, params, p + "attn.c_attn." + k, b + "attn_qkv." + k);
      (k == "weight" ? add_matrix : add_vector)(sink, params, p + "attn.c_proj." + k, b + "attn_output." + k);
      add_vector(sink, params, p + "ln_2." + k, b + "ffn_norm." + k);
      (k == "weight" ? add_matrix : add_vector)(sink, params, p + "mlp.c_fc." + k, b + "ffn_up." + k);
      (k == "weight" ? add_matrix : add_vector)(sink, params, p + "mlp.c_proj." + k, b + "ffn_down." + k);
    }
  }
  add_vector(sink, params, "ln_f.weight", "output_norm.weight");
  add_vector(sink, params, "ln_f.bias", "output_norm.bias");
}

// Rows [first, first + heads hd) of a (rows, C) matrix, each head's rows reordered from
// rotate-half pairs (j, j + hd/2) to adjacent pairs (2j, 2j + 1) when `rope`.
std::vector<float> head_rows(std::span<const float> w, int64_t C, int64_t first, int64_t heads, int64_t hd, bool rope) {
  std::vector<float> out(static_cast<size_t>(heads * hd * C));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < hd; ++r) {
      const int64_t src = rope ? (r % 2) * (hd / 2) + r / 2 : r;  // GGUF row r = 2j + c <- Loom row c hd/2 + j
      std::copy_n(w.begin() + (first + h * hd + src) * C, C, out.begin() + (h * hd + r) * C);
    }
  }
  return out;
}

// llama.cpp's architecture for a Llama-family model: "qwen2" with q/k/v biases (Qwen2 / 2.5),
// "qwen3" with q/k norms, else "llama".
std::string gguf_arch(const ModelConfig& c) {
  if (c.arch == ARCH_LLAMA && c.qkv_bias) return "qwen2";
  if (c.arch == ARCH_LLAMA && c.qk_norm) return "qwen3";
  return std::string(arch_name(c.arch));
}

void add_llama_tensors(const ModelConfig& c, const Params& params, TensorSink& sink) {
  const int64_t C = c.d_model, F = c.d_ff, hd = c.head_dim(), H = c.n_head, KV = c.n_kv_head;
  // llama.cpp's llama turns adjacent pairs (rope type NORM: q and k rows permuted below); its
  // qwen2 and qwen3 turn the halves (NEOX), as Loom does: rows as they are.
  const bool permute = !c.qkv_bias && !c.qk_norm;
  add_matrix(sink, params, "model.embed_tokens.weight", "token_embd.weight");
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", b = "blk." + std::to_string(i) + ".";
    add_vector(sink, params, p + "input_layernorm.weight", b + "attn_norm.weight");
    const std::span<const float> qkv = params(p + "self_attn.qkv_proj.weight");
    sink.add(b + "attn_q.weight", head_rows(qkv, C, 0, H, hd, permute), H * hd, C);
    sink.add(b + "attn_k.weight", head_rows(qkv, C, H * hd, KV, hd, permute), KV * hd, C);
    sink.add(b + "attn_v.weight", head_rows(qkv, C, (H + KV) * hd, KV, hd, false), KV * hd, C);
    if (c.qkv_bias) {  // Qwen2's biases, split as the weight's rows
      const std::span<const float> bias = params(p + "self_attn.qkv_proj.bias");
      sink.add(b + "attn_q.bias", bias.first(static_cast<size_t>(H * hd)), 0, 0);
      sink.add(b + "attn_k.bias", bias.subspan(static_cast<size_t>(H * hd), static_cast<size_t>(KV * hd)), 0, 0);
      sink.add(b + "attn_v.bias", bias.subspan(static_cast<size_t>((H + KV) * hd)), 0, 0);
    }
    if (c.qk_norm) {  // Qwen3's per-head norms (head_dim each)
      add_vector(sink, params, p + "self_attn.q_norm.weight", b + "attn_q_norm.weight");
      add_vector(sink, params, p + "self_attn.k_norm.weight", b + "attn_k_norm.weight");
    }
    add_matrix(sink, params, p + "self_attn.o_proj.weight", b + "attn_output.weight");
    add_vector(sink, params, p + "post_attention_layernorm.weight", b + "ffn_norm.weight");
    const std::span<const float> gate_up = params(p + "mlp.gate_up_proj.weight");
    sink.add(b + "ffn_gate.weight", gate_up.first(static_cast<size_t>(F * C)), F, C);
    sink.add(b + "ffn_up.weight", gate_up.subspan(static_cast<size_t>(F * C)), F, C);
    add_matrix(sink, params, p + "mlp.down_proj.weight", b + "ffn_down.weight");
  }
  add_vector(sink, params, "model.norm.weight", "output_norm.weight");
  // A tied head has no output.weight: llama.cpp's llama then uses token_embd.
  if (!c.tie_embeddings) add_matrix(sink, params, "lm_head.weight", "output.weight");
  // Linear and llama3 RoPE scaling as llama.cpp's rope_freqs (convert_hf_to_gguf.py writes it for
  // Llama 3.1): pair j's angle is pos theta^(-2j/hd) / rope_freqs[j], so the factor is the
  // unscaled frequency over Loom's (backend/rope.h).
  if (c.rope_scaling == ROPE_SCALING_LINEAR || c.rope_scaling == ROPE_SCALING_LLAMA3) {
    RopeSpec plain = c.rope();
    plain.scaling = ROPE_SCALING_NONE;
    std::vector<float> factors(static_cast<size_t>(hd / 2));
    for (int64_t j = 0; j < hd / 2; ++j) {
      factors[static_cast<size_t>(j)] = static_cast<float>(rope_inv_freq(plain, j, hd) / rope_inv_freq(c.rope(), j, hd));
    }
    sink.add("rope_freqs.weight", factors, 0, 0);
  }
}

void check_exportable(const ModelConfig& c, const GgufVocabulary& vocab) {
  LOOM_CHECK(!c.lora(), "peft.method = lora: GGUF export writes merged weights (loom convert merges the adapters first)");
  LOOM_CHECK(c.moe_experts == 0, "model.moe_experts = ", c.moe_experts, ": GGUF export supports dense models only");
  LOOM_CHECK(!c.mla(), "model.mla_kv_rank = ", c.mla_kv_rank, ": GGUF export does not support MLA models");
  LOOM_CHECK(c.attn_window == 0, "model.attn_window = ", c.attn_window,
             ": GGUF export does not support sliding-window attention (llama.cpp's gpt2/llama attend to every position)");
  LOOM_CHECK(!(c.qk_norm && c.qkv_bias), "model.qk_norm with model.qkv_bias: no llama.cpp architecture has both");
  LOOM_CHECK(c.rope_scaling == ROPE_SCALING_NONE || c.rope_scaling == ROPE_SCALING_LINEAR ||
                 c.rope_scaling == ROPE_SCALING_LLAMA3,
             "model.rope_scaling = ", enum_name(c.rope_scaling),
             ": GGUF export writes linear and llama3 scaling (rope_freqs), not yarn yet");
  LOOM_CHECK(!(c.qkv_bias || c.qk_norm) || c.rope_scaling == ROPE_SCALING_NONE, "model.qkv_bias / qk_norm with "
             "model.rope_scaling = ", enum_name(c.rope_scaling), ": GGUF export writes Qwen2 / Qwen3 as llama.cpp's "
             "qwen2 / qwen3, without RoPE scaling");
  LOOM_CHECK(c.arch == ARCH_LLAMA || c.head_dim() * c.n_head == c.d_model, "model.head_size = ", c.head_size,
             ": llama.cpp's gpt2 needs head_size = d_model / n_head");
  LOOM_CHECK(static_cast<int64_t>(vocab.tokens.size()) == c.vocab_size, "the tokenizer has ", vocab.tokens.size(),
             " tokens but model.vocab_size = ", c.vocab_size);
}

void put_arch(GgufWriter& w, const ModelConfig& c) {
  const std::string a = gguf_arch(c);
  w.put("general.architecture", GgufValue::string(a));
  w.put(a + ".vocab_size", GgufValue::u32(static_cast<uint32_t>(c.vocab_size)));
  w.put(a + ".context_length", GgufValue::u32(static_cast<uint32_t>(c.max_seq_len)));
  w.put(a + ".embedding_length", GgufValue::u32(static_cast<uint32_t>(c.d_model)));
  w.put(a + ".block_count", GgufValue::u32(static_cast<uint32_t>(c.n_layer)));
  w.put(a + ".feed_forward_length", GgufValue::u32(static_cast<uint32_t>(c.d_ff)));
  w.put(a + ".attention.head_count", GgufValue::u32(static_cast<uint32_t>(c.n_head)));
  if (c.arch == ARCH_GPT2) {
    w.put(a + ".attention.layer_norm_epsilon", GgufValue::f32(c.norm_eps));
    return;
  }
  w.put(a + ".attention.head_count_kv", GgufValue::u32(static_cast<uint32_t>(c.n_kv_head)));
  w.put(a + ".attention.layer_norm_rms_epsilon", GgufValue::f32(c.norm_eps));
  w.put(a + ".rope.freq_base", GgufValue::f32(c.rope_theta));
  w.put(a + ".rope.dimension_count", GgufValue::u32(static_cast<uint32_t>(c.head_dim())));
  if (c.head_dim() * c.n_head != c.d_model) {
    w.put(a + ".attention.key_length", GgufValue::u32(static_cast<uint32_t>(c.head_dim())));
    w.put(a + ".attention.value_length", GgufValue::u32(static_cast<uint32_t>(c.head_dim())));
  }
}

}  // namespace

GgufExportSummary export_gguf(const ModelConfig& config, std::span<const float> params, const GgufVocabulary& vocab,
                              GgufExportType type, const std::string& name, const std::string& path) {
  check_exportable(config, vocab);
  GgufWriter writer;
  put_arch(writer, config);
  writer.put("general.name", GgufValue::string(name));
  writer.put("general.file_type", GgufValue::u32(file_type(type)));
  writer.put("general.quantization_version", GgufValue::u32(2));  // GGML_QNT_VERSION
  put_gguf_tokenizer(writer, vocab);
  const Params named(config, params);
  TensorSink sink(writer, type);
  if (config.arch == ARCH_GPT2) add_gpt2_tensors(config, named, sink);
  else add_llama_tensors(config, named, sink);
  writer.write(path);
  return {gguf_arch(config), sink.tensors(), sink.converted(), static_cast<uint64_t>(std::filesystem::file_size(path))};
}

}  // namespace loom
