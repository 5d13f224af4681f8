#include "loom/checkpoint/gguf_export.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/gguf.h"
#include "loom/core/dtype.h"
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
    case GgufExportType::BF16: return 32; // LLAMA_FTYPE_MOSTLY_BF16
    case GgufExportType::Q8_0: return 7;  // LLAMA_FTYPE_MOSTLY_Q8_0
    case GgufExportType::Q4_0: return 2;  // LLAMA_FTYPE_MOSTLY_Q4_0
  }
  return 0;
}

GgmlType matrix_type(GgufExportType type) {
  switch (type) {
    case GgufExportType::F32: return GgmlType::F32;
    case GgufExportType::F16: return GgmlType::F16;
    case GgufExportType::BF16: return GgmlType::BF16;
    case GgufExportType::Q8_0: return GgmlType::Q8_0;
    case GgufExportType::Q4_0: return GgmlType::Q4_0;
  }
  return GgmlType::F32;
}

GgmlType matrix_type_for(GgufExportType type, int64_t cols) {
  const GgmlType t = matrix_type(type);
  return (t == GgmlType::Q8_0 || t == GgmlType::Q4_0) && cols % kGgmlBlockElements != 0 ? GgmlType::F32 : t;
}

// One tensor's f32 values when the file is written: a parameter (or a part of one) as the reader
// holds it, or a copy in GGUF's row order.
struct Values {
  std::span<const float> span;
  std::vector<float> owned;  // span points into it when it is used (a moved vector keeps its buffer)
  static Values of(std::span<const float> s) { return {s, {}}; }
  static Values own(std::vector<float> v) {
    Values x{{}, std::move(v)};
    x.span = x.owned;
    return x;
  }
};
using MakeValues = std::function<Values()>;

// `x` in the file's type `t`, its rows encoded in parallel (ggml's blocks are independent).
std::vector<uint8_t> encode_tensor(GgmlType t, std::span<const float> x, int64_t cols) {
  std::vector<uint8_t> bytes(ggml_tensor_bytes(t, x.size()));
  const int64_t n = static_cast<int64_t>(x.size());
  switch (t) {
    case GgmlType::F32: std::memcpy(bytes.data(), x.data(), bytes.size()); break;
    case GgmlType::F16:
    case GgmlType::BF16:
#pragma omp parallel for schedule(static)
      for (int64_t k = 0; k < n; ++k) {
        const auto bits = t == GgmlType::F16 ? static_cast<uint16_t>(encode(FMT_FP16, x[k], /*saturate=*/false))
                                             : f32_to_bf16(x[k]).bits;
        bytes[2 * k] = static_cast<uint8_t>(bits & 0xFF), bytes[2 * k + 1] = static_cast<uint8_t>(bits >> 8);
      }
      break;
    case GgmlType::Q8_0:
    case GgmlType::Q4_0: {
      const GgmlBlock block = t == GgmlType::Q8_0 ? GgmlBlock::Q8_0 : GgmlBlock::Q4_0;
      const int64_t rows = n / cols, row_bytes = static_cast<int64_t>(ggml_tensor_bytes(t, static_cast<uint64_t>(cols)));
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        ggml_quantize(block, x.subspan(static_cast<size_t>(r * cols), static_cast<size_t>(cols)),
                      std::span<uint8_t>(bytes).subspan(static_cast<size_t>(r * row_bytes), static_cast<size_t>(row_bytes)));
      }
      break;
    }
  }
  return bytes;
}

// Declares tensors in the file's types; each one's values are read and encoded when the writer
// reaches it, so one tensor is held at a time.
class TensorSink {
 public:
  TensorSink(GgufWriter& writer, GgufExportType type) : writer_(writer), type_(type) {}

