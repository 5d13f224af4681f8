// One config schema for the decoder-only models Loom builds. The architecture decides the
// block's pieces:
//   gpt2:  learned positions, LayerNorm, GELU MLP, MHA, biases, head tied to the embedding
//   llama: RoPE, RMSNorm, SwiGLU MLP, GQA, no biases, untied head
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "loom/backend/activation.h"
#include "loom/backend/rope.h"
#include "loom/core/enum_names.h"

namespace loom {

enum Arch : uint8_t { ARCH_GPT2, ARCH_LLAMA, ARCH_COUNT };

std::string_view arch_name(Arch arch);
Arch arch_from_name(std::string_view name);  // throws naming the accepted values

// Parameter-efficient fine-tuning (docs/finetune.md): none, or LoRA adapters (Hu et al. 2021)
// on the linear layers peft.targets names, the base weights frozen.
enum class PeftMethod : uint8_t { none, lora };
template <>
struct EnumNames<PeftMethod> {  // peft.method
  static constexpr std::array<std::string_view, 2> names{"none", "lora"};
};

// The linear layers LoRA can adapt, by the short names of peft.targets. Llama-family models
// fuse q/k/v and gate/up into one matrix each: an adapter covers its rows of the fused output.
// GPT-2's c_attn is one matrix in Hugging Face's model too: any of q, k, v adapts it whole.
enum LoraTarget : uint8_t { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_TARGET_COUNT };
template <>
struct EnumNames<LoraTarget> {
  static constexpr std::array<std::string_view, 7> names{"q", "k", "v", "o", "gate", "up", "down"};
};

struct ModelConfig {
  Arch arch = ARCH_GPT2;
  int64_t vocab_size = 50257;
  int64_t max_seq_len = 1024;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_kv_head = 12;
  int64_t d_model = 768;
  int64_t d_ff = 3072;
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  // RoPE's long-context rescaling (backend/rope.h): none, linear (positions / rope_factor),
  // llama3 (Llama 3.1 / 3.2: low frequencies / rope_factor, high ones kept, a blend between,
  // set by rope_low_freq_factor, rope_high_freq_factor and rope_original_context) or yarn (a
  // ramp between rope_beta_fast and rope_beta_slow rotations, cos and sin times
  // rope_attention_factor).
  RopeScaling rope_scaling = ROPE_SCALING_NONE;
  float rope_factor = 1.0f;
  float rope_low_freq_factor = 1.0f;
  float rope_high_freq_factor = 4.0f;
  int64_t rope_original_context = 8192;
  float rope_beta_fast = 32.0f;
  float rope_beta_slow = 1.0f;
  float rope_attention_factor = 1.0f;
  bool rope_yarn_truncate = true;  // yarn: round the ramp's ends (transformers' truncate; GPT-OSS: false)
  // longrope (Phi-3 128k): the pairs' short and long factors, head_dim / 2 comma-separated numbers
  // each; the long ones apply to a span reaching past rope_original_context.
  std::string rope_short_factors, rope_long_factors;
  float init_std = 0.02f;
  // Attention head width; 0: d_model / n_head. A tensor-parallel rank's slice of a model keeps
  // the whole model's head width with n_head / tp heads (parallel/tensor_parallel.h).
  int64_t head_size = 0;
  // Sliding-window attention (Beltagy et al. 2020, Longformer; Jiang et al. 2023, Mistral 7B):
  // 0: full causal attention; W > 0: position i attends to positions j with i - W < j <= i,
  // in training and in decoding (docs/inference.md).
  int64_t attn_window = 0;
  // Interleaved local and global attention (Gemma 3): with attn_window, N > 0 makes every N-th
  // block (layers N-1, 2N-1, ...) attend globally and the others within the window; 0: every block
  // windowed. The windowed blocks rotate with base rope_local_theta (> 0; Gemma 3's
  // rope_local_base_freq) and no scaling, the global ones with rope_theta and rope_scaling.
  int64_t window_pattern = 0;
  float rope_local_theta = 0.0f;
  // Llama-family variants (gpt2 always has both): biases on the q/k/v projections (Qwen2 /
  // Qwen2.5), and the output head tied to the token embedding (Llama 3.2 1B / 3B, Qwen2 0.5B).
  bool qkv_bias = false;
  bool tie_embeddings = false;
  // NoPE layers (SmolLM3; Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length
  // Generalization in Transformers"): N > 0 skips RoPE on every N-th block (layers N-1, 2N-1, ...),
  // whose queries and keys carry no position; 0: RoPE on every block. Llama only, not with MLA.
  int64_t nope_interval = 0;
  // Qwen3: each query and key head RMS-normed over its head_dim (weights q_norm, k_norm of
  // head_dim, shared by the heads) after the projection and before RoPE.
  bool qk_norm = false;
  // OLMo 2: with qk_norm, one RMSNorm over all the query heads (weight of H hd) and one over all
  // the key heads (KV hd) instead of one per head.
  bool qk_norm_whole = false;
  // OLMo 2 (OLMo et al. 2024, "2 OLMo 2 Furious", §3.1): each block normalises its attention's and
  // its MLP's outputs before the residual add, h = x + norm(attn(x)), out = h + norm(mlp(h)),
  // in place of the pre-norms of their inputs. Llama only, without MLA or MoE.
  bool post_norm = false;
  // Gemma 2 / 3 ("sandwich" norms): each sub-layer's input and output normed, h = x +
  // norm_post(attn(norm_pre(x))), out = h + norm_post(mlp(norm_pre(h))). Llama only, without MLA or MoE.
  bool sandwich_norm = false;
  // The gated MLP's activation (backend/activation.h): silu (SwiGLU) or gelu_tanh (GeGLU, Gemma).
  GateActivation gate_activation = GateActivation::silu;
  // The token embeddings' rows are multiplied by this (Gemma: sqrt(d_model)); 0: none. Llama only.
  float embed_scale = 0.0f;
  // Partial rotary embedding (Qwen3-Next's partial_rotary_factor: 0.25): only the first
  // rope_fraction x head_dim dims of each query and key head rotate (backend/rope.h rotary_dim).
  float rope_fraction = 1.0f;
  // Gated attention output (Qwen3-Next; Qiu et al. 2025, "Gated Attention for Large Language
  // Models"): a projection of the block's normed input (H hd rows, self_attn.gate_proj) gates each
  // head's attention output elementwise by its sigmoid before o_proj. Llama only.
  bool attn_output_gate = false;
  // GPT-OSS: attention sinks (a learned per-head logit in each softmax's denominator; Backend::
  // attention_sink_*), a bias on the output projection, and MoE routers and experts with biases.
  bool attn_sinks = false;
  bool attn_out_bias = false;
  bool moe_router_bias = false;
  bool moe_expert_bias = false;
  // Linear attention (Qwen3-Next's hybrid layout; nn/linear_attention.h): N > 0 makes every N-th
  // block (layers N-1, 2N-1, ...) a full-attention block and the others gated DeltaNet blocks of
  // linear_key_heads key heads of linear_key_dim, linear_value_heads value heads of
  // linear_value_dim (a multiple of the key heads) and a causal conv of linear_conv_taps taps;
  // 0: every block full attention.
  int64_t linear_interval = 0;
  int64_t linear_key_heads = 0;
  int64_t linear_value_heads = 0;
  int64_t linear_key_dim = 0;
  int64_t linear_value_dim = 0;
  int64_t linear_conv_taps = 4;
  // Multi-head Latent Attention (DeepSeek-AI 2024, DeepSeek-V2 §2.1; nn/mla.h), Llama only.
  // mla_kv_rank = d_c > 0: keys and values come from a d_c-wide compressed latent (RMS-normed)
  // plus one decoupled RoPE key of mla_rope_dim = d_r shared by the heads; per head queries and
  // keys are mla_nope_dim (d_n; 0: head_dim) + d_r wide, values mla_v_dim (d_v; 0: head_dim);
  // mla_q_rank = d_q > 0 compresses the queries too (0: projected from the input). The KV cache
  // keeps d_c + d_r floats per position and layer. 0: standard MHA / GQA attention.
  int64_t mla_kv_rank = 0;
  int64_t mla_rope_dim = 0;
  int64_t mla_nope_dim = 0;
  int64_t mla_v_dim = 0;
  int64_t mla_q_rank = 0;
  float mla_score_scale = 1.0f;  // the scores' scale is mla_score_scale / sqrt(d_n + d_r) (DeepSeek's YaRN mscale^2)

