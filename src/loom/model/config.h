// One config schema for the decoder-only models Loom builds. The architecture decides the
// block's pieces:
//   gpt2:  learned positions, LayerNorm, GELU MLP, MHA, biases, head tied to the embedding
//   llama: RoPE, RMSNorm, SwiGLU MLP, GQA, no biases, untied head
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace loom {

enum Arch : uint8_t { ARCH_GPT2, ARCH_LLAMA, ARCH_COUNT };

std::string_view arch_name(Arch arch);
Arch arch_from_name(std::string_view name);  // throws naming the accepted values

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
  float init_std = 0.02f;
  // Attention head width; 0: d_model / n_head. A tensor-parallel rank's slice of a model keeps
  // the whole model's head width with n_head / tp heads (parallel/tensor_parallel.h).
  int64_t head_size = 0;
  // Sliding-window attention (Beltagy et al. 2020, Longformer; Jiang et al. 2023, Mistral 7B):
  // 0: full causal attention; W > 0: position i attends to positions j with i - W < j <= i,
  // in training and in decoding (docs/inference.md).
  int64_t attn_window = 0;
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

  int64_t head_dim() const { return head_size > 0 ? head_size : d_model / n_head; }
  int64_t qkv_width() const { return (n_head + 2 * n_kv_head) * head_dim(); }
  bool mla() const { return mla_kv_rank > 0; }
  int64_t mla_nope() const { return mla_nope_dim > 0 ? mla_nope_dim : head_dim(); }  // d_n
  int64_t mla_v() const { return mla_v_dim > 0 ? mla_v_dim : head_dim(); }           // d_v
  int64_t mla_qk() const { return mla_nope() + mla_rope_dim; }                      // d_n + d_r
  // Width of the attention output (the input of the output projection): H d_v for MLA, H hd else.
  int64_t attn_width() const { return n_head * (mla() ? mla_v() : head_dim()); }
  bool has_bias() const { return arch == ARCH_GPT2; }
  bool learned_positions() const { return arch == ARCH_GPT2; }
  bool tied_head() const { return arch == ARCH_GPT2; }
  bool rmsnorm() const { return arch == ARCH_LLAMA; }
  bool swiglu() const { return arch == ARCH_LLAMA; }
  // Width of the MLP's first GEMM output: F (GELU) or 2F ([gate | up], SwiGLU).
  int64_t mlp_in_width() const { return swiglu() ? 2 * d_ff : d_ff; }
  // Mixture of experts: whether block `layer` is an MoE block, an expert's width and its first
  // GEMM's output width.
  bool moe_layer(int64_t layer) const { return moe_experts > 0 && layer >= moe_dense_layers; }
  int64_t expert_ff() const { return moe_d_ff > 0 ? moe_d_ff : d_ff; }
  int64_t expert_in_width() const { return swiglu() ? 2 * expert_ff() : expert_ff(); }

  void validate() const;  // throws naming the offending key (e.g. "model.n_head")
};

// Named presets: "gpt2-tiny", "gpt2-small" (6L, d=384), "gpt2-124m", "llama-tiny", "moe-tiny",
// "mla-tiny".
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

}  // namespace loom