  // A (rows, cols) row-major matrix, or a vector of `cols` elements when rows == 0.
  void add(const std::string& name, int64_t rows, int64_t cols, MakeValues make) {
    const bool matrix = rows > 0;
    if (matrix) add_stacked(name, 1, rows, cols, std::move(make));
    else add_f32(name, {static_cast<uint64_t>(cols)}, std::move(make));
  }
  // `depth` (rows, cols) matrices one after another in the file's matrix type, ggml's ne =
  // [cols, rows, depth] (llama.cpp's stacked experts, *_exps; depth 1: a plain matrix).
  void add_stacked(const std::string& name, int64_t depth, int64_t rows, int64_t cols, MakeValues make) {
    const GgmlType t = matrix_type_for(type_, cols);
    std::vector<uint64_t> ne{static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
    if (depth > 1) ne.push_back(static_cast<uint64_t>(depth));
    declare(name, std::move(ne), t, cols, std::move(make));
    if (t == matrix_type(type_)) ++converted_;
  }
  // A tensor kept in f32 whatever the file's type: vectors, and the experts' stacked biases
  // (llama.cpp adds them with ggml_add_id, which takes f32 only).
  void add_f32(const std::string& name, std::vector<uint64_t> ne, MakeValues make) {
    const auto cols = static_cast<int64_t>(ne.front());
    declare(name, std::move(ne), GgmlType::F32, cols, std::move(make));
  }
  int64_t tensors() const { return tensors_; }
  int64_t converted() const { return converted_; }

 private:
  void declare(const std::string& name, std::vector<uint64_t> ne, GgmlType t, int64_t cols, MakeValues make) {
    uint64_t elements = 1;
    for (const uint64_t n : ne) elements *= n;
    writer_.add_tensor(name, std::move(ne), t, [t, cols, elements, name, make = std::move(make)] {
      const Values v = make();
      LOOM_CHECK(v.span.size() == elements, "GGUF tensor ", name, ": ", v.span.size(), " values for ", elements);
      return encode_tensor(t, v.span, cols);
    });
    ++tensors_;
  }

  GgufWriter& writer_;
  GgufExportType type_;
  int64_t tensors_ = 0, converted_ = 0;
};

// The reader's parameters by Loom name, with their shapes.
class Params {
 public:
  explicit Params(ParamReader& reader) : reader_(reader), layout_(build_param_layout(reader.config())) {}
  ParamReader& reader() const { return reader_; }
  const Shape& shape(const std::string& name) const { return layout_.find(name).shape; }
  int64_t numel(const std::string& name) const { return layout_.find(name).numel; }
  MakeValues whole(const std::string& name) const {
    return [&r = reader_, name] { return Values::of(r.read(name)); };
  }
  // Elements [first, first + count) of the parameter.
  MakeValues part(const std::string& name, int64_t first, int64_t count) const {
    return [&r = reader_, name, first, count] {
      return Values::of(r.read(name).subspan(static_cast<size_t>(first), static_cast<size_t>(count)));
    };
  }
  // Elements [first, first + count) of each parameter of `names`, one after another (an MoE
  // layer's experts stacked: llama.cpp's *_exps tensors).
  MakeValues stacked(std::vector<std::string> names, int64_t first, int64_t count) const {
    return [&r = reader_, names = std::move(names), first, count] {
      std::vector<float> out;
      out.reserve(names.size() * static_cast<size_t>(count));
      for (const std::string& name : names) {
        const std::span<const float> w = r.read(name).subspan(static_cast<size_t>(first), static_cast<size_t>(count));
        out.insert(out.end(), w.begin(), w.end());
      }
      return Values::own(std::move(out));
    };
  }