  // Mixture of experts (nn/moe.h, docs/moe.md). moe_experts = 0: every block has the dense
  // MLP. Otherwise blocks from moe_dense_layers on route each token to moe_top_k of moe_experts
  // experts (each an MLP of width moe_d_ff, or d_ff when 0) plus moe_shared always-on experts.
  int64_t moe_experts = 0;
  int64_t moe_top_k = 2;
  int64_t moe_d_ff = 0;
  int64_t moe_shared = 0;
  int64_t moe_dense_layers = 0;
  bool moe_sigmoid = false;         // router scores: softmax (false) or sigmoid (DeepSeek-V3)
  bool moe_renorm = true;           // gates renormalised over the selected experts
  float moe_route_scale = 1.0f;     // gates scaled after renormalisation (DeepSeek-V3: 2.5)
  int64_t moe_groups = 1;           // group-limited routing: experts in moe_groups groups,
  int64_t moe_topk_groups = 1;      //   tokens routed inside the best moe_topk_groups
  float moe_capacity_factor = 0.0f;  // > 0: capacity ceil(k N / E x factor), overflow dropped; 0: dropless
  float moe_aux_alpha = 0.0f;       // Switch/GShard load-balancing loss coefficient (1e-2 typical)
  float moe_seq_aux_alpha = 0.0f;   // DeepSeek-V3 sequence-wise balance loss (1e-4)
  float moe_z_alpha = 0.0f;         // router z-loss (ST-MoE: 1e-3)
  float moe_bias_gamma = 0.0f;      // auxiliary-loss-free balancing bias speed (DeepSeek-V3: 1e-3)
  bool moe_shared_gate = false;     // the shared experts' output times sigmoid(x . w) (Qwen2-MoE / Qwen3-Next's shared_expert_gate)

  // LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): each targeted
  // linear layer y = W x becomes y = W x + s B A x with A (r, in), B (out, r), r = lora_rank and
  // s = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023). The adapters
  // are parameters of their own at the end of the flat layout; everything else is frozen.
  PeftMethod peft_method = PeftMethod::none;
  int64_t lora_rank = 8;
  float lora_alpha = 16.0f;
  bool lora_rslora = false;
  std::string lora_targets = "q,v";
  // QLoRA (Dettmers et al. 2023): the frozen base's block matrices stored in NF4 with
  // double-quantized scales and dequantized on the fly (model/transformer.h quantize_base).
  bool lora_quantize_base = false;
  float lora_dropout = 0.0f;  // PEFT's lora_dropout: the adapters' input dropped out in training
  // DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation"; PEFT's use_dora): each
  // adapted row j becomes m_j (W + s B A)_j / ||(W + s B A)_j|| with a trained magnitude m,
  // initialised to ||W_j|| (nn/lora.h).
  bool lora_dora = false;

  int64_t head_dim() const { return head_size > 0 ? head_size : d_model / n_head; }
  // The q/k norms' widths (qk_norm): a head's, or all the query / key heads' (qk_norm_whole).
  int64_t q_norm_width() const { return qk_norm_whole ? n_head * head_dim() : head_dim(); }
  int64_t k_norm_width() const { return qk_norm_whole ? n_kv_head * head_dim() : head_dim(); }
  int64_t qkv_width() const { return (n_head + 2 * n_kv_head) * head_dim(); }
  bool mla() const { return mla_kv_rank > 0; }
  int64_t mla_nope() const { return mla_nope_dim > 0 ? mla_nope_dim : head_dim(); }  // d_n
  int64_t mla_v() const { return mla_v_dim > 0 ? mla_v_dim : head_dim(); }           // d_v
  int64_t mla_qk() const { return mla_nope() + mla_rope_dim; }                      // d_n + d_r
  // Width of the attention output (the input of the output projection): H d_v for MLA, H hd else.
  int64_t attn_width() const { return n_head * (mla() ? mla_v() : head_dim()); }
  // Whether block `layer` is a gated DeltaNet (linear-attention) block (model.linear_interval).
  bool linear_layer(int64_t layer) const { return linear_interval > 0 && (layer + 1) % linear_interval != 0; }
  // Floats of one sequence's recurrent state in a linear-attention block: the conv's last K-1
  // inputs of its 2 H_k d_k + H_v d_v channels and the delta rule's H_v d_k d_v.
  int64_t linear_state_floats() const {
    return (linear_conv_taps - 1) * (2 * linear_key_heads * linear_key_dim + linear_value_heads * linear_value_dim) +
           linear_value_heads * linear_key_dim * linear_value_dim;
  }
  // Blocks of each kind: full attention (KV cache rows) and linear attention (recurrent state).
  int64_t linear_layer_count() const {
    int64_t n = 0;
    for (int64_t l = 0; l < n_layer; ++l) n += linear_layer(l) ? 1 : 0;
    return n;
  }
  bool has_bias() const { return arch == ARCH_GPT2; }
  bool learned_positions() const { return arch == ARCH_GPT2; }
  // Whether block `layer` rotates its queries and keys (model.nope_interval skips every N-th).
  bool rope_layer(int64_t layer) const {
    return !learned_positions() && !(nope_interval > 0 && (layer + 1) % nope_interval == 0);
  }
  // Block `layer`'s sliding window (model.attn_window, window_pattern's global blocks: 0).
  int64_t layer_window(int64_t layer) const {
    return window_pattern > 0 && (layer + 1) % window_pattern == 0 ? 0 : attn_window;
  }
  // Whether every block attends within attn_window (a decoder may then forget older positions).
  bool windowed_everywhere() const { return attn_window > 0 && (window_pattern == 0 || window_pattern > n_layer); }
  // The RoPE the rope ops apply (theta and the scaling above; longrope's lists parsed).
  RopeSpec rope() const;
  // Block `layer`'s RoPE: window_pattern's windowed blocks rotate with rope_local_theta, unscaled.
  RopeSpec rope(int64_t layer) const {
    if (window_pattern == 0 || rope_local_theta <= 0.0f || layer_window(layer) == 0) return rope();
    RopeSpec local;
    local.theta = rope_local_theta;
    local.rotary_dim = rotary_dim();
    return local;
  }
  // The rotating dims of a head (model.rope_fraction: int(head_dim x fraction), as transformers);
  // 0: all of them.
  int64_t rotary_dim() const {
    return rope_fraction < 1.0f ? static_cast<int64_t>(static_cast<double>(head_dim()) * rope_fraction) : 0;
  }
  // Which norms a block's sub-layers apply: their inputs' (pre, all but model.post_norm) and their
  // outputs' (post: model.post_norm or model.sandwich_norm).
  bool pre_norms() const { return !post_norm; }
  bool post_norms() const { return post_norm || sandwich_norm; }
  bool tied_head() const { return arch == ARCH_GPT2 || tie_embeddings; }
  bool rmsnorm() const { return arch == ARCH_LLAMA; }
  // Whether the MLP is gated (llama: [gate | up], act(gate) * up with gate_activation) or plain GELU (gpt2).
  bool gated_mlp() const { return arch == ARCH_LLAMA; }
  // Width of the MLP's first GEMM output: F (GELU) or 2F ([gate | up], gated).
  int64_t mlp_in_width() const { return gated_mlp() ? 2 * d_ff : d_ff; }
  // Mixture of experts: whether block `layer` is an MoE block, an expert's width and its first
  // GEMM's output width.
  bool moe_layer(int64_t layer) const { return moe_experts > 0 && layer >= moe_dense_layers; }
  int64_t expert_ff() const { return moe_d_ff > 0 ? moe_d_ff : d_ff; }
  int64_t expert_in_width() const { return gated_mlp() ? 2 * expert_ff() : expert_ff(); }