 private:
  ParamReader& reader_;
  ParamLayout layout_;
};

void add_matrix(TensorSink& sink, const Params& params, const std::string& loom, const std::string& gguf) {
  const Shape& s = params.shape(loom);
  sink.add(gguf, s[0], s[1], params.whole(loom));
}

void add_vector(TensorSink& sink, const Params& params, const std::string& loom, const std::string& gguf) {
  sink.add(gguf, 0, params.numel(loom), params.whole(loom));
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

// llama.cpp's architecture for a Llama-family model: "qwen3next" with linear-attention layers
// (Qwen3-Next), "gpt-oss" with attention sinks (GPT-OSS),
// "qwen3moe" for MoE with q/k norms (Qwen3-MoE; MoE without them is "llama", as Mixtral),
// "gemma3" with sandwich norms (Gemma 3),
// "olmo2" with output norms alone (OLMo 2; NEOX RoPE, q/k norms over all heads), "phi3" with
// LongRoPE (fused attn_qkv and ffn_up, the factors as rope_factors_short / _long),
// "qwen2" with q/k/v biases (Qwen2 / 2.5),
// "qwen3" with q/k norms, "smollm3" with NoPE layers (llama.cpp skips RoPE on every 4th layer,
// n_no_rope_layer_step, with no key for it), else "llama".
std::string gguf_arch(const ModelConfig& c) {
  if (c.arch == ARCH_LLAMA && c.linear_interval > 0) return "qwen3next";
  if (c.arch == ARCH_LLAMA && c.attn_sinks) return "gpt-oss";
  if (c.arch == ARCH_LLAMA && c.moe_experts > 0 && c.qk_norm) return "qwen3moe";
  if (c.arch == ARCH_LLAMA && c.sandwich_norm) return "gemma3";
  if (c.arch == ARCH_LLAMA && c.post_norm) return "olmo2";
  if (c.arch == ARCH_LLAMA && c.rope_scaling == ROPE_SCALING_LONGROPE) return "phi3";
  if (c.arch == ARCH_LLAMA && c.qkv_bias) return "qwen2";
  if (c.arch == ARCH_LLAMA && c.qk_norm) return "qwen3";
  if (c.arch == ARCH_LLAMA && c.nope_interval > 0) return "smollm3";
  return std::string(arch_name(c.arch));
}

// An MoE layer as llama.cpp's stacked experts: the router ffn_gate_inp (E, C) (f32, as
// convert_hf_to_gguf.py writes it) and its bias (GPT-OSS); ffn_gate_exps and ffn_up_exps (E, F, C):
// the first and last F rows of each expert's gate_up_proj; ffn_down_exps (E, C, F); GPT-OSS's
// expert biases likewise, (E, F) and (E, C) in f32.
void add_moe_tensors(const ModelConfig& c, const Params& params, TensorSink& sink, const std::string& m,
                     const std::string& b) {
  const int64_t C = c.d_model, F = c.expert_ff(), E = c.moe_experts;
  const auto each = [&](const std::string& suffix) {
    std::vector<std::string> names;
    for (int64_t e = 0; e < E; ++e) names.push_back(m + "experts." + std::to_string(e) + "." + suffix);
    return names;
  };
  const auto ne = [](int64_t cols, int64_t rows) { return std::vector<uint64_t>{static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)}; };
  sink.add_f32(b + "ffn_gate_inp.weight", ne(C, E), params.whole(m + "gate.weight"));
  if (c.moe_router_bias) add_vector(sink, params, m + "gate.bias", b + "ffn_gate_inp.bias");
  sink.add_stacked(b + "ffn_gate_exps.weight", E, F, C, params.stacked(each("gate_up_proj.weight"), 0, F * C));
  sink.add_stacked(b + "ffn_up_exps.weight", E, F, C, params.stacked(each("gate_up_proj.weight"), F * C, F * C));
  sink.add_stacked(b + "ffn_down_exps.weight", E, C, F, params.stacked(each("down_proj.weight"), 0, C * F));
  if (c.moe_shared > 0) {  // Qwen3-Next's shared expert and its sigmoid gate (qwen3next's *_shexp)
    const int64_t S = c.moe_shared * F;
    const std::string shared = m + "shared_experts.";
    sink.add(b + "ffn_gate_shexp.weight", S, C, params.part(shared + "gate_up_proj.weight", 0, S * C));
    sink.add(b + "ffn_up_shexp.weight", S, C, params.part(shared + "gate_up_proj.weight", S * C, S * C));
    add_matrix(sink, params, shared + "down_proj.weight", b + "ffn_down_shexp.weight");
    add_vector(sink, params, m + "shared_expert_gate.weight", b + "ffn_gate_inp_shexp.weight");
  }
  if (!c.moe_expert_bias) return;
  sink.add_f32(b + "ffn_gate_exps.bias", ne(F, E), params.stacked(each("gate_up_proj.bias"), 0, F));
  sink.add_f32(b + "ffn_up_exps.bias", ne(F, E), params.stacked(each("gate_up_proj.bias"), F, F));
  sink.add_f32(b + "ffn_down_exps.bias", ne(C, E), params.stacked(each("down_proj.bias"), 0, C));
}

// Qwen3-Next as llama.cpp's qwen3next (src/models/qwen3next.cpp; convert_hf_to_gguf.py's
// Qwen3NextModel). Every layer: attn_norm, post_attention_norm (the MLP's input norm) and the MoE
// with its gated shared expert. A gated DeltaNet layer: attn_qkv ([q | k | v] rows, Loom's) and
// attn_gate (z) from in_proj_qkvz; ssm_ba in the Hub's per-key-head groups [b r | a r] (Loom keeps
// [b | a]); ssm_conv1d (channels, K) in f32; ssm_dt.bias; ssm_a = -exp(A_log); ssm_norm (plain
// w); ssm_out. A gated-attention layer: attn_q with each head's query rows then its gate rows (the
// Hub's q_proj), attn_k, attn_v, the per-head q/k norms, attn_output. Loom's zero-centred norms
// already hold 1 + w, which is what the converter writes.
void add_qwen3_next_tensors(const ModelConfig& c, const Params& params, TensorSink& sink) {
  const int64_t C = c.d_model, hd = c.head_dim(), H = c.n_head, KV = c.n_kv_head;
  const int64_t Hk = c.linear_key_heads, Hv = c.linear_value_heads, r = Hv / Hk;
  const int64_t Dq = Hk * c.linear_key_dim, Dv = Hv * c.linear_value_dim, K = c.linear_conv_taps;
  add_matrix(sink, params, "model.embed_tokens.weight", "token_embd.weight");
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", b = "blk." + std::to_string(i) + ".";
    add_vector(sink, params, p + "input_layernorm.weight", b + "attn_norm.weight");
    if (c.linear_layer(i)) {
      const std::string a = p + "linear_attn.";
      sink.add(b + "attn_qkv.weight", 2 * Dq + Dv, C, params.part(a + "in_proj_qkvz.weight", 0, (2 * Dq + Dv) * C));
      sink.add(b + "attn_gate.weight", Dv, C, params.part(a + "in_proj_qkvz.weight", (2 * Dq + Dv) * C, Dv * C));
      sink.add(b + "ssm_ba.weight", 2 * Hv, C, [&rd = params.reader(), name = a + "in_proj_ba.weight", C, Hk, Hv, r] {
        const std::span<const float> w = rd.read(name);
        std::vector<float> out(static_cast<size_t>(2 * Hv * C));
        for (int64_t g = 0; g < Hk; ++g) {  // key head g: its r b rows, then its r a rows
          for (int64_t j = 0; j < 2 * r; ++j) {
            const int64_t src = j < r ? g * r + j : Hv + g * r + (j - r);
            std::copy_n(w.begin() + src * C, C, out.begin() + (g * 2 * r + j) * C);
          }
        }
        return Values::own(std::move(out));
      });
      sink.add_f32(b + "ssm_conv1d.weight", {static_cast<uint64_t>(K), static_cast<uint64_t>(2 * Dq + Dv)},
                   params.whole(a + "conv1d.weight"));
      add_vector(sink, params, a + "dt_bias", b + "ssm_dt.bias");
      sink.add_f32(b + "ssm_a", {static_cast<uint64_t>(Hv)}, [&rd = params.reader(), name = a + "A_log"] {
        std::vector<float> out;
        for (const float x : rd.read(name)) out.push_back(-std::exp(x));
        return Values::own(std::move(out));
      });
      add_vector(sink, params, a + "norm.weight", b + "ssm_norm.weight");
      add_matrix(sink, params, a + "out_proj.weight", b + "ssm_out.weight");
    } else {
      const std::string qkv = p + "self_attn.qkv_proj.weight", gate = p + "self_attn.gate_proj.weight";
      sink.add(b + "attn_q.weight", 2 * H * hd, C, [&rd = params.reader(), qkv, gate, C, H, hd] {
        // One read at a time (a reader's span lasts until its next read): the queries, then the gates.
        std::vector<float> out(static_cast<size_t>(2 * H * hd * C));
        const std::span<const float> q = rd.read(qkv);
        for (int64_t h = 0; h < H; ++h) std::copy_n(q.begin() + h * hd * C, hd * C, out.begin() + 2 * h * hd * C);
        const std::span<const float> g = rd.read(gate);  // head h: its hd query rows, then its hd gate rows
        for (int64_t h = 0; h < H; ++h) std::copy_n(g.begin() + h * hd * C, hd * C, out.begin() + (2 * h + 1) * hd * C);
        return Values::own(std::move(out));
      });
      sink.add(b + "attn_k.weight", KV * hd, C, params.part(qkv, H * hd * C, KV * hd * C));
      sink.add(b + "attn_v.weight", KV * hd, C, params.part(qkv, (H + KV) * hd * C, KV * hd * C));
      add_vector(sink, params, p + "self_attn.q_norm.weight", b + "attn_q_norm.weight");
      add_vector(sink, params, p + "self_attn.k_norm.weight", b + "attn_k_norm.weight");
      add_matrix(sink, params, p + "self_attn.o_proj.weight", b + "attn_output.weight");
    }
    add_vector(sink, params, p + "post_attention_layernorm.weight", b + "post_attention_norm.weight");
    add_moe_tensors(c, params, sink, p + "mlp.", b);
  }
  add_vector(sink, params, "model.norm.weight", "output_norm.weight");
  if (!c.tie_embeddings) add_matrix(sink, params, "lm_head.weight", "output.weight");
}

void add_llama_tensors(const ModelConfig& c, const Params& params, TensorSink& sink) {
  const int64_t C = c.d_model, F = c.d_ff, hd = c.head_dim(), H = c.n_head, KV = c.n_kv_head;
  // llama.cpp's llama and smollm3 turn adjacent pairs (rope type NORM: q and k rows permuted
  // below); its qwen2 and qwen3 turn the halves (NEOX), as Loom does: rows as they are.
  const bool phi3 = c.rope_scaling == ROPE_SCALING_LONGROPE;  // NEOX, fused q/k/v and gate/up as Loom's rows
  const bool permute = !c.qkv_bias && !c.qk_norm && !phi3;
  add_matrix(sink, params, "model.embed_tokens.weight", "token_embd.weight");
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", b = "blk." + std::to_string(i) + ".";
    // Gemma 3's norm names; llama.cpp's gemma3 scales by the weight as stored, Loom's 1 + w
    // (convert_hf_to_gguf.py adds the 1 to the folder's w).
    if (c.pre_norms()) add_vector(sink, params, p + "input_layernorm.weight", b + "attn_norm.weight");
    const std::string qkv = p + "self_attn.qkv_proj.weight";
    const auto heads = [&params, qkv, C, hd](int64_t first, int64_t count, bool rope) -> MakeValues {
      return [&r = params.reader(), qkv, C, hd, first, count, rope] {
        return Values::own(head_rows(r.read(qkv), C, first, count, hd, rope));
      };
    };
    if (phi3) {
      add_matrix(sink, params, qkv, b + "attn_qkv.weight");
    } else {
      sink.add(b + "attn_q.weight", H * hd, C, heads(0, H, permute));
      sink.add(b + "attn_k.weight", KV * hd, C, heads(H * hd, KV, permute));
      sink.add(b + "attn_v.weight", KV * hd, C, heads((H + KV) * hd, KV, false));
    }
    if (c.qkv_bias) {  // Qwen2's biases, split as the weight's rows
      const std::string bias = p + "self_attn.qkv_proj.bias";
      sink.add(b + "attn_q.bias", 0, H * hd, params.part(bias, 0, H * hd));
      sink.add(b + "attn_k.bias", 0, KV * hd, params.part(bias, H * hd, KV * hd));
      sink.add(b + "attn_v.bias", 0, KV * hd, params.part(bias, (H + KV) * hd, KV * hd));
    }
    if (c.qk_norm) {  // Qwen3's and Gemma 3's per-head norms (head_dim each), OLMo 2's over all heads
      add_vector(sink, params, p + "self_attn.q_norm.weight", b + "attn_q_norm.weight");
      add_vector(sink, params, p + "self_attn.k_norm.weight", b + "attn_k_norm.weight");
    }
    add_matrix(sink, params, p + "self_attn.o_proj.weight", b + "attn_output.weight");
    if (c.attn_out_bias) add_vector(sink, params, p + "self_attn.o_proj.bias", b + "attn_output.bias");
    if (c.attn_sinks) add_vector(sink, params, p + "self_attn.sinks", b + "attn_sinks.weight");  // GPT-OSS, f32
    // The output norms (OLMo 2, Gemma 3) are llama.cpp's post_attention_norm / post_ffw_norm.
    if (c.post_norms()) add_vector(sink, params, p + "post_attention_layernorm.weight", b + "post_attention_norm.weight");
    if (c.pre_norms()) {  // llama.cpp's gpt-oss names the MLP's pre-norm post_attention_norm
      const char* norm = c.sandwich_norm ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight";
      add_vector(sink, params, p + norm, b + (c.attn_sinks ? "post_attention_norm.weight" : "ffn_norm.weight"));
    }
    if (c.post_norms()) add_vector(sink, params, p + "post_feedforward_layernorm.weight", b + "post_ffw_norm.weight");
    if (c.moe_layer(i)) {
      add_moe_tensors(c, params, sink, p + "mlp.", b);
      continue;
    }
    const std::string gate_up = p + "mlp.gate_up_proj.weight";
    if (phi3) {  // llama.cpp's phi3: one ffn_up of 2F rows, the first F gating (as Phi3MLP chunks it)
      add_matrix(sink, params, gate_up, b + "ffn_up.weight");
    } else {
      sink.add(b + "ffn_gate.weight", F, C, params.part(gate_up, 0, F * C));
      sink.add(b + "ffn_up.weight", F, C, params.part(gate_up, F * C, F * C));
    }
    add_matrix(sink, params, p + "mlp.down_proj.weight", b + "ffn_down.weight");
  }
  add_vector(sink, params, "model.norm.weight", "output_norm.weight");
  // A tied head has no output.weight: llama.cpp's llama then uses token_embd.
  if (!c.tie_embeddings) add_matrix(sink, params, "lm_head.weight", "output.weight");
  if (phi3) {  // LongRoPE's per-pair factors, dividing the frequencies as Loom's do (backend/rope.h)
    const RopeSpec r = c.rope();
    const std::vector<float> shorts(r.short_factor, r.short_factor + hd / 2), longs(r.long_factor, r.long_factor + hd / 2);
    sink.add("rope_factors_short.weight", 0, hd / 2, [shorts] { return Values::own(shorts); });
    sink.add("rope_factors_long.weight", 0, hd / 2, [longs] { return Values::own(longs); });
  }
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
    sink.add("rope_freqs.weight", 0, hd / 2, [factors] { return Values::own(factors); });
  }
}