  bool lora() const { return peft_method == PeftMethod::lora; }
  float lora_scale() const;             // s above
  uint32_t lora_target_mask() const;    // bit LoraTarget; throws naming peft.targets

  void validate() const;  // throws naming the offending key (e.g. "model.n_head")
};

// Whether a forward over `positions` positions rotates with LongRoPE's long factors (backend/rope.h
// rope_span): such a sequence must run in one forward, not in chunks of rows.
inline bool crosses_longrope_context(const ModelConfig& c, int64_t positions) {
  return c.rope_scaling == ROPE_SCALING_LONGROPE && positions > c.rope_original_context;
}

// The model config's schema, written once. Each field: its key in a config file's [model]
// table, where a checkpoint's model_config JSON keeps it (at the top level always, at the top
// level only when set, or inside the "rope_scaling" / "mla" / "moe" object written only for such models, so that
// other checkpoints keep their bytes) under which name, and its meaning. The config file
// (train/config.cpp), checkpoints (checkpoint/checkpoint.cpp) and `loom train --help` read it.
struct ModelField {
  enum Place : uint8_t { ALWAYS, IF_SET, ROPE, MLA, MOE, PEFT };
  const char* key;      // model.<key> (peft.<key> for PEFT)
  Place place;          // where the checkpoint's model_config keeps it
  const char* json;     // its name there
  const char* meaning;  // one line for --help and docs/config.md
};
// The enums of the schema, read and written by their EnumNames.
template <class T>
inline constexpr bool kModelEnum = std::is_same_v<T, RopeScaling> || std::is_same_v<T, PeftMethod> ||
                                   std::is_same_v<T, GateActivation>;
// A field's key in a config file: model.<key>, or peft.<key> for the PEFT group.
inline std::string model_field_key(const ModelField& f) {
  return std::string(f.place == ModelField::PEFT ? "peft." : "model.") + f.key;
}
// visit(field, value) for every field of `c` in schema order (`value` an int64_t, float, bool,
// std::string, Arch or a model enum (kModelEnum: RopeScaling, PeftMethod, GateActivation) lvalue,
// const when c is).
template <class Config, class Visit>
void visit_model_fields(Config& c, Visit&& visit) {
  visit(ModelField{"arch", ModelField::ALWAYS, "arch",
                    "gpt2 (learned positions, LayerNorm, GELU, biases, tied head) | llama (RoPE, RMSNorm, SwiGLU, GQA, untied head)"},
        c.arch);
  visit(ModelField{"vocab_size", ModelField::ALWAYS, "vocab_size",
                    "tokens in the vocabulary; 0 = the dataset's (data.dir/meta.json)"},
        c.vocab_size);
  visit(ModelField{"max_seq_len", ModelField::ALWAYS, "max_seq_len",
                    "longest sequence the model takes (gpt2: rows of the learned position table)"},
        c.max_seq_len);
  visit(ModelField{"n_layer", ModelField::ALWAYS, "n_layer",
                    "transformer blocks"},
        c.n_layer);
  visit(ModelField{"n_head", ModelField::ALWAYS, "n_head",
                    "attention (query) heads"},
        c.n_head);
  visit(ModelField{"n_kv_head", ModelField::ALWAYS, "n_kv_head",
                    "key/value heads, dividing n_head (llama: GQA, 1 = MQA; gpt2: must equal n_head)"},
        c.n_kv_head);
  visit(ModelField{"d_model", ModelField::ALWAYS, "d_model",
                    "width of the residual stream"},
        c.d_model);
  visit(ModelField{"d_ff", ModelField::ALWAYS, "d_ff",
                    "hidden width of the MLP (SwiGLU: of its gate and of its up projection)"},
        c.d_ff);
  visit(ModelField{"norm_eps", ModelField::ALWAYS, "norm_eps",
                    "epsilon of LayerNorm / RMSNorm"},
        c.norm_eps);
  visit(ModelField{"rope_theta", ModelField::ALWAYS, "rope_theta",
                    "RoPE base frequency (llama)"},
        c.rope_theta);
  visit(ModelField{"rope_scaling", ModelField::ROPE, "type",
                    "RoPE long-context rescaling (llama): none | linear (positions / rope_factor) | llama3 (Llama 3.1: low frequencies / rope_factor, blended by the next keys)"},
        c.rope_scaling);
  visit(ModelField{"rope_factor", ModelField::ROPE, "factor",
                    "RoPE scaling factor (linear, llama3)"},
        c.rope_factor);
  visit(ModelField{"rope_low_freq_factor", ModelField::ROPE, "low_freq_factor",
                    "llama3 RoPE scaling: wavelengths above rope_original_context / this are divided by rope_factor"},
        c.rope_low_freq_factor);
  visit(ModelField{"rope_high_freq_factor", ModelField::ROPE, "high_freq_factor",
                    "llama3 RoPE scaling: wavelengths below rope_original_context / this keep their frequency"},
        c.rope_high_freq_factor);
  visit(ModelField{"rope_original_context", ModelField::ROPE, "original_context",
                    "llama3 RoPE scaling: the context length the model was pre-trained with"},
        c.rope_original_context);
  visit(ModelField{"rope_beta_fast", ModelField::ROPE, "beta_fast",
                    "yarn RoPE scaling: pairs turning more than this many times over rope_original_context keep their frequency"},
        c.rope_beta_fast);
  visit(ModelField{"rope_beta_slow", ModelField::ROPE, "beta_slow",
                    "yarn RoPE scaling: pairs turning fewer than this many times are divided by rope_factor (a ramp between)"},
        c.rope_beta_slow);
  visit(ModelField{"rope_attention_factor", ModelField::ROPE, "attention_factor",
                    "yarn RoPE scaling: cos and sin are multiplied by it (YaRN's attention factor)"},
        c.rope_attention_factor);
  visit(ModelField{"rope_yarn_truncate", ModelField::IF_SET, "rope_yarn_truncate",
                    "yarn RoPE scaling: round the ramp's ends to whole pairs (transformers' truncate; GPT-OSS: false)"},
        c.rope_yarn_truncate);
  visit(ModelField{"rope_short_factors", ModelField::IF_SET, "rope_short_factors",
                    "longrope RoPE scaling: head_dim / 2 comma-separated factors dividing the pairs' frequencies within rope_original_context"},
        c.rope_short_factors);
  visit(ModelField{"rope_long_factors", ModelField::IF_SET, "rope_long_factors",
                    "longrope RoPE scaling: the factors of a span reaching past rope_original_context (LongRoPE's long list)"},
        c.rope_long_factors);
  visit(ModelField{"init_std", ModelField::ALWAYS, "init_std",
                    "standard deviation of the normal weight initialisation"},
        c.init_std);
  visit(ModelField{"attn_window", ModelField::IF_SET, "attn_window",
                    "sliding-window attention: 0 = full causal; W > 0 = position i attends to i-W < j <= i (not with parallel.cp > 1)"},
        c.attn_window);
  visit(ModelField{"window_pattern", ModelField::IF_SET, "window_pattern",
                    "with attn_window: N > 0 = every N-th block (layers N-1, 2N-1, ...) attends globally, the others within the window (Gemma 3: 6); 0 = every block windowed"},
        c.window_pattern);
  visit(ModelField{"rope_local_theta", ModelField::IF_SET, "rope_local_theta",
                    "with window_pattern: RoPE base of the windowed blocks, unscaled (Gemma 3's rope_local_base_freq); 0 = rope_theta and rope_scaling"},
        c.rope_local_theta);
  visit(ModelField{"qkv_bias", ModelField::IF_SET, "qkv_bias",
                    "llama: biases on the q/k/v projections (Qwen2); gpt2 always has biases"},
        c.qkv_bias);
  visit(ModelField{"tie_embeddings", ModelField::IF_SET, "tie_embeddings",
                    "llama: the output head is the token embedding (Llama 3.2 1B/3B, Qwen2 0.5B); gpt2 always ties"},
        c.tie_embeddings);
  visit(ModelField{"nope_interval", ModelField::IF_SET, "nope_interval",
                    "llama: N > 0 = every N-th block (layers N-1, 2N-1, ...) has no RoPE (SmolLM3's NoPE layers); 0 = RoPE on every block"},
        c.nope_interval);
  visit(ModelField{"qk_norm", ModelField::IF_SET, "qk_norm",
                    "llama: RMSNorm of each query and key head before RoPE (Qwen3; not with MLA)"},
        c.qk_norm);
  visit(ModelField{"qk_norm_whole", ModelField::IF_SET, "qk_norm_whole",
                    "llama with qk_norm: one norm over all query heads and one over all key heads (OLMo 2), not one per head (not with parallel.tp > 1)"},
        c.qk_norm_whole);
  visit(ModelField{"post_norm", ModelField::IF_SET, "post_norm",
                    "llama: the blocks normalise the attention and MLP outputs before the residual add (OLMo 2), not their inputs"},
        c.post_norm);
  visit(ModelField{"sandwich_norm", ModelField::IF_SET, "sandwich_norm",
                    "llama: the blocks normalise both the inputs and the outputs of attention and MLP (Gemma 2/3's pre and post norms)"},
        c.sandwich_norm);
  visit(ModelField{"gate_activation", ModelField::IF_SET, "gate_activation",
                    "llama's gated MLP: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma's gelu_pytorch_tanh) | sigmoid (GLU) | swiglu_oai (GPT-OSS's clamped SwiGLU)"},
        c.gate_activation);
  visit(ModelField{"embed_scale", ModelField::IF_SET, "embed_scale",
                    "llama: the token embeddings are multiplied by this (Gemma: sqrt(d_model)); 0 = none"},
        c.embed_scale);
  visit(ModelField{"rope_fraction", ModelField::IF_SET, "rope_fraction",
                    "llama: the fraction of each head's dims that RoPE rotates (Qwen3-Next's partial_rotary_factor: 0.25); 1 = all"},
        c.rope_fraction);
  visit(ModelField{"attn_output_gate", ModelField::IF_SET, "attn_output_gate",
                    "llama: each head's attention output times sigmoid of its own projection of the normed input (Qwen3-Next's gated attention)"},
        c.attn_output_gate);
  visit(ModelField{"attn_sinks", ModelField::IF_SET, "attn_sinks",
                    "llama: a learned logit per head joins each attention softmax's denominator (GPT-OSS's sinks; runs flash attention)"},
        c.attn_sinks);
  visit(ModelField{"attn_out_bias", ModelField::IF_SET, "attn_out_bias",
                    "llama: a bias on the attention output projection (GPT-OSS; with qkv_bias: attention_bias)"},
        c.attn_out_bias);
  visit(ModelField{"moe_router_bias", ModelField::IF_SET, "moe_router_bias",
                    "MoE: a trained bias on the router's logits (GPT-OSS)"},
        c.moe_router_bias);
  visit(ModelField{"moe_expert_bias", ModelField::IF_SET, "moe_expert_bias",
                    "MoE: biases on each expert's two projections (GPT-OSS)"},
        c.moe_expert_bias);
  visit(ModelField{"linear_interval", ModelField::IF_SET, "linear_interval",
                    "llama: N > 0 = every N-th block (layers N-1, 2N-1, ...) full attention, the others gated DeltaNet linear attention (Qwen3-Next: 4; split by heads with parallel.tp, its state relayed along parallel.cp); 0 = none"},
        c.linear_interval);
  visit(ModelField{"linear_key_heads", ModelField::IF_SET, "linear_key_heads",
                    "gated DeltaNet: query/key heads"},
        c.linear_key_heads);
  visit(ModelField{"linear_value_heads", ModelField::IF_SET, "linear_value_heads",
                    "gated DeltaNet: value heads (a multiple of linear_key_heads)"},
        c.linear_value_heads);
  visit(ModelField{"linear_key_dim", ModelField::IF_SET, "linear_key_dim",
                    "gated DeltaNet: width of a query/key head"},
        c.linear_key_dim);
  visit(ModelField{"linear_value_dim", ModelField::IF_SET, "linear_value_dim",
                    "gated DeltaNet: width of a value head"},
        c.linear_value_dim);
  visit(ModelField{"linear_conv_taps", ModelField::IF_SET, "linear_conv_taps",
                    "gated DeltaNet: taps of the causal depthwise convolution over [q | k | v]"},
        c.linear_conv_taps);
  visit(ModelField{"mla_kv_rank", ModelField::MLA, "kv_rank",
                    "Multi-head Latent Attention (llama only): width d_c of the compressed KV latent; 0 = standard MHA / GQA"},
        c.mla_kv_rank);
  visit(ModelField{"mla_rope_dim", ModelField::MLA, "rope_dim",
                    "MLA: width d_r of the decoupled RoPE key shared by the heads"},
        c.mla_rope_dim);
  visit(ModelField{"mla_nope_dim", ModelField::MLA, "nope_dim",
                    "MLA: per-head query/key width without RoPE (d_n); 0 = head_dim"},
        c.mla_nope_dim);
  visit(ModelField{"mla_v_dim", ModelField::MLA, "v_dim",
                    "MLA: per-head value width (d_v); 0 = head_dim"},
        c.mla_v_dim);
  visit(ModelField{"mla_q_rank", ModelField::MLA, "q_rank",
                    "MLA: width d_q of the compressed query latent; 0 = queries projected from the input"},
        c.mla_q_rank);
  visit(ModelField{"mla_score_scale", ModelField::MLA, "score_scale",
                    "MLA: the attention scores' scale is this / sqrt(d_n + d_r) (DeepSeek's YaRN: mscale^2)"},
        c.mla_score_scale);
  visit(ModelField{"moe_experts", ModelField::MOE, "experts",
                    "mixture of experts: routed experts per MoE block; 0 = every block has the dense MLP"},
        c.moe_experts);
  visit(ModelField{"moe_top_k", ModelField::MOE, "top_k",
                    "MoE: experts each token is routed to"},
        c.moe_top_k);
  visit(ModelField{"moe_d_ff", ModelField::MOE, "d_ff",
                    "MoE: hidden width of each expert's MLP; 0 = model.d_ff"},
        c.moe_d_ff);
  visit(ModelField{"moe_shared", ModelField::MOE, "shared",
                    "MoE: always-on shared experts per MoE block"},
        c.moe_shared);
  visit(ModelField{"moe_dense_layers", ModelField::MOE, "dense_layers",
                    "MoE: the first N blocks keep the dense MLP"},
        c.moe_dense_layers);
  visit(ModelField{"moe_sigmoid", ModelField::MOE, "sigmoid",
                    "MoE router scores: false = softmax, true = sigmoid (DeepSeek-V3)"},
        c.moe_sigmoid);
  visit(ModelField{"moe_renorm", ModelField::MOE, "renorm",
                    "MoE: renormalise the gates over the selected experts"},
        c.moe_renorm);
  visit(ModelField{"moe_route_scale", ModelField::MOE, "route_scale",
                    "MoE: factor on the gates after renormalisation (DeepSeek-V3: 2.5)"},
        c.moe_route_scale);
  visit(ModelField{"moe_groups", ModelField::MOE, "groups",
                    "MoE group-limited routing: the experts form this many groups"},
        c.moe_groups);
  visit(ModelField{"moe_topk_groups", ModelField::MOE, "topk_groups",
                    "MoE group-limited routing: tokens are routed inside their best N groups"},
        c.moe_topk_groups);
  visit(ModelField{"moe_capacity_factor", ModelField::MOE, "capacity_factor",
                    "MoE: > 0 = expert capacity ceil(k N / E x factor), overflow dropped; 0 = dropless"},
        c.moe_capacity_factor);
  visit(ModelField{"moe_aux_alpha", ModelField::MOE, "aux_alpha",
                    "MoE: Switch/GShard load-balancing loss coefficient (1e-2 typical; 0 = off)"},
        c.moe_aux_alpha);
  visit(ModelField{"moe_seq_aux_alpha", ModelField::MOE, "seq_aux_alpha",
                    "MoE: DeepSeek-V3 sequence-wise balance loss coefficient (1e-4 typical; 0 = off)"},
        c.moe_seq_aux_alpha);
  visit(ModelField{"moe_z_alpha", ModelField::MOE, "z_alpha",
                    "MoE: router z-loss coefficient (ST-MoE: 1e-3; 0 = off)"},
        c.moe_z_alpha);
  visit(ModelField{"moe_bias_gamma", ModelField::MOE, "bias_gamma",
                    "MoE: auxiliary-loss-free balancing bias update speed (DeepSeek-V3: 1e-3; 0 = off)"},
        c.moe_bias_gamma);
  visit(ModelField{"moe_shared_gate", ModelField::IF_SET, "moe_shared_gate",
                    "MoE: the shared experts' output is multiplied by sigmoid of a learned projection of the token (Qwen3-Next)"},
        c.moe_shared_gate);
  visit(ModelField{"method", ModelField::PEFT, "method",
                    "parameter-efficient fine-tuning: none | lora (adapters on peft.targets, every other weight frozen)"},
        c.peft_method);
  visit(ModelField{"rank", ModelField::PEFT, "rank",
                    "LoRA rank r of every adapter (at most the adapted layer's smaller dimension)"},
        c.lora_rank);
  visit(ModelField{"alpha", ModelField::PEFT, "alpha",
                    "LoRA alpha: the update is scaled by alpha / r (alpha / sqrt(r) with peft.rslora)"},
        c.lora_alpha);
  visit(ModelField{"rslora", ModelField::PEFT, "rslora",
                    "rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r"},
        c.lora_rslora);
  visit(ModelField{"targets", ModelField::PEFT, "targets",
                    "comma-separated layers LoRA adapts: q, k, v, o, gate, up, down (gpt2: any of q, k, v adapts c_attn whole; no gate)"},
        c.lora_targets);
  visit(ModelField{"quantize_base", ModelField::PEFT, "quantize_base",
                    "QLoRA: the frozen base's block matrices in NF4 (double-quantized scales), dequantized on the fly in the linear layers"},
        c.lora_quantize_base);
  visit(ModelField{"dropout", ModelField::PEFT, "dropout",
                    "LoRA dropout: the probability of zeroing an element of the adapters' input in training (PEFT's lora_dropout)"},
        c.lora_dropout);
  visit(ModelField{"dora", ModelField::PEFT, "dora",
                    "DoRA: each adapted row rescaled to a trained magnitude (PEFT's use_dora; the norm is not differentiated, as PEFT)"},
        c.lora_dora);
}

// `base` with the peft.* settings of `from` (train.init_from: the weights' model, the run's adapters).
ModelConfig with_peft_of(ModelConfig base, const ModelConfig& from);

// Named presets: "gpt2-tiny", "gpt2-small" (6L, d=384), "gpt2-124m", "llama-tiny", "moe-tiny",
// "mla-tiny", "gemma-tiny", "qwen3-next-tiny", "gpt-oss-tiny".
ModelConfig model_preset(std::string_view name);

int64_t param_count(const ModelConfig& config);
// Floats the KV cache keeps per position and layer: 2 n_kv_head head_dim (a key and a value per
// KV head) for MHA / GQA / MQA, d_c + d_r (the latent and the decoupled RoPE key) for MLA.
int64_t kv_cache_width(const ModelConfig& config);
// Parameters that take part in matmuls (the head counts once even when tied; position
// embeddings and norms do not): the N of the 6N FLOPs rule. For MoE the active ones: the
// router, top_k routed and the shared experts per token.
int64_t matmul_param_count(const ModelConfig& config);
// Training FLOPs per token at sequence length T (Kaplan et al. 2020; PaLM appendix B):
// 6N for the weight matmuls (2 forward + 4 backward) + 12 L C T for attention scores and
// values (non-causal count, as PaLM states MFU), over min(T, model.attn_window) keys with a window.
// MLA: 6 L T H (d_n + d_r + d_v) (a head's query/key and value widths).
double train_flops_per_token(const ModelConfig& config, int64_t seq_len);
// Forward FLOPs of one position attending to `keys` positions (itself included): 2N for the weight
// matmuls + 4 L C keys for its scores and values (MLA: 2 L H (qk + v) keys), keys capped by
// model.attn_window. The engine's prompt chunks are sized by it (infer/engine.h).
double forward_flops_per_position(const ModelConfig& config, int64_t keys);

}  // namespace loom