// MoE as llama.cpp routes it (llama-graph.cpp build_moe_ffn): a softmax over the router's
// logits (plus its bias), the top k, renormalised over them (llama / qwen3moe: norm_w; gpt-oss:
// a softmax over the k selected logits, the same numbers), on every layer, without shared experts.
void check_moe_exportable(const ModelConfig& c) {
  const bool qwen3_next = c.linear_interval > 0;  // its gated shared expert: qwen3next's *_shexp
  LOOM_CHECK(c.arch == ARCH_LLAMA && c.moe_dense_layers == 0 && (c.moe_shared == 0 || qwen3_next) && !c.moe_sigmoid &&
                 (c.moe_renorm || c.moe_top_k == 1) && c.moe_route_scale == 1.0f && c.moe_groups == 1 &&
                 c.moe_capacity_factor == 0.0f && c.moe_bias_gamma == 0.0f && (!c.moe_shared_gate || qwen3_next),
             "model.moe_experts = ", c.moe_experts, ": GGUF export writes MoE as llama.cpp's stacked experts "
             "(llama, qwen3moe, gpt-oss, qwen3next): arch = llama, MoE on every layer (moe_dense_layers = 0), no shared "
             "experts but Qwen3-Next's, "
             "softmax routing renormalised over the top k (moe_sigmoid = false, moe_renorm = true), moe_route_scale = "
             "1, one group, no capacity factor and no bias balancing (moe_bias_gamma = 0)");
  LOOM_CHECK(!c.sandwich_norm && !c.post_norm && c.nope_interval == 0 && c.rope_scaling != ROPE_SCALING_LONGROPE &&
                 (c.attn_sinks || !c.qkv_bias),
             "model.moe_experts = ", c.moe_experts, ": GGUF export writes MoE with the layers of llama.cpp's llama "
             "(Mixtral), qwen3moe (q/k norms) or gpt-oss only: no sandwich or output norms, NoPE layers, LongRoPE or "
             "q/k/v biases outside gpt-oss");
  LOOM_CHECK(c.attn_sinks || !(c.moe_router_bias || c.moe_expert_bias), "model.moe_router_bias / moe_expert_bias: "
             "GGUF export writes router and expert biases only as llama.cpp's gpt-oss (with model.attn_sinks)");
}

// Qwen3-Next as llama.cpp's qwen3next (src/models/qwen3next.cpp): its layers are fixed there.
void check_qwen3_next_exportable(const ModelConfig& c) {
  LOOM_CHECK(c.attn_output_gate && c.qk_norm && !c.qk_norm_whole && c.moe_experts > 0 && c.moe_shared > 0 &&
                 c.moe_shared_gate && c.linear_value_dim == c.linear_key_dim && !c.qkv_bias && !c.attn_out_bias &&
                 !c.attn_sinks && !c.sandwich_norm && !c.post_norm && c.nope_interval == 0 && c.attn_window == 0 &&
                 c.gate_activation == GateActivation::silu && c.embed_scale == 0.0f &&
                 c.rope_scaling == ROPE_SCALING_NONE && !c.tie_embeddings,
             "model.linear_interval = ", c.linear_interval, ": GGUF export writes Qwen3-Next as llama.cpp's qwen3next, "
             "which has gated attention (attn_output_gate) with per-head q/k norms, MoE on every layer with a gated "
             "shared expert (moe_shared > 0, moe_shared_gate), linear_value_dim = linear_key_dim (its state is square), "
             "SwiGLU, an untied head, and no biases, sinks, windows, output norms or RoPE scaling");
}

// GPT-OSS as llama.cpp's gpt-oss (src/models/openai-moe.cpp): its layers are fixed there.
void check_gpt_oss_exportable(const ModelConfig& c) {
  LOOM_CHECK(c.moe_experts > 0 && c.qkv_bias && c.attn_out_bias && c.moe_router_bias && c.moe_expert_bias &&
                 c.gate_activation == GateActivation::swiglu_oai && !c.tie_embeddings && !c.qk_norm &&
                 !c.sandwich_norm && !c.post_norm && c.nope_interval == 0 && c.embed_scale == 0.0f &&
                 c.attn_window > 0 && c.window_pattern == 2 && c.rope_local_theta <= 0.0f,
             "model.attn_sinks: GGUF export writes GPT-OSS as llama.cpp's gpt-oss, which has MoE with router and "
             "expert biases (moe_router_bias, moe_expert_bias) and the clamped SwiGLU (gate_activation = swiglu_oai), "
             "q/k/v and o_proj biases, an untied head, no q/k or output norms, and a sliding window on even layers "
             "(attn_window > 0, window_pattern = 2)");
  // llama.cpp's YaRN (ggml_rope_yarn_corr_dims) rounds the ramp's ends and scales cos and sin by
  // 1 + 0.1 ln(factor), with beta_fast 32 and beta_slow 1 (read from no key for gpt-oss).
  const bool yarn = c.rope_scaling == ROPE_SCALING_YARN;
  LOOM_CHECK(c.rope_scaling == ROPE_SCALING_NONE ||
                 (yarn && c.rope_yarn_truncate && c.rope_beta_fast == 32.0f && c.rope_beta_slow == 1.0f &&
                  std::abs(c.rope_attention_factor - (0.1f * std::log(c.rope_factor) + 1.0f)) < 1e-6f),
             "model.rope_scaling = ", enum_name(c.rope_scaling), ": llama.cpp's gpt-oss runs YaRN with the ramp's ends "
             "rounded (model.rope_yarn_truncate = true; the release says false), rope_beta_fast = 32, rope_beta_slow "
             "= 1 and attention factor 1 + 0.1 ln(rope_factor), or no RoPE scaling");
}

void check_exportable(const ModelConfig& c, const GgufVocabulary& vocab) {
  LOOM_CHECK(!c.lora(), "peft.method = lora: GGUF export writes merged weights (loom convert merges the adapters first)");
  if (c.moe_experts > 0) check_moe_exportable(c);
  LOOM_CHECK(!c.mla(), "model.mla_kv_rank = ", c.mla_kv_rank, ": GGUF export does not support MLA models");
  if (c.linear_interval > 0) {
    check_qwen3_next_exportable(c);
  } else {
    LOOM_CHECK(!c.attn_output_gate && c.rope_fraction == 1.0f && !c.moe_shared_gate,
               "model.attn_output_gate / rope_fraction / moe_shared_gate (Qwen3-Next's gated attention, partial RoPE, "
               "gated shared expert): GGUF export writes them only as llama.cpp's qwen3next (with model.linear_interval)");
  }
  LOOM_CHECK(c.attn_sinks || !c.attn_out_bias, "model.attn_out_bias: GGUF export writes an o_proj bias only as "
             "llama.cpp's gpt-oss (with model.attn_sinks)");
  if (c.attn_sinks) {
    check_gpt_oss_exportable(c);
  } else if (c.sandwich_norm) {  // llama.cpp's gemma3 (llama-model.cpp: set_swa_pattern(6), rope_freq_base_train_swa 10000)
    LOOM_CHECK(c.qk_norm && !c.qk_norm_whole && c.gate_activation == GateActivation::gelu_tanh &&
                   c.embed_scale == std::sqrt(static_cast<float>(c.d_model)) && c.tie_embeddings && !c.qkv_bias &&
                   c.nope_interval == 0 && c.attn_window > 0 && c.window_pattern == 6 && c.rope_local_theta == 10000.0f &&
                   c.rope_scaling == ROPE_SCALING_NONE,
               "model.sandwich_norm: GGUF export writes Gemma 3 as llama.cpp's gemma3, which has per-head q/k norms, "
               "GeGLU, embed_scale = sqrt(d_model), a tied head, attn_window > 0 with window_pattern = 6 and "
               "rope_local_theta = 10000 (fixed in llama.cpp), and no RoPE scaling here");
  } else {
    LOOM_CHECK(c.attn_window == 0, "model.attn_window = ", c.attn_window,
               ": GGUF export does not support sliding-window attention (llama.cpp's gpt2/llama attend to every position)");
    LOOM_CHECK(c.gate_activation == GateActivation::silu && c.embed_scale == 0.0f,
               "model.gate_activation / embed_scale: GGUF export writes them only as llama.cpp's gemma3 (with sandwich norms)");
  }
  LOOM_CHECK(!(c.qk_norm && c.qkv_bias), "model.qk_norm with model.qkv_bias: no llama.cpp architecture has both");
  LOOM_CHECK(c.post_norm == c.qk_norm_whole && (!c.post_norm || (c.qk_norm && !c.qkv_bias && c.nope_interval == 0 &&
                                                                  c.rope_scaling == ROPE_SCALING_NONE)),
             "model.post_norm / qk_norm_whole: GGUF export writes them as llama.cpp's olmo2, which has both, q/k norms "
             "over all heads and no q/k/v biases, NoPE layers or RoPE scaling");
  LOOM_CHECK(c.nope_interval == 0 || (c.nope_interval == 4 && !c.qkv_bias && !c.qk_norm), "model.nope_interval = ",
             c.nope_interval, ": llama.cpp's smollm3 skips RoPE on every 4th layer only (n_no_rope_layer_step = 4, "
             "without q/k/v biases or q/k norms)");
  LOOM_CHECK(c.rope_scaling != ROPE_SCALING_LONGROPE || (!c.qkv_bias && !c.qk_norm && c.nope_interval == 0 &&
                                                          !c.sandwich_norm && !c.post_norm),
             "model.rope_scaling = longrope: GGUF export writes it as llama.cpp's phi3, without q/k/v biases, q/k norms, "
             "NoPE layers or output norms");
  LOOM_CHECK(c.attn_sinks || c.rope_scaling == ROPE_SCALING_NONE || c.rope_scaling == ROPE_SCALING_LINEAR ||
                 c.rope_scaling == ROPE_SCALING_LLAMA3 || c.rope_scaling == ROPE_SCALING_LONGROPE,
             "model.rope_scaling = ", enum_name(c.rope_scaling),
             ": GGUF export writes linear and llama3 scaling (rope_freqs) and longrope (phi3), not yarn yet");
  LOOM_CHECK(c.attn_sinks || !(c.qkv_bias || c.qk_norm) || c.rope_scaling == ROPE_SCALING_NONE, "model.qkv_bias / qk_norm with "
             "model.rope_scaling = ", enum_name(c.rope_scaling), ": GGUF export writes Qwen2 / Qwen3 as llama.cpp's "
             "qwen2 / qwen3, without RoPE scaling");
  LOOM_CHECK(c.arch == ARCH_LLAMA || c.head_dim() * c.n_head == c.d_model, "model.head_size = ", c.head_size,
             ": llama.cpp's gpt2 needs head_size = d_model / n_head");
  LOOM_CHECK(static_cast<int64_t>(vocab.tokens.size()) == c.vocab_size, "the tokenizer has ", vocab.tokens.size(),
             " tokens but model.vocab_size = ", c.vocab_size);
}

// llama.cpp (llama-vocab.cpp) takes a model whose general.name holds "phi3" or "phi-3" for Phi-3
// and sets attributes on Phi-3's own tokens, failing to load the file ("_Map_base::at") when one
// is missing: refused here, naming --name, before anything is written.
void check_name(const std::string& name, const GgufVocabulary& vocab) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (lower.find("phi3") == std::string::npos && lower.find("phi-3") == std::string::npos) return;
  for (const char* token : {"</s>", "<unk>", "<s>", "<|endoftext|>"}) {
    LOOM_CHECK(std::find(vocab.tokens.begin(), vocab.tokens.end(), token) != vocab.tokens.end(), "--name '", name,
               "': llama.cpp takes a model so named for Phi-3 and looks up its token ", token,
               ", which this tokenizer lacks (the file would not load); choose a name without \"phi3\"");
  }
}

void put_arch(GgufWriter& w, const ModelConfig& c) {
  const std::string a = gguf_arch(c);
  w.put("general.architecture", GgufValue::string(a));
  w.put(a + ".vocab_size", GgufValue::u32(static_cast<uint32_t>(c.vocab_size)));
  w.put(a + ".context_length", GgufValue::u32(static_cast<uint32_t>(c.max_seq_len)));
  w.put(a + ".embedding_length", GgufValue::u32(static_cast<uint32_t>(c.d_model)));
  w.put(a + ".block_count", GgufValue::u32(static_cast<uint32_t>(c.n_layer)));
  // llama's MoE (Mixtral) reads its experts' width here; qwen3moe and gpt-oss from expert_feed_forward_length.
  w.put(a + ".feed_forward_length", GgufValue::u32(static_cast<uint32_t>(c.moe_experts > 0 ? c.expert_ff() : c.d_ff)));
  if (c.moe_experts > 0) {
    w.put(a + ".expert_count", GgufValue::u32(static_cast<uint32_t>(c.moe_experts)));
    w.put(a + ".expert_used_count", GgufValue::u32(static_cast<uint32_t>(c.moe_top_k)));
    w.put(a + ".expert_feed_forward_length", GgufValue::u32(static_cast<uint32_t>(c.expert_ff())));
  }
  w.put(a + ".attention.head_count", GgufValue::u32(static_cast<uint32_t>(c.n_head)));
  if (c.arch == ARCH_GPT2) {
    w.put(a + ".attention.layer_norm_epsilon", GgufValue::f32(c.norm_eps));
    return;
  }
  w.put(a + ".attention.head_count_kv", GgufValue::u32(static_cast<uint32_t>(c.n_kv_head)));
  w.put(a + ".attention.layer_norm_rms_epsilon", GgufValue::f32(c.norm_eps));
  w.put(a + ".rope.freq_base", GgufValue::f32(c.rope_theta));
  // The rotating dims of a head (Qwen3-Next's partial RoPE: the first rotary_dim, NEOX halves).
  w.put(a + ".rope.dimension_count", GgufValue::u32(static_cast<uint32_t>(c.rotary_dim() > 0 ? c.rotary_dim() : c.head_dim())));
  if (c.head_dim() * c.n_head != c.d_model || c.attn_sinks || c.linear_interval > 0) {
    w.put(a + ".attention.key_length", GgufValue::u32(static_cast<uint32_t>(c.head_dim())));
    w.put(a + ".attention.value_length", GgufValue::u32(static_cast<uint32_t>(c.head_dim())));
  }
  if (c.attn_window > 0) w.put(a + ".attention.sliding_window", GgufValue::u32(static_cast<uint32_t>(c.attn_window)));
  if (c.linear_interval > 0) {  // qwen3next: layer i is linear unless (i + 1) % interval == 0, as Loom's
    const auto u32 = [](int64_t v) { return GgufValue::u32(static_cast<uint32_t>(v)); };
    w.put(a + ".full_attention_interval", u32(c.linear_interval));
    w.put(a + ".ssm.conv_kernel", u32(c.linear_conv_taps));
    w.put(a + ".ssm.state_size", u32(c.linear_key_dim));
    w.put(a + ".ssm.group_count", u32(c.linear_key_heads));
    w.put(a + ".ssm.time_step_rank", u32(c.linear_value_heads));
    w.put(a + ".ssm.inner_size", u32(c.linear_value_heads * c.linear_value_dim));
    w.put(a + ".expert_shared_feed_forward_length", u32(c.moe_shared * c.expert_ff()));
  }
  if (c.rope_scaling == ROPE_SCALING_YARN) {  // gpt-oss (check_gpt_oss_exportable)
    w.put(a + ".rope.scaling.type", GgufValue::string("yarn"));
    w.put(a + ".rope.scaling.factor", GgufValue::f32(c.rope_factor));
    w.put(a + ".rope.scaling.original_context_length", GgufValue::u32(static_cast<uint32_t>(c.rope_original_context)));
  }
  if (c.rope_scaling == ROPE_SCALING_LONGROPE) {  // llama.cpp picks the long factors for contexts past this
    w.put(a + ".rope.scaling.attn_factor", GgufValue::f32(c.rope_attention_factor));
    w.put(a + ".rope.scaling.original_context_length", GgufValue::u32(static_cast<uint32_t>(c.rope_original_context)));
  }
}

}  // namespace

GgufExportSummary export_gguf(ParamReader& params, const GgufVocabulary& vocab, GgufExportType type,
                              const std::string& name, const std::string& path) {
  const ModelConfig& config = params.config();
  check_exportable(config, vocab);
  check_name(name, vocab);
  GgufWriter writer;
  put_arch(writer, config);
  writer.put("general.name", GgufValue::string(name));
  writer.put("general.file_type", GgufValue::u32(file_type(type)));
  writer.put("general.quantization_version", GgufValue::u32(2));  // GGML_QNT_VERSION
  put_gguf_tokenizer(writer, vocab);
  const Params named(params);
  TensorSink sink(writer, type);
  if (config.arch == ARCH_GPT2) add_gpt2_tensors(config, named, sink);
  else if (config.linear_interval > 0) add_qwen3_next_tensors(config, named, sink);
  else add_llama_tensors(config, named, sink);
  writer.write(path);
  return {gguf_arch(config), sink.tensors(), sink.converted(), static_cast<uint64_t>(std::filesystem::file_size(path))};
}

GgufExportSummary export_gguf(const ModelConfig& config, std::span<const float> params, const GgufVocabulary& vocab,
                              GgufExportType type, const std::string& name, const std::string& path) {
  const auto reader = flat_param_reader(config, params);
  return export_gguf(*reader, vocab, type, name, path);
}

}  // namespace loom
